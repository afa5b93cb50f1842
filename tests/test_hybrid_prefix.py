"""Prefix caching through the Python HybridTables: what each call returns on a small mixed
model (full + sliding window + recurrent state + MLA), and the calls that must fail (a clear
exception naming what was wrong, nothing changed). The random interleavings, with content
checks on the slab, are in tests/test_hybrid_prefix_state.py."""

from __future__ import annotations

import numpy as np
import pytest
from kvpool import (
    BlockRemoved,
    BlockStored,
    DuplicateRequestError,
    HybridHostTier,
    HybridTables,
    InvalidArgumentError,
    InvalidBlockError,
    KvGroup,
    ModelKvSpec,
    OutOfBlocksError,
    Pool,
    UnknownRequestError,
)

FULL, WINDOW, STATE, MLA = range(4)


def spec() -> ModelKvSpec:
    """1024-byte pages: full attention 16 tokens a page, a 20-token window (16 a page), a
    1500-byte state (2 pages a slot), an MLA latent of 32 + 8 (12 a page)."""
    return ModelKvSpec(
        [
            KvGroup.full([0], 1, 16),
            KvGroup.sliding_window([1], 20, 1, 16),
            KvGroup.recurrent_state([2], 1500),
            KvGroup.mla_latent([3], latent_dim=32, rope_dim=8),
        ],
        page_bytes=1024,
    )


def caching(num_pages: int = 64, **kwargs: object) -> HybridTables:
    s = spec()
    return HybridTables(
        Pool.for_spec(s, num_pages, device="host", enable_prefix_caching=True, **kwargs), s
    )


def snapshot(t: HybridTables) -> object:
    pool = t.pool
    out: list[object] = [pool.num_free, pool.num_evictable, pool.num_used, len(t)]
    out.append(t.cache_stats())
    out.append([t.cached_page_group(p) for p in range(pool.num_blocks)])
    out.append([pool.ref_cnt(p) for p in range(pool.num_blocks)])
    for rid in range(8):
        if rid in t:
            out.append((rid, t.num_tokens(rid), t.next_query(rid)))
            for g in range(t.spec.num_groups):
                first, ids, n = t.table(rid, g)
                out.append((rid, g, first, ids.tolist(), n))
    return out


def refused(t: HybridTables, error: type[Exception], needle: str, call, *args, **kwargs) -> None:
    before = snapshot(t)
    with pytest.raises(error, match=needle):
        call(*args, **kwargs)
    assert snapshot(t) == before
    t.check_invariants()


def test_for_spec_takes_the_prefix_caching_keywords():
    s = spec()
    assert not Pool.for_spec(s, 8, device="host").prefix_caching
    key = bytes(range(32))
    pool = Pool.for_spec(s, 8, device="host", enable_prefix_caching=True, prefix_hash_key=key)
    assert pool.prefix_caching and HybridTables(pool, s).prefix_caching
    assert not HybridTables(Pool.for_spec(s, 8, device="host"), s).prefix_caching
    with pytest.raises(InvalidArgumentError, match="prefix_hash_key needs enable_prefix_caching"):
        Pool.for_spec(s, 8, device="host", prefix_hash_key=key)
    with pytest.raises(InvalidArgumentError, match="32 bytes, got 31"):
        Pool.for_spec(s, 8, device="host", enable_prefix_caching=True, prefix_hash_key=key[:31])
    with pytest.raises(TypeError, match="prefix_hash_key"):
        Pool.for_spec(s, 8, device="host", enable_prefix_caching=True, prefix_hash_key="k" * 32)


