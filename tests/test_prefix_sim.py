"""The scheduler with prefix caching: shared prefixes and conversations really share (hit
rates computed by hand), caching never costs prefill tokens, and nothing leaks."""

from __future__ import annotations

import itertools

import kvpool
import numpy as np
import pytest
from kvpool.scheduler import Request, Scheduler, SchedulerConfig
from kvpool.scheduler.prefix import PrefixCachedKv
from kvpool.sim import generate, get_preset, parse_bytes
from kvpool.sim.runner import SimulationSpec, proxy_layout, simulate
from kvpool.sim.sharing import generate_multiturn, shares_prefixes, with_token_streams
from kvpool.sim.tokens import TokenStream, segment_ids

BS = 16
CONFIG = SchedulerConfig(max_model_len=512, max_running_seqs=8, max_tokens_per_step=512)


def serve(
    requests, num_blocks: int = 256, config: SchedulerConfig = CONFIG
) -> tuple[Scheduler, kvpool.Pool]:
    pool = kvpool.Pool(proxy_layout(BS), num_blocks, device="host", enable_prefix_caching=True)
    sched = Scheduler(
        PrefixCachedKv(pool, config.max_running_seqs, config.max_model_len), requests, config
    )
    sched.run()
    for seq in sched.seqs:
        assert seq.num_finishes == 1 and seq.generated == seq.request.output_tokens
    return sched, pool


def test_token_streams_share_exactly_their_prefix():
    reqs = with_token_streams([Request(i, 0.0, 100, 4, 0, i % 2, 70) for i in range(4)], seed=5)
    ids = [r.tokens.ids(104) for r in reqs]
    assert np.array_equal(ids[0][:70], ids[2][:70]) and np.array_equal(ids[1][:70], ids[3][:70])
    assert not np.array_equal(ids[0][:70], ids[1][:70])
    assert (ids[0][70:] != ids[2][70:]).mean() > 0.9  # private parts are unrelated
    again = with_token_streams([Request(i, 0.0, 100, 4, 0, i % 2, 70) for i in range(4)], seed=5)
    assert all(np.array_equal(a.tokens.ids(104), b) for a, b in zip(again, ids))
    assert shares_prefixes(reqs) and not shares_prefixes(
        with_token_streams([Request(0, 0.0, 9, 1), Request(1, 0.0, 9, 1)])
    )


def test_a_shorter_segment_is_a_prefix_of_a_longer_one():
    # Requests of one group with different prefix lengths, and a Mooncake block cut at a
    # prompt's end, rely on this.
    long = segment_ids(3, (1, 2), 5000)
    assert all(np.array_equal(segment_ids(3, (1, 2), n), long[:n]) for n in (1, 16, 511, 512, 3000))
    assert not np.array_equal(segment_ids(3, (1, 3), 16), long[:16])


@pytest.mark.parametrize("spacing_s", [1000.0, 0.0])
def test_prefix_groups_hit_rate_by_hand(spacing_s):
    # 6 requests of 100 prompt tokens alternating between 2 groups with a 70-token prefix:
    # 4 full blocks (64 tokens) are shared, the 5th block mixes shared and private tokens.
    # Each group's first request misses; the 4 others hit 64 tokens each. Requests added in
    # one step share too (blocks are cached when added).
    reqs = with_token_streams(
        [Request(i, i * spacing_s, 100, 4, 0, i % 2, 70) for i in range(6)], seed=1
    )
    sched, pool = serve(reqs)
    assert sched.num_queried_tokens == 600
    assert sched.num_cached_tokens == 4 * 64
    assert sched.metrics.arrays()["prefill_tokens"].sum() == 600 - 256
    stats = pool.prefix_cache_stats()
    assert (stats["queries"], stats["hits"]) == (600, 256)


def test_a_hit_never_covers_the_last_prompt_token():
    # Two identical 64-token prompts: the second hits 3 blocks, not the 4th (its last token).
    stream = TokenStream(0, (((1, 0), 80),))
    reqs = [Request(0, 0.0, 64, 4, tokens=stream), Request(1, 100.0, 64, 4, tokens=stream)]
    sched, _ = serve(reqs)
    assert sched.num_cached_tokens == 48


def test_multiturn_hit_rate_by_hand():
    # Turn 0: prompt 40, answer 30 (70 tokens, 4 full blocks once answered). Turn 1 arrives
    # after it finished: prompt 70 + 20 new = 90 tokens, of which 64 are cached.
    reqs = with_token_streams(
        [Request(0, 0.0, 40, 30, conversation_id=3), Request(1, 1000.0, 90, 5, conversation_id=3)],
        seed=2,
    )
    first, second = (r.tokens.ids(r.prompt_tokens + r.output_tokens) for r in reqs)
    assert np.array_equal(second[:70], first)
    sched, _ = serve(reqs)
    assert (sched.num_queried_tokens, sched.num_cached_tokens) == (130, 64)


