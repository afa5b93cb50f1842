"""Prefix caching through the Python API: the last-token rule, salts, stats, reset, KV
events, bad input (a clear KvError, nothing changed), the KV a hit sees (host backend,
against a run with caching off) and many threads on one pool."""

from __future__ import annotations

import hashlib
import random
import threading

import kvpool
import numpy as np
import pytest
from kvpool import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockTables,
    CacheInUseError,
    InvalidArgumentError,
    KvError,
    KvLayout,
    Pool,
    UnknownRequestError,
    reference,
)

BS = 4
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BS, dtype="float32")


def make(num_blocks: int = 32, caching: bool = True, max_seqs: int = 8) -> tuple[Pool, BlockTables]:
    pool = Pool(LAYOUT, num_blocks, device="host", enable_prefix_caching=caching)
    return pool, BlockTables(pool, max_seqs, 16)


def snapshot(pool: Pool, tables: BlockTables) -> tuple[object, ...]:
    return (
        pool.num_free,
        pool.num_evictable,
        [pool.ref_cnt(b) for b in range(pool.num_blocks)],
        pool.prefix_cache_stats(),
        {r: tables.blocks(r).tolist() for r in tables.request_ids()},
        {r: tables.num_tokens(r) for r in tables.request_ids()},
    )


def test_a_hit_never_covers_the_last_prompt_token() -> None:
    pool, t = make()
    assert t.add_request(1, range(8)).num_cached_tokens == 0
    # Same 8 tokens: block 2 holds the last token, so only block 1 can hit.
    r = t.add_request(2, range(8))
    assert r.num_cached_tokens == 4
    assert r.slot_mapping.dtype == np.int64 and len(r.slot_mapping) == 4
    assert t.add_request(3, range(9)).num_cached_tokens == 8
    assert t.add_request(4, []).num_cached_tokens == 0
    assert t.add_request(5, [0]).num_cached_tokens == 0
    s = pool.prefix_cache_stats()
    assert (s["requests"], s["queries"], s["hits"]) == (5, 26, 12)
    assert s["hit_rate"] == pytest.approx(12 / 26)
    t.check_invariants()
    pool.check_invariants(exact_refs=True)


def test_a_block_at_the_most_references_takes_no_more_hits() -> None:
    # Reference counts are 16 bits. A cached block that 65,535 requests hold ends the hits of
    # the next request, which gets fresh blocks for the same tokens instead of an overflowed
    # count; once one holder is gone, the block takes hits again.
    most = 65_535
    pool = Pool(LAYOUT, most + 8, device="host", enable_prefix_caching=True)
    t = BlockTables(pool, most + 2, 4)
    prompt = range(BS + 1)  # one full block that can hit, and the block of the last token
    for rid in range(most):
        assert t.add_request(rid, prompt).num_cached_tokens == (0 if rid == 0 else BS)
    shared = int(t.blocks(0)[0])
    assert pool.ref_cnt(shared) == most
    extra = t.add_request(most, prompt)
    assert extra.num_cached_tokens == 0
    assert int(t.blocks(most)[0]) != shared and pool.ref_cnt(shared) == most
    pool.check_invariants(exact_refs=True)
    t.free(1)
    assert t.add_request(most + 1, prompt).num_cached_tokens == BS
    assert pool.ref_cnt(shared) == most
    for rid in t.request_ids():
        t.free(rid)
    assert pool.num_free + pool.num_evictable == pool.num_blocks
    t.check_invariants()
    pool.check_invariants(exact_refs=True)


def test_salts_lora_and_extra_keys_isolate() -> None:
    pool, t = make()
    t.add_request(0, range(9))
    assert t.add_request(1, range(9), cache_salt="a").num_cached_tokens == 0
    assert t.add_request(2, range(9), cache_salt=b"a").num_cached_tokens == 8, (
        "str and bytes salts agree"
    )
    assert t.add_request(3, range(9), lora_id=1).num_cached_tokens == 0
    assert t.add_request(4, range(9), extra_keys=b"image:1").num_cached_tokens == 0
    assert t.add_request(5, range(9), extra_keys=b"image:1").num_cached_tokens == 8
    assert t.add_request(6, range(9)).num_cached_tokens == 8


