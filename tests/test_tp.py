"""Tensor-parallel pool groups on the host backend: sharded layouts, one allocator and one set of
tables over N slabs, per-rank decode equal to the decode over the concatenated heads."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from kvpool import KvLayout, PoolGroup


def test_shard_layout_splits_heads_and_ranges_cover_them():
    layout = KvLayout(2, 8, 64, 16)
    for tp in (1, 2, 4, 8):
        shard = layout.tp_shard(tp)
        assert shard.num_kv_heads == 8 // tp
        assert shard.block_bytes * tp == layout.block_bytes
        ranges = [layout.tp_head_range(tp, r) for r in range(tp)]
        assert [h for a, b in ranges for h in range(a, b)] == list(range(8))


def test_more_ranks_than_heads_replicates_each_head():
    layout = KvLayout(2, 2, 64, 16)
    assert layout.tp_shard(8).num_kv_heads == 1
    assert [layout.tp_head_range(8, r) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4


@pytest.mark.parametrize("tp", [3, 6, 0])
def test_heads_that_do_not_shard_are_refused_naming_both(tp):
    with pytest.raises(
        kvpool.KvError, match="tp_size" if tp == 0 else f"num_kv_heads 4 .*tp_size {tp}"
    ):
        KvLayout(2, 4, 64, 16).tp_shard(tp)


def test_group_refuses_bad_arguments():
    layout = KvLayout(2, 4, 64, 16)
    with pytest.raises(kvpool.LayoutError, match="num_kv_heads 4"):
        PoolGroup(layout, 3, 8, devices="host")
    with pytest.raises(kvpool.InvalidArgumentError, match="tp_size"):
        PoolGroup(layout, True, 8, devices="host")
    with pytest.raises(kvpool.InvalidArgumentError, match="2 devices given for tp_size 4"):
        PoolGroup(layout, 4, 8, devices=["host", "host"])
    with pytest.raises(kvpool.InvalidArgumentError, match="own CUDA device"):
        PoolGroup(layout, 2, 8, devices=["cuda:0", "cuda:0"])
    with pytest.raises(kvpool.InvalidArgumentError, match="exactly one"):
        PoolGroup(layout, 2, devices="host")


def test_one_allocator_drives_every_rank_and_mirrors_stay_unallocated():
    group = PoolGroup(KvLayout(2, 4, 64, 16), 2, 32, devices="host")
    tables = group.tables(8, 8)
    tables.add(1, 40)
    tables.add(2, 17)
    tables.append_tokens_many([1, 2], 1)
    group.check_invariants(tables)
    assert group.primary.num_used == 3 + 2
    assert all(p.num_used == 0 and p.num_blocks == 32 for p in group.pools[1:])
    per_rank = group.sync(tables)
    assert len(per_rank) == 2
    np.testing.assert_array_equal(per_rank[0][0], per_rank[1][0])
    tables.free(1)
    tables.free(2)
    group.check_invariants(tables)
    assert group.primary.num_used == 0


def test_an_allocation_on_a_mirror_breaks_the_invariant():
    group = PoolGroup(KvLayout(2, 4, 64, 16), 2, 8, devices="host")
    block = group.pools[1].alloc()
    with pytest.raises(kvpool.KvError, match="mirror pool of rank 1 has 1 blocks allocated"):
        group.check_invariants()
    group.pools[1].free(block)
    group.check_invariants()


def test_tables_of_another_pool_are_refused():
    group = PoolGroup(KvLayout(2, 4, 64, 16), 2, 8, devices="host")
    other = kvpool.BlockTables(group.pools[1], 2, 2)
    with pytest.raises(kvpool.InvalidArgumentError, match="primary"):
        group.sync(other)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_decode_equals_decode_over_the_concatenated_heads(tp):
    """Each rank decodes its shard (its KV heads and their query heads); the outputs, side by
    side, equal one decode over the full layout. tp=8 over 4 heads replicates each head."""
    rng = np.random.default_rng(tp)
    full = KvLayout(2, 4, 64, 16)
    hq = 8
    group = PoolGroup(full, tp, 16, devices="host")
    single = kvpool.Pool(full, 16, device="host")
    tables, ref_tables = group.tables(4, 4), kvpool.BlockTables(single, 4, 4)
    lens = [37, 5, 16]
    for rid, n in enumerate(lens):
        slots = tables.add(rid, n)
        np.testing.assert_array_equal(slots, ref_tables.add(rid, n))
        for layer in range(full.num_layers):
            k = rng.standard_normal((n, 4, 64)).astype(np.float16)
            v = rng.standard_normal((n, 4, 64)).astype(np.float16)
            kvpool.append_kv(k, v, single, layer, slots)
            for rank, pool in enumerate(group.pools):
                a, b = group.head_range(rank)
                kvpool.append_kv(
                    np.ascontiguousarray(k[:, a:b]),
                    np.ascontiguousarray(v[:, a:b]),
                    pool,
                    layer,
                    slots,
                )
    q = rng.standard_normal((len(lens), hq, 64)).astype(np.float16)
    per_rank = group.sync(tables)
    bt, sl = ref_tables.sync()
    for layer in range(full.num_layers):
        want = kvpool.paged_attention_decode(q, single, layer, bt, sl)
        q_per_rank = hq // tp
        got = np.concatenate(
            [
                kvpool.paged_attention_decode(
                    np.ascontiguousarray(q[:, r * q_per_rank : (r + 1) * q_per_rank]),
                    pool,
                    layer,
                    *per_rank[r],
                )
                for r, pool in enumerate(group.pools)
            ],
            axis=1,
        )
        np.testing.assert_array_equal(got, want)


def test_a_mirror_sync_needs_the_same_blocks_and_a_gpu():
    layout = KvLayout(2, 4, 64, 16)
    primary = kvpool.Pool(layout, 8, device="host")
    tables = kvpool.BlockTables(primary, 2, 2)
    with pytest.raises(
        kvpool.InvalidArgumentError, match="hold the tables' pool's 8 blocks, it holds 9"
    ):
        tables.sync(pool=kvpool.Pool(layout, 9, device="host"))
    with pytest.raises(kvpool.InvalidArgumentError, match="CUDA device"):
        tables.sync(pool=kvpool.Pool(layout, 8, device="host"))
    table, seq_lens = tables.sync(pool=primary)  # its own pool: a plain sync
    assert table.shape == (0, 2) and seq_lens.shape == (0,)