def test_a_shared_prompt_hits_every_group_from_a_checkpoint():
    t = caching()
    prompt = list(range(1000, 1048))
    first = t.add_request(0, prompt[:40])
    assert first.num_cached_tokens == 0
    assert first.copies.dtype == np.int32 and first.copies.shape == (0, 3)
    assert t.next_query(0) == 0
    t.append_tokens(0, 8, prompt[40:48])
    assert t.next_query(0) == 40
    state_pages = t.state_slot(0, STATE).tolist()
    copies = t.checkpoint(0)
    # The slot's two pages copied into two fresh, cached, evictable pages.
    assert copies.dtype == np.int32 and copies.shape == (2, 3)
    assert copies[:, 0].tolist() == [STATE, STATE] and copies[:, 1].tolist() == state_pages
    assert [t.cached_page_group(int(p)) for p in copies[:, 2]] == [STATE, STATE]
    assert t.checkpoint(0).shape == (0, 3)  # already cached there: kept, no copies
    stats = t.cache_stats()
    assert len(stats) == 4 and stats[STATE] == {
        "cached_pages": 2,
        "evictable_pages": 2,
        "host_pages": 0,
    }
    # 48 tokens ran: full pages 0..2, window page 2 (the query at 48 sees 29..48), MLA 0..3.
    assert stats[FULL]["cached_pages"] == 3 and stats[MLA]["cached_pages"] == 4
    assert stats[FULL]["evictable_pages"] == 0  # request 0 holds them
    t.check_invariants()

    hit = t.add_request(1, [*prompt, 7, 7, 7])
    assert hit.num_cached_tokens == 48 and t.next_query(1) == 48
    # Full pages end at 48: shared. MLA page 3 (tokens 36..47) ends at 48 too. The state is a
    # copy of the checkpoint; nothing else is copied.
    assert t.table(1, FULL)[1].tolist()[:3] == t.table(0, FULL)[1].tolist()
    assert t.table(1, MLA)[1].tolist()[:4] == t.table(0, MLA)[1].tolist()
    assert hit.copies[:, 0].tolist() == [STATE, STATE]
    assert hit.copies[:, 1].tolist() == copies[:, 2].tolist()
    assert hit.copies[:, 2].tolist() == t.state_slot(1, STATE).tolist()
    t.check_invariants()
    # Salt, LoRA id and extra keys are part of every key: no hit under another.
    assert t.add_request(2, [*prompt, 7], cache_salt="tenant").num_cached_tokens == 0
    assert t.add_request(3, [*prompt, 7], lora_id=3).num_cached_tokens == 0
    assert t.add_request(4, [*prompt, 7], extra_keys=b"mm").num_cached_tokens == 0
    t.check_invariants()


def test_a_model_with_a_state_group_hits_only_at_checkpoints():
    t = caching()
    prompt = list(range(64))
    t.add_request(0, prompt)
    t.cache_computed(0)
    assert t.add_request(1, [*prompt, 1]).num_cached_tokens == 0
    t.checkpoint(0)
    assert t.add_request(2, [*prompt, 1]).num_cached_tokens == 64
    # A hit never covers the last token: the same prompt hits one chunk less, where there is
    # no checkpoint.
    assert t.add_request(3, prompt).num_cached_tokens == 0
    t.check_invariants()


def test_a_hit_inside_a_page_copies_that_page():
    """Without a state group: a hit ending inside a 12-token MLA page copies that page."""
    s = ModelKvSpec([KvGroup.full([0], 1, 16), KvGroup.mla_latent([1], 32, 8)], page_bytes=1024)
    t = HybridTables(Pool.for_spec(s, 32, device="host", enable_prefix_caching=True), s)
    t.add_request(0, list(range(40)))
    t.cache_computed(0)
    hit = t.add_request(1, [*range(32), 99])
    # MLA page 2 holds tokens 24..35: the hit at 32 ends inside it.
    assert hit.num_cached_tokens == 32
    assert hit.copies.tolist() == [[1, t.table(0, 1)[1][2], t.table(1, 1)[1][2]]]
    t.check_invariants()


def test_per_group_kv_events_come_from_the_pool():
    t = caching()
    t.pool.enable_kv_cache_events()
    t.add_request(0, list(range(32)))
    t.checkpoint(0)
    stored = [e for e in t.pool.take_kv_events() if isinstance(e, BlockStored)]
    assert sorted({e.group for e in stored}) == [FULL, WINDOW, STATE, MLA]
    full = [e for e in stored if e.group == FULL]
    state = [e for e in stored if e.group == STATE]
    assert full[0].block_size == 16 and len(full[0].block_hashes) == 2
    # A checkpoint names the chain hash at its position: the full group's last chunk's.
    assert state[0].block_hashes == full[0].block_hashes[-1:] and state[0].token_ids == []


def test_free_and_evict_conserve_pages_and_leak_nothing():
    t = caching(num_pages=24)
    for rid in range(3):
        t.add_request(rid, [rid * 100 + i for i in range(48)])
        t.checkpoint(rid)
        t.free(rid)
        pool = t.pool
        assert pool.num_free + pool.num_evictable + pool.num_used == pool.num_blocks
        t.check_invariants()
    assert t.pool.num_used == 0 and t.pool.num_evictable > 0
    # A fresh request bigger than the free list evicts, least recently used first.
    assert t.pool.num_free < t.spec.pages_to_add(80) <= t.pool.num_blocks
    t.add(9, 80)
    assert t.pool.prefix_cache_stats()["evictions"] > 0
    assert t.pool.num_free + t.pool.num_evictable + t.pool.num_used == t.pool.num_blocks
    t.check_invariants()
    t.free(9)
    assert t.pool.num_used == 0
    t.pool.reset_prefix_cache()
    assert t.pool.num_free == t.pool.num_blocks