def test_caching_off_never_hits_and_keeps_the_api() -> None:
    pool, t = make(caching=False)
    assert not pool.prefix_caching
    for rid in range(3):
        assert t.add_request(rid, range(12)).num_cached_tokens == 0
    t.append_tokens(0, 4, [1, 2, 3, 4])
    assert pool.num_evictable == 0 and pool.reset_prefix_cache() == 0
    assert pool.prefix_cache_stats()["queries"] == 0
    assert pool.take_kv_events() == []
    with pytest.raises(InvalidArgumentError):
        pool.enable_kv_cache_events()


def test_decode_blocks_are_cached_as_they_fill() -> None:
    pool, t = make()
    t.add_request(1, [5, 6, 7])
    t.append_tokens(1, 1, [8])  # fills block 0
    t.append_tokens_many([1], [5], np.array([9, 10, 11, 12, 13], dtype=np.int32))  # fills block 1
    assert pool.prefix_cache_stats()["num_cached_blocks"] == 2
    assert t.add_request(2, [5, 6, 7, 8, 9, 10, 11, 12, 0]).num_cached_tokens == 8
    # Tokens of unknown content stop caching for that request.
    t.append_tokens(1, 3)
    t.append_tokens(1, 4, [0, 0, 0, 0])
    assert pool.prefix_cache_stats()["num_cached_blocks"] == 2


def test_free_makes_cached_blocks_evictable_and_reset_drops_them() -> None:
    pool, t = make(num_blocks=8)
    t.add_request(1, range(10))  # 2 cached blocks + 1 partial
    with pytest.raises(CacheInUseError) as e:
        pool.reset_prefix_cache()
    assert e.value.in_use == 2
    t.free(1)
    assert (pool.num_free, pool.num_evictable, pool.num_used) == (6, 2, 0)
    assert pool.stats()["num_evictable"] == 2
    assert pool.reset_prefix_cache() == 2
    assert (pool.num_free, pool.num_evictable) == (8, 0)
    assert t.add_request(2, range(10)).num_cached_tokens == 0
    pool.check_invariants(exact_refs=True)


def test_high_water_counts_referenced_blocks_not_evictable_ones() -> None:
    pool, t = make(num_blocks=8)
    t.add_request(1, range(10))  # 3 blocks, 2 of them cached
    t.free(1)
    assert (pool.num_free, pool.num_evictable, pool.num_used, pool.high_water) == (6, 2, 0, 3)
    t.add_request(2, range(20, 44))  # 6 blocks from the free list: none free, 2 evictable
    assert (pool.num_free, pool.num_evictable, pool.num_used) == (0, 2, 6)
    assert pool.high_water == 6 and pool.stats()["high_water"] == 6, (
        "evictable blocks are not in use"
    )
    t.free(2)
    assert (pool.num_evictable, pool.num_used, pool.high_water) == (8, 0, 6)
    # Reviving 6 cached blocks and evicting 1 for the last token: 7 in use.
    assert t.add_request(3, [*range(20, 44), 99]).num_cached_tokens == 24
    assert (pool.num_evictable, pool.num_used, pool.high_water) == (1, 7, 7)
    pool.check_invariants(exact_refs=True)


def test_one_decode_step_reports_each_requests_blocks_with_their_parent() -> None:
    pool, t = make()
    pool.enable_kv_cache_events()
    t.add_request(1, [1, 2, 3])
    t.add_request(2, [4, 5, 6, 7, 8, 9, 10])
    (first,) = pool.take_kv_events()
    assert first.token_ids == [4, 5, 6, 7]
    # One step fills request 1's block 0 and request 2's block 1: stored under one lock,
    # reported as two runs (their chains differ).
    t.append_tokens_many(np.array([1, 2]), 1, np.array([4, 11], dtype=np.int32))
    e1, e2 = pool.take_kv_events()
    assert (e1.token_ids, e1.parent_block_hash) == ([1, 2, 3, 4], None)
    assert (e2.token_ids, e2.parent_block_hash) == ([8, 9, 10, 11], first.block_hashes[0])
    # Request 1 filling two blocks in one step is one run.
    t.append_tokens(1, 8, np.arange(5, 13, dtype=np.uint32))
    (run,) = pool.take_kv_events()
    assert run.token_ids == list(range(5, 13)) and run.parent_block_hash == e1.block_hashes[0]
    assert len(run.block_hashes) == 2
    pool.check_invariants(exact_refs=True)


