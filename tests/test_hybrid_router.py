"""A router's view of a hybrid pool: `HybridTables.kv_cache_snapshot()` and the pool's KV
events, applied by `kvpool.events.HybridCacheIndex`, answer the hit `add_request` finds
(`num_cached_tokens`) over random workloads with evictions and host-tier spills, and a
snapshot taken at any point plus the events after it equals the state rebuilt from every
event and a fresh snapshot."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvpool import (
    HybridTables,
    InvalidArgumentError,
    KvError,
    KvGroup,
    ModelKvSpec,
    Pool,
)
from kvpool.events import HybridCacheIndex


def spec() -> ModelKvSpec:
    """1024-byte pages, every token group's page a multiple of 16 tokens: full attention 32
    a page, a 40-token window 32 a page, 32-token local chunks 32 a page, MLA 16 a page, a
    1500-byte state (2 pages a slot)."""
    return ModelKvSpec(
        [
            KvGroup.full([0], 1, 8),
            KvGroup.sliding_window([1], 40, 1, 8),
            KvGroup.chunked_local([2], 32, 1, 8),
            KvGroup.recurrent_state([3], 1500),
            KvGroup.mla_latent([4], latent_dim=24, rope_dim=8),
        ],
        page_bytes=1024,
    )


def tables(num_pages: int, host_blocks: int | None) -> HybridTables:
    s = spec()
    pool = Pool.for_spec(
        s,
        num_pages,
        device="host",
        enable_prefix_caching=True,
        prefix_cache_host_blocks=host_blocks,
    )
    pool.enable_kv_cache_events(True)
    return HybridTables(pool, s)


# Prompts share heads of three fixed token streams, so hits (and partial ones) are common.
BASES = [[(b * 1000 + i * 7) % 997 for i in range(400)] for b in range(3)]

prompts = st.builds(
    lambda base, head, tail: BASES[base][:head] + [5000 + t for t in tail],
    st.integers(0, 2),
    st.one_of(st.integers(1, 150), st.sampled_from([33, 49, 65, 81, 129])),
    st.lists(st.integers(0, 50), max_size=3),
)


def continuation(tokens: list[int], n: int) -> list[int]:
    """The next `n` tokens of the base stream `tokens` follows, else tokens of its own."""
    for base in BASES:
        if base[: len(tokens)] == tokens and len(tokens) + n <= len(base):
            return base[len(tokens) : len(tokens) + n]
    return [6000 + (len(tokens) + i) % 900 for i in range(n)]


ops = st.one_of(
    st.tuples(st.just("add"), prompts),
    st.tuples(st.just("add"), prompts),
    st.tuples(st.just("append"), st.integers(0, 7), st.integers(1, 40)),
    st.tuples(st.just("checkpoint"), st.integers(0, 7)),
    st.tuples(st.just("checkpoint"), st.integers(0, 7)),
    st.tuples(st.just("computed"), st.integers(0, 7)),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("snapshot")),
)


def cached_set(t: HybridTables) -> dict[tuple[int, bytes], str]:
    return {(b.group, b.block_hash): b.medium for b in t.kv_cache_snapshot().blocks}


@pytest.mark.parametrize("host_blocks", [None, 16])
@given(workload=st.lists(ops, min_size=20, max_size=50))
def test_the_router_answers_the_hit_add_request_finds(
    host_blocks: int | None, workload: list[tuple[object, ...]]
) -> None:
    t = tables(80, host_blocks)
    from_start = HybridCacheIndex(t.spec)
    from_snapshot: HybridCacheIndex | None = None
    live: dict[int, list[int]] = {}
    next_id = 0
    for op in workload:
        events = t.pool.take_kv_events()
        from_start.apply(events)
        if from_snapshot is not None:
            from_snapshot.apply(events)
            assert from_snapshot.cached == from_start.cached
        assert from_start.cached == cached_set(t), op
        try:
            if op[0] == "add":
                tokens = list(op[1])  # type: ignore[call-overload]
                predicted = from_start.hit_tokens(from_start.chain(tokens), len(tokens))
                added = t.add_request(next_id, tokens)
                assert added.num_cached_tokens == predicted, (tokens, op)
                live[next_id] = tokens
                next_id += 1
            elif not live:
                continue
            elif op[0] == "snapshot":
                from_snapshot = HybridCacheIndex(t.spec)
                from_snapshot.load_snapshot(t.kv_cache_snapshot())
            else:
                rid = sorted(live)[int(op[1]) % len(live)]  # type: ignore[call-overload]
                if op[0] == "append":
                    new = continuation(live[rid], int(op[2]))  # type: ignore[call-overload]
                    t.append_tokens(rid, len(new), new)
                    live[rid] += new
                elif op[0] == "checkpoint":
                    # Up to the next chunk boundary first: checkpoints are at whole chunks.
                    new = continuation(live[rid], -len(live[rid]) % 16)
                    if new:
                        t.append_tokens(rid, len(new), new)
                        live[rid] += new
                    t.checkpoint(rid)
                elif op[0] == "computed":
                    t.cache_computed(rid)
                else:
                    t.cache_computed(rid)
                    t.free(rid)
                    del live[rid]
        except KvError:
            pass  # Out of pages, or a checkpoint off a chunk boundary: nothing changed.
        t.check_invariants()
    from_start.apply(t.pool.take_kv_events())
    assert from_start.cached == cached_set(t)


def test_the_snapshot_names_chunks_per_group_with_their_parents_and_seq() -> None:
    t = tables(48, 10)
    tokens = BASES[0][:64]
    t.add_request(0, tokens)
    t.cache_computed(0)
    stored = [e for e in t.pool.take_kv_events() if type(e).__name__ == "BlockStored"]
    snap = t.kv_cache_snapshot()
    assert snap.seq == max(e.seq for e in stored)
    assert snap.block_size == 16
    by_event = {
        (e.group, h): (p, e.medium)
        for e in stored
        for h, p in zip(e.block_hashes, [e.parent_block_hash, *e.block_hashes[:-1]])
    }
    assert {(b.group, b.block_hash): (b.parent_block_hash, b.medium) for b in snap.blocks} == (
        by_event
    )
    # Every token group holds the chunks of its pages; the state group none (no checkpoint).
    assert {b.group for b in snap.blocks} == {0, 1, 2, 4}
    # The pool alone cannot name them: it refuses rather than list its page tags.
    with pytest.raises(InvalidArgumentError, match="HybridTables.kv_cache_snapshot"):
        t.pool.kv_cache_snapshot()


def test_a_snapshot_needs_prefix_caching() -> None:
    s = spec()
    t = HybridTables(Pool.for_spec(s, 8, device="host"), s)
    with pytest.raises(InvalidArgumentError, match="enable_prefix_caching"):
        t.kv_cache_snapshot()


def test_the_router_counts_pages_the_host_tier_serves() -> None:
    t = tables(40, 64)
    index = HybridCacheIndex(t.spec)
    prompt = BASES[0][:64]
    t.add_request(0, prompt)
    t.checkpoint(0)
    t.free(0)
    # Other prompts take every page: the first request's pages spill to the host tier.
    for rid in range(1, 3):
        t.add_request(rid, [7000 + rid * 200 + i for i in range(150)])
        t.cache_computed(rid)
        t.free(rid)
    index.apply(t.pool.take_kv_events())
    assert sum(s["host_pages"] for s in t.cache_stats()) > 0
    longer = [*prompt, 1, 2, 3]
    predicted = index.hit_tokens(index.chain(longer), len(longer))
    added = t.add_request(9, longer)
    assert added.swapped_in_pages > 0
    assert (added.num_cached_tokens, predicted) == (64, 64)
    index.apply(t.pool.take_kv_events())
    assert index.cached == cached_set(t)


def test_a_window_hit_needs_every_page_the_window_sees() -> None:
    """The window's first page leaves (evicted) while the page after it and the full
    group's pages stay: a hit whose window still sees that first page is refused, by the
    tables and by the router (which must ask for the chunk each page ends on, not only the
    hit's last one)."""
    s = ModelKvSpec(
        [KvGroup.full([0], 1, 8), KvGroup.sliding_window([1], 40, 1, 8)], page_bytes=1024
    )
    # 23 pages: after the first request, an odd number are free, so the fillers (two pages
    # each) evict exactly one evictable page, the window's first.
    pool = Pool.for_spec(s, 23, device="host", enable_prefix_caching=True)
    pool.enable_kv_cache_events(True)
    t = HybridTables(pool, s)
    index = HybridCacheIndex(s)
    base = BASES[0]
    t.add_request(0, base[:16])
    for at in range(16, 112, 16):
        t.append_tokens(0, 16, base[at : at + 16])
    index.apply(pool.take_kv_events())
    chain = index.chain(base[:112])
    window_page_0 = (1, chain[1])  # the window's page of tokens 0..32, keyed at 32
    assert window_page_0 in index.cached
    rid = 1
    while window_page_0 in index.cached:
        t.add_request(rid, [8000 + rid * 16 + i for i in range(16)])
        rid += 1
        index.apply(pool.take_kv_events())
    assert {(1, chain[3]), (0, chain[1]), (0, chain[3])} <= set(index.cached)
    for filler in range(1, 6):  # Room for the prompts (uncached pages: nothing else leaves).
        t.free(filler)
    prompt = [*base[:64], 1]
    predicted = index.hit_tokens(index.chain(prompt), len(prompt))
    assert (t.add_request(99, prompt).num_cached_tokens, predicted) == (0, 0)
    # At 96 the window (tokens 57 on) no longer sees that page: the hit is served.
    prompt = [*base[:96], 1]
    predicted = index.hit_tokens(index.chain(prompt), len(prompt))
    assert (t.add_request(100, prompt).num_cached_tokens, predicted) == (96, 96)