def test_a_host_tier_keeps_evicted_pages_of_every_group_for_a_later_hit():
    s = spec()
    plain = Pool.for_spec(s, 8, device="host", enable_prefix_caching=True)
    assert plain.prefix_cache_host_base_ptr is None
    needs = "prefix_cache_host_blocks needs enable_prefix_caching"
    with pytest.raises(InvalidArgumentError, match=needs):
        Pool.for_spec(s, 8, device="host", prefix_cache_host_blocks=4)
    t = caching(num_pages=24, prefix_cache_host_blocks=64)
    pool = t.pool
    assert pool.prefix_cache_host_base_ptr is not None
    assert pool.prefix_cache_stats()["host_num_blocks"] == 64
    t.add_request(0, list(range(48)))
    t.checkpoint(0)
    t.free(0)
    pool.enable_kv_cache_events()
    # A request of 90 tokens takes 22 of the 24 pages: request 0's cached pages are evicted
    # and spill to the host tier, each group's removal and storing reported.
    t.add(9, 90)
    events = pool.take_kv_events()
    removed = {e.group for e in events if isinstance(e, BlockRemoved)}
    stored = {e.group for e in events if isinstance(e, BlockStored)}
    assert removed == stored == {FULL, WINDOW, STATE, MLA}, events
    stats = t.cache_stats()
    assert (
        sum(g["host_pages"] for g in stats) == pool.prefix_cache_stats()["host_num_cached_blocks"]
    )
    assert stats[STATE]["host_pages"] == 2  # the checkpoint, whole
    t.check_invariants()
    t.free(9)
    # The prompt's 48 tokens are cached on the two tiers together: every group serves them.
    hit = t.add_request(1, [*range(48), 7])
    assert hit.num_cached_tokens == 48 and hit.swapped_in_pages > 0
    assert pool.prefix_cache_stats()["swapped_in_blocks"] == hit.swapped_in_pages
    assert f"swapped_in_pages={hit.swapped_in_pages}" in repr(hit)
    back = {e.group for e in pool.take_kv_events() if isinstance(e, BlockRemoved)}
    assert STATE in back, back
    t.check_invariants()
    t.free(1)
    pool.reset_prefix_cache()
    assert all(g["host_pages"] == 0 for g in t.cache_stats())
    t.check_invariants()


def test_a_batched_append_counts_evictable_pages_and_a_refused_one_changes_nothing():
    t = caching(num_pages=24)
    t.add_request(5, list(range(500, 548)))
    t.checkpoint(5)
    t.free(5)
    t.add_request(0, list(range(15)))
    t.add_request(1, list(range(100, 115)))
    pool = t.pool
    assert pool.num_evictable > 0
    room = pool.num_free + pool.num_evictable
    # Each append of 17 tokens takes 2 pages in each token group (6); two need 12.
    need = 12
    assert pool.num_free < need <= room, (pool.num_free, room)
    ids = [*range(15, 32), *range(115, 132)]
    t.append_tokens_many([0, 1], 17, ids)
    t.check_invariants()
    assert t.num_tokens(0) == t.num_tokens(1) == 32
    # Now a batch that no free and evictable pages can cover: refused, nothing changed.
    big = 16 * 10
    many = t.append_tokens_many
    refused(t, OutOfBlocksError, "out of blocks", many, [0, 1], big, list(range(2 * big)))
    refused(t, OutOfBlocksError, "out of blocks", many, [0, 1], big)


def test_calls_that_must_fail_name_what_was_wrong_and_change_nothing():
    t = caching()
    t.add_request(0, list(range(40)))
    t.add_request(1, list(range(32)))
    t.check_invariants()
    refused(t, UnknownRequestError, "7", t.cache_computed, 7)
    refused(t, UnknownRequestError, "7", t.checkpoint, 7)
    refused(t, UnknownRequestError, "7", t.next_query, 7)
    refused(t, DuplicateRequestError, "0", t.add_request, 0, list(range(40)))
    refused(t, InvalidArgumentError, "positive multiple of 16.*40 tokens", t.checkpoint, 0)
    t.add_request(2, [])
    refused(t, InvalidArgumentError, "positive multiple of 16.*0 tokens", t.checkpoint, 2)
    t.append_tokens(1, 16)  # without ids: its tokens from 32 on are unknown
    refused(t, InvalidArgumentError, "48 tokens, 0 of them hashed", t.checkpoint, 1)
    refused(t, InvalidArgumentError, "n is 3 but 2 token ids", t.append_tokens, 0, 3, [1, 2])
    refused(
        t,
        InvalidArgumentError,
        "3 token ids for 4 tokens",
        t.append_tokens_many,
        [0, 1],
        2,
        [1, 2, 3],
    )
    refused(t, InvalidArgumentError, "token id -1", t.add_request, 5, [1, -1])
    refused(t, InvalidArgumentError, "token id 4294967296", t.append_tokens, 0, 1, [2**32])
    refused(t, InvalidArgumentError, "lora_id must be >= 0", t.add_request, 5, [1], lora_id=-1)
    refused(t, InvalidBlockError, "64", t.cached_page_group, 64)
    refused(t, InvalidBlockError, "-1", t.cached_page_group, -1)
    for call, args, kwargs in [
        (t.add_request, (5, "abc"), {}),
        (t.add_request, (5, [1.0]), {}),
        (t.add_request, (5, [1]), {"cache_salt": 1}),
        (t.add_request, (5, [1]), {"extra_keys": "x"}),
        (t.add_request, (5, [1]), {"lora_id": 1.5}),
        (t.add_request, ("5", [1]), {}),
        (t.append_tokens, (0, 1, "a"), {}),
        (t.append_tokens_many, ([0], 1, [True]), {}),
        (t.cache_computed, (None,), {}),
        (t.checkpoint, (1.0,), {}),
        (t.next_query, ("0",), {}),
        (t.cached_page_group, (1.0,), {}),
        (t.cached_page_group, (True,), {}),
    ]:
        refused(t, TypeError, ".", call, *args, **kwargs)