def test_generated_multiturn_conversations_hold_their_history():
    reqs = generate_multiturn(40, turns=4, think_time_s=5.0, seed=3, max_model_len=4096)
    assert len(reqs) == 40 and shares_prefixes(reqs)
    by_conv: dict[int, list[Request]] = {}
    for r in reqs:
        by_conv.setdefault(r.conversation_id, []).append(r)
    assert all(len(turns) <= 4 for turns in by_conv.values()) and len(by_conv) >= 10
    for turns in by_conv.values():
        for a, b in itertools.pairwise(turns):
            assert (
                b.arrival_s >= a.arrival_s and b.prompt_tokens > a.prompt_tokens + a.output_tokens
            )
            assert np.array_equal(
                b.tokens.ids(b.prompt_tokens)[: a.prompt_tokens + a.output_tokens],
                a.tokens.ids(a.prompt_tokens + a.output_tokens),
            )
    assert generate_multiturn(40, turns=4, seed=3) == generate_multiturn(40, turns=4, seed=3)


def test_eviction_under_pressure_conserves_blocks():
    # A pool of 40 blocks for prompts of up to ~30 blocks: cached blocks must be evicted and
    # requests preempted; at the end every block is free or evictable, and free after reset.
    reqs = with_token_streams(
        generate("sharegpt", 60, seed=4, max_model_len=512, num_prefixes=3, prefix_tokens=200), 4
    )
    config = SchedulerConfig(max_model_len=512, max_running_seqs=16, max_tokens_per_step=256)
    sched, pool = serve(reqs, num_blocks=40, config=config)
    assert pool.prefix_cache_stats()["evictions"] > 0 and sched.num_cached_tokens > 0
    assert (
        pool.num_used == 0 and pool.num_free + pool.num_evictable == pool.num_blocks > pool.num_free
    )
    sched.backend.check_drained()  # resets the cache
    assert pool.num_free == pool.num_blocks and pool.num_evictable == 0 and pool.num_used == 0
    pool.check_invariants(exact_refs=True)


def _spec(requests, kv_memory: str = "256MiB") -> SimulationSpec:
    return SimulationSpec(
        preset=get_preset("llama-3-8b"),
        kv_memory_bytes=parse_bytes(kv_memory),
        requests=requests,
        config=SchedulerConfig(max_model_len=1024, max_running_seqs=32, max_tokens_per_step=512),
        device="host",
        prefix_caching=True,
    )


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ["prefixes", "multiturn"])
def test_caching_never_costs_prefill_tokens(seed, kind):
    if kind == "prefixes":
        reqs = with_token_streams(
            generate(
                "sharegpt", 40, seed=seed, max_model_len=1024, num_prefixes=2, prefix_tokens=300
            ),
            seed,
        )
    else:
        reqs = generate_multiturn(
            40, turns=3, think_time_s=2.0, seed=seed, rate=4.0, max_model_len=1024
        )
    report = simulate(_spec(reqs))
    on, off = report["results"]["paged_prefix_caching"], report["results"]["paged"]
    pc = report["prefix_caching"]
    assert on["completed"] == off["completed"] == 40
    assert on["prefill_tokens"] <= off["prefill_tokens"]
    assert (
        pc["hit_rate_tokens"] > 0.1
        and pc["prefill_tokens_saved"] == off["prefill_tokens"] - on["prefill_tokens"]
    )
    assert pc["hit_rate_tokens"] == pytest.approx(pc["pool_hit_rate_tokens"])
    assert off["cached_tokens"] == 0 and off["prefix_hit_rate"] == 0.0
    rates = [r for r in on["series"]["prefix_hit_rate"] if r is not None]
    assert rates and all(0.0 <= r <= 1.0 for r in rates)


def test_without_sharing_caching_finds_nothing():
    reqs = with_token_streams(generate("alpaca", 50, seed=0, max_model_len=1024))
    report = simulate(_spec(reqs, "1GiB"))
    assert report["prefix_caching"]["cached_tokens"] == 0
    assert (
        report["results"]["paged_prefix_caching"]["prefill_tokens"]
        == report["results"]["paged"]["prefill_tokens"]
    )


def test_backend_refuses_a_pool_without_caching():
    pool = kvpool.Pool(proxy_layout(BS), 8, device="host")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        PrefixCachedKv(pool, 2, 64)
