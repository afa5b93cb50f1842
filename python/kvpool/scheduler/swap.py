"""The swapper: preemption into a kvpool.HostTier for the paged backend (design: preemption.md).

The scheduler (core.py) asks `preempt(seq)` for every victim; the swapper picks swap or
recompute (preemption.choose_preemption) and, for a swap, moves the request's blocks to the
host tier with `HostTier.swap_out`. A swapped-out request waits in the scheduler's queue with
its KV on the host; when its turn comes, `try_swap_in` brings it back into the block tables
(`HostTier.swap_in`) and it resumes where it stopped, without a prefill.

The copies' modelled time (HostLink) is added to the step that makes them: the step's
allocations wait for the swap-out to free the device blocks, its kernels for the swap-in.
Overlap with other work on the copy stream is not modelled. On a CUDA pool the swapper waits
for every swap-out (`HostTier.wait`) so the device blocks are back on the free list before
the scheduler counts them; on a host pool the copies are synchronous.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import kvpool
from kvpool.scheduler.paged import PagedKv
from kvpool.scheduler.preemption import HostLink, PreemptionChoice, check_mode, choose_preemption
from kvpool.scheduler.seq import Seq


@dataclass(frozen=True, slots=True)
class HostTierSpec:
    """A host tier for a simulation: its capacity in the model's bytes, the preemption mode
    and the link."""

    memory_bytes: int
    mode: str = "auto"
    link: HostLink = HostLink()


@dataclass(slots=True)
class SwapCounts:
    """What the swapper did during a run."""

    swapped_out: int = 0  # preemptions by swap
    swapped_in: int = 0
    recomputed: int = 0  # preemptions by recompute, every reason
    recomputed_tier_full: int = 0  # of which: the host tier had no room
    swapped_out_bytes: int = 0  # modelled bytes (the model's blocks), out direction
    swapped_in_bytes: int = 0
    swapped_tokens: int = 0  # tokens whose KV was saved by a swap instead of recomputed
    copy_s: float = 0.0  # modelled time of every copy, added to the steps
    peak_host_blocks: int = 0


class HostTierSwapper:
    """Swap preemption for one PagedKv backend, through a host tier of `num_host_blocks`
    blocks. `block_bytes` is the model's block size in bytes (the pool may be a stand-in
    layout); `prefill_s_per_token` the cost model's recompute time of one token."""

    def __init__(
        self,
        backend: PagedKv,
        num_host_blocks: int,
        *,
        mode: str = "auto",
        link: HostLink = HostLink(),
        prefill_s_per_token: float,
        block_bytes: int,
    ) -> None:
        check_mode(mode)  # before the tier is allocated
        self.backend = backend
        self.tier = kvpool.HostTier(backend.tables, num_blocks=num_host_blocks)
        self.mode = mode
        self.link = link
        self.prefill_s_per_token = prefill_s_per_token
        self.block_bytes = block_bytes
        self.counts = SwapCounts()
        self.choices: list[tuple[int, PreemptionChoice]] = []  # (request id, choice), in order
        self._on_cuda = backend.pool.device != "host"
        self._pending_copy_s = 0.0

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.backend.block_size)

    def preempt(self, seq: Seq) -> bool:
        """Swap `seq` out (True) or leave it to the caller to recompute (False, nothing done)."""
        num_blocks = self._blocks(seq.kv_tokens)
        self.tier.poll()  # host blocks of finished swap-ins are free again
        choice = choose_preemption(
            self.mode,
            kv_tokens=seq.kv_tokens,
            swap_bytes=num_blocks * self.block_bytes,
            host_blocks_needed=num_blocks,
            host_blocks_free=self.tier.pool.num_free,
            link=self.link,
            prefill_s_per_token=self.prefill_s_per_token,
        )
        self.choices.append((seq.request_id, choice))
        c = self.counts
        if choice.kind == "recompute":
            c.recomputed += 1
            c.recomputed_tier_full += choice.reason == "tier full"
            return False
        t0 = time.perf_counter()
        self.tier.swap_out([seq.request_id])
        if self._on_cuda:  # the scheduler counts the device blocks as free right away
            self.tier.wait()
        self.backend.alloc_s += time.perf_counter() - t0
        self._copied(num_blocks)
        c.swapped_out += 1
        c.swapped_out_bytes += num_blocks * self.block_bytes
        c.swapped_tokens += seq.kv_tokens
        c.peak_host_blocks = max(c.peak_host_blocks, self.tier.pool.num_used)
        return True

    def try_swap_in(self, seq: Seq, watermark_blocks: int) -> bool:
        """Bring a swapped-out `seq` back if the pool has room for its blocks and the rest of
        its prefill (as admission asks) above the watermark; False changes nothing."""
        need = self._blocks(max(seq.kv_tokens, seq.prefill_target))
        pool = self.backend.pool
        if need + watermark_blocks > pool.num_free:
            return False
        t0 = time.perf_counter()
        self.tier.swap_in([seq.request_id])
        self.tier.poll()  # host blocks of finished copies go back to the tier's free list
        self.backend.alloc_s += time.perf_counter() - t0
        num_blocks = self._blocks(seq.kv_tokens)
        self._copied(num_blocks)
        self.counts.swapped_in += 1
        self.counts.swapped_in_bytes += num_blocks * self.block_bytes
        return True

    def _copied(self, num_blocks: int) -> None:
        seconds = self.link.copy_seconds(num_blocks * self.block_bytes)
        self._pending_copy_s += seconds
        self.counts.copy_s += seconds

    def take_copy_seconds(self) -> float:
        """Modelled copy time since the last call (the scheduler adds it to the step)."""
        seconds, self._pending_copy_s = self._pending_copy_s, 0.0
        return seconds

    def check_drained(self) -> None:
        """After a run: nothing left on the host tier, every host block free, invariants hold."""
        self.tier.wait()
        if len(self.tier) != 0:
            raise AssertionError(f"the host tier still holds {len(self.tier)} requests")
        host = self.tier.pool
        if host.num_free != host.num_blocks:
            raise AssertionError(f"{host.num_blocks - host.num_free} host blocks leaked")
        self.tier.check_invariants()

    def summary(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "host_blocks": self.tier.pool.num_blocks,
            "host_link_bytes_per_s": self.link.bytes_per_s,
            "host_link_latency_s": self.link.latency_s,
            "recompute_s_per_token": self.prefill_s_per_token,
            **asdict(self.counts),
        }
