"""A HybridHostTier dropped with requests still swapped out gives their ids back to its
tables (they can be added again, nothing leaks); a tier moves only its own tables'
requests over a shared pool; `HybridTables.add(next_query=)` holds what a request in that
position holds."""

from __future__ import annotations

import gc

import pytest
from kvpool import (
    DuplicateRequestError,
    HybridHostTier,
    HybridTables,
    InvalidArgumentError,
    KvGroup,
    ModelKvSpec,
    Pool,
    UnknownRequestError,
)


def spec() -> ModelKvSpec:
    return ModelKvSpec(
        [
            KvGroup.sliding_window([0], 8, 1, 64),
            KvGroup.full([1], 1, 64),
            KvGroup.recurrent_state([2], 5000),
        ]
    )


@pytest.mark.parametrize("caching", [False, True])
def test_a_dropped_tier_gives_its_swapped_out_ids_back(caching: bool) -> None:
    s = spec()
    pool = Pool.for_spec(s, 32, device="host", enable_prefix_caching=caching)
    t = HybridTables(pool, s)
    tier = HybridHostTier(t, 12)
    t.add(1, 20)
    tier.swap_out([1])
    with pytest.raises(DuplicateRequestError):
        t.add(1, 1)
    host = tier.pool
    del tier
    gc.collect()
    assert host.num_used == 0, "the dropped tier's host pages leaked"
    t.add(1, 20)  # the id is free again
    t.fork(1, 2)
    t.check_invariants()
    t.free(1)
    t.free(2)
    assert pool.num_used == 0


def test_a_tier_moves_only_its_own_tables_requests() -> None:
    s = spec()
    pool = Pool.for_spec(s, 32, device="host")
    t = HybridTables(pool, s)
    other = HybridTables(pool, s)
    tier = HybridHostTier(t, 12)
    other.add(1, 5)
    # The tier moves `t`'s requests only: `other`'s request 1 is unknown to it.
    with pytest.raises(UnknownRequestError):
        tier.swap_out([1])
    assert 1 in other and len(tier) == 0


def test_add_at_a_next_query_holds_the_live_window_only() -> None:
    s = spec()
    pool = Pool.for_spec(s, 32, device="host")
    t = HybridTables(pool, s)
    t.add(1, 40)
    t.append_tokens(1, 1)  # next_query 40: the window keeps its third page only
    t.add(2, 41, next_query=40)
    for g in range(3):
        first1, ids1, n1 = t.table(1, g)
        first2, ids2, n2 = t.table(2, g)
        assert (first1, len(ids1), n1) == (first2, len(ids2), n2)
    assert t.next_query(2) == 40
    rows1, rows2 = t.request_pages(1), t.request_pages(2)
    assert rows1[:, :2].tolist() == rows2[:, :2].tolist()
    with pytest.raises(InvalidArgumentError, match="next_query"):
        t.add(3, 4, next_query=5)
    assert 3 not in t
    t.check_invariants()


def test_a_shrink_evicts_through_the_tables_with_per_group_events() -> None:
    """A growable caching pool shrunk through `HybridTables.shrink`: the cached pages it
    releases are reported removed under the groups (and chunk hashes) they were stored
    under, and no key is left behind (a later prompt misses, the invariants hold).
    `Pool.shrink` alone leaves the tables' cached pages cached."""
    from kvpool import BlockRemoved, BlockStored

    s = spec()
    pool = Pool.for_spec(
        s, growable=True, max_num_blocks=256, device="host", enable_prefix_caching=True
    )
    t = HybridTables(pool, s)
    pool.enable_kv_cache_events()
    prompt = list(range(200))
    t.add_request(0, prompt)
    t.cache_computed(0)
    t.free(0)
    stored = {
        (e.group, h)
        for e in pool.take_kv_events()
        if isinstance(e, BlockStored)
        for h in e.block_hashes
    }
    cached = pool.num_evictable
    assert cached > 0
    pool.shrink()
    assert pool.num_evictable == cached, "Pool.shrink evicted the tables' pages"
    assert pool.take_kv_events() == []
    released = t.shrink()
    assert released > 0 and pool.num_evictable == 0
    removed = [
        (e.group, h)
        for e in pool.take_kv_events()
        if isinstance(e, BlockRemoved)
        for h in e.block_hashes
    ]
    assert removed and set(removed) <= stored, "a removal names a hash never stored in its group"
    assert {g for g, _ in removed} == {g for g, _ in stored}
    t.check_invariants()
    assert t.add_request(1, prompt).num_cached_tokens == 0  # no stale key serves a hit
    t.check_invariants()