def test_kv_events_follow_vllm_names_and_order() -> None:
    pool, t = make(num_blocks=4)
    t.add_request(9, range(9))
    assert pool.take_kv_events() == [], "events are opt-in"
    t.free(9)
    pool.reset_prefix_cache()
    pool.enable_kv_cache_events()
    t.add_request(1, range(9), lora_id=3, cache_salt="secret")
    stored = pool.take_kv_events()
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    e = stored[0]
    assert len(e.block_hashes) == 2 and all(
        isinstance(h, bytes) and len(h) == 32 for h in e.block_hashes
    )
    assert e.parent_block_hash is None and e.token_ids == list(range(8))
    assert (e.block_size, e.lora_id, e.medium) == (BS, 3, "CPU")
    assert b"secret" not in repr(e).encode()
    t.append_tokens(1, 3, [8, 9, 10])  # fills block 2: its parent is block 1's hash
    (e2,) = pool.take_kv_events()
    assert e2.parent_block_hash == e.block_hashes[1] and e2.token_ids == [8, 8, 9, 10]
    t.free(1)
    t.add(2, 16)  # needs all 4 blocks: evicts the 3 cached ones, tail first
    (removed,) = pool.take_kv_events()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [e2.block_hashes[0], e.block_hashes[1], e.block_hashes[0]]
    t.free(2)
    pool.reset_prefix_cache()
    (cleared,) = pool.take_kv_events()
    assert isinstance(cleared, AllBlocksCleared)
    pool.enable_kv_cache_events(False)
    t.add_request(3, range(9))
    assert pool.take_kv_events() == []


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda t: t.add_request(1, "abc"), TypeError),
        (lambda t: t.add_request(1, b"abc"), TypeError),
        (lambda t: t.add_request(1, [1, 2.5]), TypeError),
        (lambda t: t.add_request(1, [1, True]), TypeError),
        (lambda t: t.add_request(1, [1, -1]), InvalidArgumentError),
        (lambda t: t.add_request(1, [1, 2**32]), InvalidArgumentError),
        (lambda t: t.add_request(1, np.array([1, -1], dtype=np.int32)), InvalidArgumentError),
        (lambda t: t.add_request(1, np.array([1, 2**32], dtype=np.int64)), InvalidArgumentError),
        (lambda t: t.add_request(1, np.arange(8, dtype=np.int64)[::-2] - 5), InvalidArgumentError),
        (lambda t: t.add_request(1, np.zeros((2, 2), dtype=np.int64)), InvalidArgumentError),
        (lambda t: t.add_request(1, np.zeros(3, dtype=np.float32)), TypeError),
        (lambda t: t.add_request(1, 5), TypeError),
        (lambda t: t.add_request(1, [1], cache_salt=3), TypeError),
        (lambda t: t.add_request(1, [1], extra_keys="not bytes"), TypeError),
        (lambda t: t.add_request(1, [1], lora_id=-1), InvalidArgumentError),
        (lambda t: t.add_request(1, [1], lora_id=True), TypeError),
        (lambda t: t.add_request(0, [1]), kvpool.DuplicateRequestError),
        (lambda t: t.append_tokens(0, 2, [1]), InvalidArgumentError),
        (lambda t: t.append_tokens(0, 1, ["x"]), TypeError),
        (lambda t: t.append_tokens_many([0], [2], [1, 2, 3]), InvalidArgumentError),
        (lambda t: t.append_tokens(77, 1, [1]), UnknownRequestError),
        (lambda t: t.append_tokens_many([0, 77], [1, 1], [1, 2]), UnknownRequestError),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, error) -> None:  # type: ignore[no-untyped-def]
    pool, t = make()
    t.add_request(0, range(6))
    before = snapshot(pool, t)
    with pytest.raises(error) as e:
        call(t)
    assert issubclass(e.type, KvError) or e.type is TypeError  # a wrong type is a TypeError
    assert snapshot(pool, t) == before
    pool.check_invariants(exact_refs=True)


