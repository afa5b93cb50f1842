"""Growable pools on the host backend through the Python API: construction, growth on
demand, grow/shrink, errors, stats, views and block tables."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from kvpool import (
    BlockTables,
    InvalidArgumentError,
    InvalidBlockError,
    KvLayout,
    OutOfBlocksError,
    Pool,
)

LAYOUT = KvLayout(1, 1, 384, 1)  # 1536-byte blocks: with 4 KiB chunks, blocks straddle chunks
BLOCK = 1536
CHUNK = 4096


def growable(max_num_blocks: int = 64, **kw: int) -> Pool:
    pool = Pool(
        LAYOUT, growable=True, max_num_blocks=max_num_blocks, chunk_bytes=CHUNK, device="host", **kw
    )
    pool.check_invariants()
    return pool


def test_starts_empty_and_grows_on_demand() -> None:
    pool = growable()
    assert (pool.num_blocks, pool.max_num_blocks, pool.growable) == (0, 64, True)
    ids = pool.alloc_many(3)
    assert ids.tolist() == [0, 1, 2]
    assert pool.num_blocks == 5  # two chunks hold floor(8192 / 1536) blocks
    assert pool.alloc() == 3
    pool.check_invariants()


def test_initial_num_blocks_maps_whole_chunks() -> None:
    pool = growable(initial_num_blocks=3)
    assert (pool.num_blocks, pool.num_free) == (5, 5)
    stats = pool.stats()
    assert stats["growable"] is True
    assert stats["mapped_bytes"] == 2 * CHUNK
    assert stats["num_chunks"] == 2
    assert stats["chunk_bytes"] == CHUNK
    assert stats["max_num_blocks"] == 64
    assert stats["reserved_bytes"] == -(-64 * BLOCK // CHUNK) * CHUNK


def test_default_chunk_is_two_mib() -> None:
    pool = Pool(LAYOUT, growable=True, max_num_blocks=10_000, device="host")
    assert pool.stats()["chunk_bytes"] == 2 << 20
    pool.alloc()
    assert pool.num_blocks == (2 << 20) // BLOCK


def test_fixed_pools_report_themselves_as_one_chunk() -> None:
    pool = Pool(LAYOUT, 4, device="host")
    stats = pool.stats()
    assert (stats["growable"], stats["max_num_blocks"], stats["num_chunks"]) == (False, 4, 1)
    assert stats["mapped_bytes"] == stats["reserved_bytes"] == 4 * BLOCK
    assert pool.shrink() == 0
    with pytest.raises(InvalidArgumentError, match="growable"):
        pool.grow(8)
    pool.alloc_many(4)
    with pytest.raises(OutOfBlocksError) as e:
        pool.alloc()
    assert e.value.max_num_blocks is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"growable": True},
        {"growable": True, "max_num_blocks": 8, "num_blocks": 4},
        {"growable": True, "max_num_blocks": 8, "memory_bytes": 1 << 20},
        {"growable": True, "max_num_blocks": 0},
        {"growable": True, "max_num_blocks": 8, "initial_num_blocks": 9},
        {"growable": True, "max_num_blocks": -1},
        {"num_blocks": 4, "max_num_blocks": 8},
        {"num_blocks": 4, "initial_num_blocks": 2},
        {"num_blocks": 4, "chunk_bytes": 4096},
    ],
)
def test_inconsistent_arguments_are_rejected(kwargs: dict) -> None:
    with pytest.raises(kvpool.KvError):
        Pool(LAYOUT, device="host", **kwargs)


def test_growth_past_the_maximum_names_both_numbers_and_changes_nothing() -> None:
    pool = growable(10)
    held = pool.alloc_many(4)
    before = (pool.num_blocks, pool.num_free, pool.stats()["mapped_bytes"])
    with pytest.raises(OutOfBlocksError, match="max_num_blocks 10") as e:
        pool.alloc_many(7)
    assert (e.value.requested, e.value.free, e.value.num_blocks, e.value.max_num_blocks) == (
        7,
        1,
        5,
        10,
    )
    assert (pool.num_blocks, pool.num_free, pool.stats()["mapped_bytes"]) == before
    with pytest.raises(OutOfBlocksError, match="max_num_blocks 10"):
        pool.grow(11)
    with pytest.raises(OutOfBlocksError):
        pool.alloc_many(11)
    assert (pool.num_blocks, pool.num_free, pool.stats()["mapped_bytes"]) == before
    pool.check_invariants()
    assert len(pool.alloc_many(6)) == 6
    assert pool.num_blocks == 10
    pool.free_many(held)


def test_grow_and_shrink_return_bytes() -> None:
    pool = growable()
    assert pool.grow(8) == 3 * CHUNK
    assert pool.grow(8) == 0
    assert pool.grow(1) == 0
    ids = pool.alloc_many(8)
    assert pool.shrink() == 0
    pool.free_many(ids[3:])
    # Blocks 0..3 end at byte 4608, in chunk 1: chunk 2 goes.
    assert pool.shrink() == CHUNK
    assert (pool.num_blocks, pool.num_free) == (5, 2)
    pool.free_many(ids[:3])
    assert pool.shrink() == 2 * CHUNK
    assert (pool.num_blocks, pool.stats()["mapped_bytes"]) == (0, 0)
    with pytest.raises(InvalidBlockError):
        pool.free(0)
    pool.check_invariants()


def test_views_follow_num_blocks_and_data_survives_resizes() -> None:
    pool = growable()
    base = pool.base_ptr
    ids = pool.alloc_many(6)
    k = pool.k_view(0)
    assert k.shape == (pool.num_blocks, 1, 1, 384)
    for i in ids:
        pool.k_view(0)[i] = i + 0.5
        pool.v_view(0)[i] = -i
    pool.alloc_many(20)
    assert pool.base_ptr == base
    assert pool.k_view(0).shape[0] == pool.num_blocks >= 26
    pool.free_many(np.arange(6, 26))
    assert pool.shrink() > 0
    assert pool.k_view(0).shape[0] == pool.num_blocks < 26
    for i in ids:
        assert (pool.k_view(0)[i] == i + 0.5).all()
        assert (pool.v_view(0)[i] == -i).all()


def test_shrink_makes_low_ids_come_first() -> None:
    pool = growable()
    pool.alloc_many(20)
    pool.free_many([1, 3, 5])
    pool.free_many([17, 18, 19])
    pool.shrink()
    assert pool.alloc_many(3).tolist() == [1, 3, 5]


def test_block_tables_grow_the_pool_and_shrink_after_free() -> None:
    pool = growable(32)
    tables = BlockTables(pool, 8, 16)
    tables.add(1, 5)
    tables.append_tokens(1, 6)
    tables.add(2, 16)
    assert pool.num_blocks >= 27
    with pytest.raises(OutOfBlocksError):
        tables.add(3, 16)
    tables.check_invariants()
    tables.free(2)
    assert pool.shrink() > 0
    assert pool.num_blocks < 27
    tables.check_invariants()
    pool.check_invariants(exact_refs=True)


def test_decode_across_chunk_boundaries_matches_the_reference() -> None:
    layout = KvLayout(2, 2, 48, 4)  # 3 KiB blocks, 4 KiB chunks: most blocks straddle two chunks
    pool = Pool(layout, growable=True, max_num_blocks=64, chunk_bytes=CHUNK, device="host")
    rng = np.random.default_rng(0)
    tables = BlockTables(pool, 4, 8)
    lens = [5, 17, 32, 9]
    for r, n in enumerate(lens):
        tables.add(r, n)
    for layer in range(2):
        for view in (pool.k_view(layer), pool.v_view(layer)):
            view[...] = rng.standard_normal(view.shape).astype(np.float16)
    q = rng.standard_normal((4, 4, 48)).astype(np.float16)
    bt, sl = tables.block_table(range(4)), tables.seq_lens(range(4))
    assert any(
        (b * layout.block_bytes) // CHUNK != ((b + 1) * layout.block_bytes - 1) // CHUNK
        for b in bt.ravel()
        if b >= 0
    )
    out = kvpool.paged_attention_decode(q, pool, 1, bt, sl)
    expected = kvpool.reference.paged_attention_decode(
        q, pool.k_view(1), pool.v_view(1), bt, sl, layout.dtype, None
    )
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=1e-2, atol=1e-2)


def test_shrink_never_unmaps_what_a_live_view_covers() -> None:
    import gc

    pool = growable()
    ids = pool.alloc_many(40)
    v = pool.k_view(0)
    assert v.shape[0] == 40
    v[...] = 1.0
    pool.free_many(ids)
    assert pool.shrink() == 0, "the view covers every mapped chunk"
    assert pool.num_blocks == 40
    assert float(v.astype(np.float64).sum()) == 40 * 384  # reads the whole view: no fault
    pool.check_invariants()
    # Growth past the view is given back down to the view's extent, not below.
    pool.grow(60)
    released = pool.shrink()
    assert released > 0
    assert pool.num_blocks >= 40
    assert float(v.astype(np.float64).sum()) == 40 * 384
    # Once the view (and the array over it) is gone, shrink releases the memory.
    del v
    gc.collect()
    assert pool.shrink() > 0
    assert (pool.num_blocks, pool.stats()["mapped_bytes"]) == (0, 0)
    pool.check_invariants()


def test_a_view_keeps_its_extent_after_growth() -> None:
    import gc

    pool = growable()
    pool.grow(5)
    small = pool.k_view(0)
    ids = pool.alloc_many(30)
    assert small.shape[0] == 5
    assert pool.k_view(0).shape[0] == pool.num_blocks >= 30
    pool.free_many(ids)
    gc.collect()  # the temporary full-size view above is gone
    assert pool.shrink() > 0
    assert pool.num_blocks == 5  # 5 blocks fill two chunks: nothing of them goes
    small[...] = 2.0
    del small
    gc.collect()
    assert pool.shrink() == 2 * CHUNK
    pool.check_invariants()