def test_caching_calls_on_a_pool_without_prefix_caching_are_refused():
    s = spec()
    t = HybridTables(Pool.for_spec(s, 64, device="host"), s)
    assert not t.prefix_caching
    # add_request is add there (no hit), as BlockTables.add_request on such a pool.
    assert t.add_request(0, list(range(48))).num_cached_tokens == 0
    refused(t, InvalidArgumentError, "cache_computed needs a pool made with", t.cache_computed, 0)
    refused(t, InvalidArgumentError, "prefix caching", t.checkpoint, 0)
    assert t.cache_stats() == [{"cached_pages": 0, "evictable_pages": 0, "host_pages": 0}] * 4
    assert t.cached_page_group(0) is None
    assert t.add_request(1, list(range(49))).num_cached_tokens == 0
    t.check_invariants()


def test_a_host_tier_swaps_a_caching_requests_every_group_and_its_pages_still_hit():
    t = caching(num_pages=64)
    tier = HybridHostTier(t, 32)
    prompt = list(range(300, 348))
    t.add_request(0, prompt)
    t.checkpoint(0)
    tier.swap_out([0])
    assert tier.location(0) == "host" and 0 not in t
    t.check_invariants()
    tier.check_invariants()
    # Its cached pages (and the checkpoint) stay in the device cache while it is away.
    assert t.add_request(1, [*prompt, 1]).num_cached_tokens == 48
    refused(t, DuplicateRequestError, "0", t.add_request, 0, prompt)
    tier.swap_in([0])
    assert t.num_tokens(0) == 48 and t.next_query(0) == 0
    # Its later chunks are cached from its new pages (and its state checkpointed there).
    t.append_tokens(0, 16, list(range(348, 364)))
    t.cache_computed(0)
    assert t.add_request(2, [*prompt, *range(348, 364), 5]).num_cached_tokens == 48
    assert len(t.checkpoint(0)) == 2
    assert t.add_request(3, [*prompt, *range(348, 364), 5]).num_cached_tokens == 64
    t.check_invariants()
    tier.check_invariants()
    for rid in (0, 1, 2, 3):
        t.free(rid)
    assert t.pool.num_used == 0


def test_a_growable_caching_pool_evicts_before_it_grows():
    s = spec()
    pool = Pool.for_spec(
        s,
        growable=True,
        max_num_blocks=1024,
        initial_num_blocks=16,
        chunk_bytes=64 * 1024,  # 64 pages a chunk
        device="host",
        enable_prefix_caching=True,
    )
    t = HybridTables(pool, s)
    t.add_request(0, list(range(64)))
    t.checkpoint(0)
    t.free(0)
    t.add_request(1, list(range(1000, 1008)))
    t.add_request(2, list(range(2000, 2008)))
    assert (pool.num_blocks, pool.num_free, pool.num_evictable) == (64, 38, 16)
    # 100 tokens each: 6 full, 6 window and 8 MLA pages, 40 for both: more than the free
    # pages, fewer than the free and evictable ones. Evicting, not growing.
    t.append_tokens_many([1, 2], 100, list(range(200)))
    assert pool.num_blocks == 64 and pool.prefix_cache_stats()["evictions"] >= 2
    t.check_invariants()
    # More than both: the pool grows.
    t.append_tokens_many([1, 2], 200, list(range(400)))
    assert pool.num_blocks > 64
    assert pool.num_free + pool.num_evictable + pool.num_used == pool.num_blocks
    t.check_invariants()