def test_growable_pools_evict_before_growing_and_shrink_past_the_cache() -> None:
    # 2048-byte blocks, 4 KiB chunks: two blocks per chunk.
    pool = Pool(
        LAYOUT,
        growable=True,
        max_num_blocks=8,
        chunk_bytes=4096,
        device="host",
        enable_prefix_caching=True,
    )
    t = BlockTables(pool, 4, 8)
    t.add_request(1, range(9))  # blocks 0, 1 (cached), 2: the pool grows to 2 chunks
    t.add(2, 12)  # 3 more blocks, none evictable: grows to 3 chunks
    assert (pool.num_blocks, pool.num_free) == (6, 0)
    high = max(t.blocks(2).tolist())
    t.free(1)
    assert (pool.num_free, pool.num_evictable, pool.num_used) == (1, 2, 3)
    # A hit revives the cached blocks of a growable pool like any other.
    assert t.add_request(3, range(9)).num_cached_tokens == 8
    t.free(3)
    # A shrink never drops a referenced block, nor evicts cached blocks below one.
    assert pool.shrink() == 0 and pool.num_evictable == 2 and pool.ref_cnt(high) == 1
    pool.check_invariants(exact_refs=True)
    # Needing 4 with 1 free + 2 evictable: grows by what is missing, evicts the rest.
    evictions = pool.prefix_cache_stats()["evictions"]
    t.add(4, 16)
    assert pool.num_blocks == 8  # 7 needed, a whole chunk mapped: 3 free, so 1 evicted
    assert (pool.prefix_cache_stats()["evictions"] - evictions, pool.num_evictable) == (1, 1)
    pool.check_invariants(exact_refs=True)
    t.free(4)
    t.free(2)
    # Nothing referenced: the shrink evicts the cached blocks that hold chunks and releases all.
    assert pool.shrink() > 0
    assert (pool.num_blocks, pool.num_evictable, pool.num_used) == (0, 0, 0)
    assert pool.prefix_cache_stats()["num_cached_blocks"] == 0
    pool.check_invariants(exact_refs=True)
    # Past max_num_blocks even counting the evictable blocks: refused, nothing changed.
    t.add_request(5, range(9))
    t.free(5)
    t.add(7, 1)
    assert (pool.num_blocks, pool.num_free, pool.num_evictable) == (4, 1, 2)
    with pytest.raises(kvpool.OutOfBlocksError, match="max_num_blocks"):
        t.add(6, 32)  # 8 blocks: 3 at hand, 5 more would pass max_num_blocks
    assert (pool.num_blocks, pool.num_free, pool.num_evictable) == (4, 1, 2)
    pool.check_invariants(exact_refs=True)


# --- content: a hit sees exactly the KV it would have computed ---------------------------------


