"""The paged scheduler preempting into a host tier: conservation on both tiers, no re-prefill
of a swapped request, the tier-full fallback, and recompute mode equal to no tier."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from kvpool.scheduler import Request, Scheduler, SchedulerConfig
from kvpool.scheduler.paged import PagedKv
from kvpool.scheduler.preemption import HostLink
from kvpool.scheduler.swap import HostTierSwapper
from kvpool.sim.costmodel import RooflineCost
from kvpool.sim.presets import get_preset
from kvpool.sim.runner import proxy_layout

BLOCK_SIZE = 16
NUM_BLOCKS = 48
LLAMA = get_preset("llama-3-8b")
COST = RooflineCost(LLAMA)
BLOCK_BYTES = LLAMA.layout(BLOCK_SIZE).block_bytes
CONFIG = SchedulerConfig(
    max_model_len=512, max_running_seqs=16, max_tokens_per_step=256, watermark=0.0
)


def workload(seed: int = 0, n: int = 40) -> list[Request]:
    """Everything at t=0, long outputs: 16 running sequences outgrow 48 blocks."""
    rng = np.random.default_rng(seed)
    return [
        Request(i, 0.0, int(rng.integers(8, 120)), int(rng.integers(60, 300))) for i in range(n)
    ]


def build(mode: str | None, host_blocks: int = 1024, link: HostLink = HostLink()):
    pool = kvpool.Pool(proxy_layout(BLOCK_SIZE), NUM_BLOCKS, device="host")
    backend = PagedKv(pool, CONFIG.max_running_seqs, CONFIG.max_model_len)
    swapper = None
    if mode is not None:
        swapper = HostTierSwapper(
            backend,
            host_blocks,
            mode=mode,
            link=link,
            prefill_s_per_token=COST.prefill_seconds(1),
            block_bytes=BLOCK_BYTES,
        )
    sched = Scheduler(
        backend, workload(), CONFIG, step_cost=COST, record_events=True, swapper=swapper
    )
    return sched, backend, swapper


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def check_conservation(sched, backend, swapper) -> None:
    """Every device block belongs to a running sequence, every host block to a swapped one."""
    backend.pool.check_invariants()
    running = [s for s in sched.seqs if s.running]
    swapped = [s for s in sched.seqs if s.swapped]
    assert backend.pool.num_used == sum(blocks(s.kv_tokens) for s in running)
    assert len(backend.tables) == len(running)
    if swapper is not None:
        swapper.tier.check_invariants()
        assert swapper.tier.pool.num_used == sum(blocks(s.kv_tokens) for s in swapped)
        assert sorted(swapper.tier.request_ids()) == sorted(s.request_id for s in swapped)
        for s in swapped:
            assert swapper.tier.location(s.request_id) == "host"
            assert swapper.tier.num_tokens(s.request_id) == s.kv_tokens
    else:
        assert not swapped


def run_checked(sched, backend, swapper) -> dict[int, list[tuple[int, int]]]:
    """Run to completion, checking conservation after every step; the prefill chunks
    (start, n) each request was given."""
    chunks: dict[int, list[tuple[int, int]]] = {s.request_id: [] for s in sched.seqs}
    while not sched.done:
        assert sched.step_index < 100_000
        sched.step()
        for seq, start, n in sched.last_plan.prefill:
            chunks[seq.request_id].append((start, n))
        check_conservation(sched, backend, swapper)
    for seq in sched.seqs:
        assert seq.num_finishes == 1 and seq.generated == seq.request.output_tokens
    backend.check_drained()
    if swapper is not None:
        swapper.check_drained()
    return chunks


def test_swap_mode_serves_everything_and_never_prefills_twice():
    sched, backend, swapper = build("swap")
    chunks = run_checked(sched, backend, swapper)
    c = swapper.counts
    assert c.swapped_out > 10, "the workload must preempt"
    assert c.swapped_in == c.swapped_out and c.recomputed == 0
    assert c.swapped_in_bytes == c.swapped_out_bytes > 0
    assert sched.num_preemptions == c.swapped_out and sched.recomputed_tokens == 0
    for seq in sched.seqs:  # each prompt prefilled once, in order, swapped or not
        starts = [start for start, _ in chunks[seq.request_id]]
        assert starts == sorted(starts) and starts[0] == 0
        assert sum(n for _, n in chunks[seq.request_id]) == seq.request.prompt_tokens
    swapped_ids = {e[2] for e in sched.events if e[1] == "swap_out"}
    assert swapped_ids and swapped_ids == {e[2] for e in sched.events if e[1] == "swap_in"}
    assert sum(sched.metrics.columns["prefill_tokens"]) == sum(r.prompt_tokens for r in workload())


def test_recompute_mode_is_no_tier():
    with_tier, backend, swapper = build("recompute")
    run_checked(with_tier, backend, swapper)
    no_tier, backend0, _ = build(None)
    run_checked(no_tier, backend0, None)
    assert (
        swapper.counts.swapped_out == 0 and swapper.counts.recomputed == no_tier.num_preemptions > 0
    )
    assert with_tier.recomputed_tokens == no_tier.recomputed_tokens > 0
    assert with_tier.events == no_tier.events
    assert with_tier.metrics.columns["time_s"] == no_tier.metrics.columns["time_s"]


def test_a_small_tier_falls_back_to_recompute():
    sched, backend, swapper = build("swap", host_blocks=6)
    run_checked(sched, backend, swapper)
    c = swapper.counts
    assert (
        c.swapped_out > 0 and c.recomputed_tier_full > 0 and c.recomputed == c.recomputed_tier_full
    )
    assert c.peak_host_blocks <= 6
    assert sched.recomputed_tokens > 0
    assert all(
        choice.reason == "tier full" for _, choice in swapper.choices if choice.kind == "recompute"
    )


def test_auto_follows_the_link():
    fast, backend, swapper = build("auto")
    run_checked(fast, backend, swapper)
    assert swapper.counts.swapped_out > 0
    assert all(
        ch.kind == ("swap" if ch.swap_s < ch.recompute_s else "recompute")
        for _, ch in swapper.choices
    )
    slow, backend, swapper = build("auto", link=HostLink(1e9, 15e-6))  # recompute always cheaper
    run_checked(slow, backend, swapper)
    assert swapper.counts.swapped_out == 0 and swapper.counts.recomputed == slow.num_preemptions > 0


def test_copy_time_is_charged_to_the_steps():
    sched, backend, swapper = build("swap")
    run_checked(sched, backend, swapper)
    c = swapper.counts
    link = HostLink()
    expected = (c.swapped_out + c.swapped_in) * link.latency_s + (
        c.swapped_out_bytes + c.swapped_in_bytes
    ) / link.bytes_per_s
    assert c.copy_s == pytest.approx(expected)
    no_tier, backend0, _ = build(None)
    run_checked(no_tier, backend0, None)
    assert sched.metrics.columns["time_s"] != no_tier.metrics.columns["time_s"]


def test_a_bad_mode_allocates_nothing():
    pool = kvpool.Pool(proxy_layout(BLOCK_SIZE), NUM_BLOCKS, device="host")
    backend = PagedKv(pool, CONFIG.max_running_seqs, CONFIG.max_model_len)
    with pytest.raises(ValueError, match="preemption mode"):
        HostTierSwapper(
            backend, 8, mode="always", prefill_s_per_token=1e-5, block_bytes=BLOCK_BYTES
        )
