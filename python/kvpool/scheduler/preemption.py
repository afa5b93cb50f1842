"""Preemption by swap or by recompute: what each costs, and the choice between them.

A preempted request loses its GPU blocks. Either its KV is copied to the host tier and copied
back when it resumes (swap), or it is dropped and its tokens are prefilled again when it
resumes (recompute). Per victim:

    swap cost      = 2 x (KV bytes / host-link bandwidth + one copy call's latency)
                     (out now, in later; whole blocks move)
    recompute cost = tokens whose KV is dropped x 2 x params FLOPs / prefill throughput
                     (the cost model's compute term, RooflineCost.prefill_seconds)

`auto` takes the cheaper one; `swap` and `recompute` force a mode. A swap needs room for the
victim's blocks in the host tier: when it is full, the victim is recomputed whatever the mode.
A victim that holds no KV has nothing to save and is recomputed.

For Llama-3-8B (2 MiB blocks of 16 float16 tokens) at 55 GB/s one block costs 106 us to swap
out and back against 27 us per token to recompute at 60 % of an H200's float16 peak: swap
wins from 4 tokens on. On a link slower than about 9.7 GB/s recompute wins for any length.
"""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass(frozen=True, slots=True)
class HostLink:
    """The host <-> GPU copy path of the host tier, each way.

    Defaults: measured on an H200 with pinned memory (`bench/kvbench.py --routine swap`, recorded in
    bench/results/2026-12-01_26340ab_h200x2/hosttier/swap_h200.json): one 1 GiB copy ran at
    55.5 GB/s host to device and 55.5 GB/s device to host (`ceiling_1gib`); one swap call of a
    single 64 KiB block took 14.7 us end to end (`swap_out_latency_us` of the small layout at
    num_blocks 1), which is almost all fixed cost.
    """

    bytes_per_s: float = 55e9
    latency_s: float = 15e-6

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0 or self.bytes_per_s == float("inf"):
            raise ValueError(
                f"host link bandwidth must be a finite number > 0 bytes/s, got {self.bytes_per_s}"
            )
        if not 0 <= self.latency_s < float("inf"):
            raise ValueError(
                f"host link latency must be a finite number >= 0 s, got {self.latency_s}"
            )

    def copy_seconds(self, nbytes: int) -> float:
        """One swap call (one direction) moving `nbytes`."""
        return nbytes / self.bytes_per_s + self.latency_s


@dataclass(frozen=True, slots=True)
class PreemptionChoice:
    """How one victim is preempted and why. `reason` is one of: "cheaper" (auto picked the
    lower cost), "forced" (the mode said so), "tier full", "no KV"."""

    kind: str  # "swap" or "recompute"
    reason: str
    swap_s: float  # modelled cost of swapping out and back in
    recompute_s: float  # modelled cost of prefilling the dropped tokens again


def check_mode(mode: str) -> None:
    if mode not in PREEMPTION_MODES:
        raise ValueError(
            f"preemption mode must be one of {', '.join(PREEMPTION_MODES)}, got {mode!r}"
        )


def swap_seconds(swap_bytes: int, link: HostLink) -> float:
    """Out now and in later: two copies of the victim's blocks."""
    return 2.0 * link.copy_seconds(swap_bytes)


def choose_preemption(
    mode: str,
    *,
    kv_tokens: int,
    swap_bytes: int,
    host_blocks_needed: int,
    host_blocks_free: int,
    link: HostLink,
    prefill_s_per_token: float,
) -> PreemptionChoice:
    """Swap or recompute one victim holding `kv_tokens` tokens in blocks of `swap_bytes` bytes
    (all of them), given the host tier's free blocks."""
    check_mode(mode)
    swap_s = swap_seconds(swap_bytes, link)
    recompute_s = kv_tokens * prefill_s_per_token
    if mode == "recompute":
        return PreemptionChoice("recompute", "forced", swap_s, recompute_s)
    if kv_tokens == 0:
        return PreemptionChoice("recompute", "no KV", swap_s, recompute_s)
    if host_blocks_needed > host_blocks_free:
        return PreemptionChoice("recompute", "tier full", swap_s, recompute_s)
    if mode == "swap":
        return PreemptionChoice("swap", "forced", swap_s, recompute_s)
    if swap_s < recompute_s:
        return PreemptionChoice("swap", "cheaper", swap_s, recompute_s)
    return PreemptionChoice("recompute", "cheaper", swap_s, recompute_s)