def token_kv(tokens: list[int], salt: str | None, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """A stand-in model: position p's K/V depend on every token up to p (and the salt)."""
    rows_k, rows_v = [], []
    for p in range(len(tokens)):
        seed = hashlib.blake2b(
            repr((salt, layer, tokens[: p + 1])).encode(), digest_size=8
        ).digest()
        rng = np.random.default_rng(int.from_bytes(seed, "little"))
        rows_k.append(rng.standard_normal((LAYOUT.num_kv_heads, LAYOUT.head_dim)))
        rows_v.append(rng.standard_normal((LAYOUT.num_kv_heads, LAYOUT.head_dim)))
    return np.array(rows_k, dtype=np.float32), np.array(rows_v, dtype=np.float32)


def run_workload(caching: bool) -> dict[int, list[np.ndarray]]:
    """Adds prompts with shared prefixes, decodes a few tokens each, frees some on the way;
    writes each computed token's K/V with append_kv. Returns every request's gathered KV."""
    pool, t = make(num_blocks=40, caching=caching, max_seqs=16)
    rng = random.Random(5)
    system = [rng.randrange(50) for _ in range(11)]
    requests: dict[int, tuple[list[int], str | None]] = {}
    seen: dict[int, list[np.ndarray]] = {}

    def write(rid: int, start: int, slots: np.ndarray) -> None:
        tokens, salt = requests[rid]
        for layer in range(LAYOUT.num_layers):
            k, v = token_kv(tokens, salt, layer)
            kvpool.append_kv(k[start:], v[start:], pool, layer, slots)

    def gather(rid: int) -> list[np.ndarray]:
        n = t.num_tokens(rid)
        table = t.blocks(rid)
        return [
            reference.gather_kv(view, table, n).copy()
            for layer in range(LAYOUT.num_layers)
            for view in (pool.k_view(layer), pool.v_view(layer))
        ]

    for rid in range(12):
        salt = "tenant" if rid % 4 == 3 else None
        prompt = system[: rng.randrange(len(system) + 1)] + [
            rng.randrange(50) for _ in range(rng.randrange(1, 7))
        ]
        requests[rid] = (prompt, salt)
        r = t.add_request(rid, prompt, cache_salt=salt)
        if not caching:
            assert r.num_cached_tokens == 0
        write(rid, r.num_cached_tokens, r.slot_mapping)
        for _ in range(rng.randrange(6)):
            token = rng.randrange(50)
            requests[rid][0].append(token)
            slots, copies = t.append_tokens(rid, 1, [token])
            assert len(copies) == 0
            write(rid, len(requests[rid][0]) - 1, slots)
        seen[rid] = gather(rid)
        if rng.random() < 0.5:
            t.free(rid)
    if caching:
        assert pool.prefix_cache_stats()["hits"] > 0, "the workload must hit"
    pool.check_invariants(exact_refs=True)
    return seen


def test_hits_see_exactly_the_kv_computed_without_caching() -> None:
    with_cache, without = run_workload(True), run_workload(False)
    for rid in without:
        for a, b in zip(with_cache[rid], without[rid]):
            np.testing.assert_array_equal(a, b)


def test_the_content_check_can_fail() -> None:
    """Mutation: a wrong salt in the stand-in model changes the KV, and the comparison sees it."""
    a = token_kv([1, 2, 3], None, 0)[0]
    b = token_kv([1, 2, 3], "x", 0)[0]
    assert not np.array_equal(a, b)


# --- threads ------------------------------------------------------------------------------------


def test_threads_share_one_cached_pool() -> None:
    pool = Pool(LAYOUT, 64, device="host", enable_prefix_caching=True)
    system = list(range(100, 120))
    failures: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        tables = BlockTables(pool, 6, 16)
        live: list[int] = []
        try:
            start.wait()
            for step in range(300):
                if live and (len(live) == 6 or rng.random() < 0.45):
                    tables.free(live.pop(rng.randrange(len(live))))
                    continue
                prompt = system[: rng.randrange(4, 21)] + [
                    rng.randrange(4) for _ in range(rng.randrange(3))
                ]
                try:
                    tables.add_request(step, prompt, cache_salt=rng.choice([None, "a"]))
                except kvpool.OutOfBlocksError:
                    continue
                live.append(step)
                if rng.random() < 0.5:
                    tables.append_tokens(step, 2, [rng.randrange(4), rng.randrange(4)])
            for rid in live:
                tables.free(rid)
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failures, failures
    assert pool.num_used == 0
    assert pool.num_free + pool.num_evictable == pool.num_blocks
    pool.check_invariants(exact_refs=True)
    assert pool.prefix_cache_stats()["hits"] > 0
    evictable = pool.num_evictable
    assert pool.reset_prefix_cache() == evictable
    assert pool.num_free == pool.num_blocks
