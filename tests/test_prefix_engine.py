"""What an engine and a router need from the prefix cache: a lookup that changes nothing
and a settable hash key."""

import kvpool
import numpy as np
import pytest
from kvpool import BlockStored, BlockTables, KvLayout, Pool

BS = 4


def make_pool(num_blocks=16, **kwargs):
    layout = KvLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=BS, dtype="float16")
    return Pool(layout, num_blocks, device="host", enable_prefix_caching=True, **kwargs)


def observable(pool):
    refs = [pool.ref_cnt(b) for b in range(pool.num_blocks)]
    return refs, pool.num_evictable, pool.num_free, pool.prefix_cache_stats()


def test_lookup_prefix_answers_what_add_request_finds_and_changes_nothing():
    pool = make_pool()
    tables = BlockTables(pool, 8, 8)
    pool.enable_kv_cache_events()
    prompt = np.arange(100, 113)
    assert pool.lookup_prefix(prompt) == 0
    tables.add_request(1, prompt[:12])
    tables.add_request(2, prompt[:8], cache_salt="s")
    tables.free(1)
    assert pool.take_kv_events()
    before = observable(pool)
    assert pool.lookup_prefix(prompt[:12]) == 8  # the last token's block never hits
    assert pool.lookup_prefix(prompt) == 12
    assert pool.lookup_prefix(list(prompt)) == 12
    assert pool.lookup_prefix(prompt, cache_salt="s") == 8  # both full blocks were cached
    assert pool.lookup_prefix(prompt, cache_salt=b"other") == 0
    assert pool.lookup_prefix(prompt, extra_keys=b"img") == 0
    assert pool.lookup_prefix(prompt, lora_id=3) == 0
    assert observable(pool) == before
    assert pool.take_kv_events() == []
    pool.check_invariants()
    expected = pool.lookup_prefix(prompt)
    assert tables.add_request(3, prompt).num_cached_tokens == expected


def test_lookup_prefix_on_a_pool_without_prefix_caching_is_zero():
    layout = KvLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=BS, dtype="float16")
    assert Pool(layout, 4, device="host").lookup_prefix(range(9)) == 0


def test_lookup_prefix_refuses_bad_arguments():
    pool = make_pool()
    with pytest.raises(TypeError):
        pool.lookup_prefix("abc")
    with pytest.raises(kvpool.InvalidArgumentError):
        pool.lookup_prefix([-1, 2])
    with pytest.raises(TypeError):
        pool.lookup_prefix([1], extra_keys="x")


def stored_hashes(pool):
    return [h for e in pool.take_kv_events() if isinstance(e, BlockStored) for h in e.block_hashes]


def run_prompt(**kwargs):
    pool = make_pool(**kwargs)
    tables = BlockTables(pool, 8, 8)
    pool.enable_kv_cache_events()
    tables.add_request(1, range(9))
    return stored_hashes(pool)


def test_pools_with_one_hash_key_emit_the_same_block_hashes():
    key = bytes(range(32))
    first = run_prompt(prefix_hash_key=key)
    assert len(first) == 2
    assert first == run_prompt(prefix_hash_key=key)
    assert first != run_prompt(prefix_hash_key=bytes(32))
    assert run_prompt() != run_prompt(), "the default key is random per pool"


def test_prefix_hash_key_is_checked():
    with pytest.raises(kvpool.InvalidArgumentError, match="32 bytes"):
        make_pool(prefix_hash_key=b"short")
    with pytest.raises(TypeError):
        make_pool(prefix_hash_key="x" * 32)
    layout = KvLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=BS, dtype="float16")
    with pytest.raises(kvpool.InvalidArgumentError, match="enable_prefix_caching"):
        Pool(layout, 4, device="host", prefix_hash_key=bytes(32))
