"""Growable CUDA pools (virtual memory management) on a GPU (marker `gpu`).

Data written before a growth reads back identical after it and after shrinking other
blocks; the driver's free memory falls after grow() and rises after shrink(); block-table
uploads work; the decode kernel reads blocks that straddle 2 MiB chunk boundaries correctly.
"""

from __future__ import annotations

import gc
from typing import Any

import kvpool
import numpy as np
import pytest
from attention_check import assert_attention_close
from gpu_fixtures import device_free_bytes
from kvpool import BlockTables, KvLayout, OutOfBlocksError, Pool, reference

pytestmark = pytest.mark.gpu

MiB = 1 << 20
LAYOUT = KvLayout(
    num_layers=3, num_kv_heads=2, head_dim=128, block_size=16
)  # 48 KiB: straddles 2 MiB


def growable(max_num_blocks: int, initial_num_blocks: int = 0, layout: KvLayout = LAYOUT) -> Pool:
    # Granularity-sized chunks (not the 256 MiB default), so these small pools span many chunks.
    pool = Pool(
        layout,
        growable=True,
        max_num_blocks=max_num_blocks,
        initial_num_blocks=initial_num_blocks,
        chunk_bytes=2 * MiB,
        device="cuda",
    )
    pool.check_invariants()
    return pool


# fill/check copy whole blocks (one contiguous region each) through block_ptr, not through
# CuPy arrays over pool views: a live view pins the chunks it covers against shrink(), so a
# view that outlives its step (under compute-sanitizer one did, although gc.collect() ran)
# turns "shrink released nothing" into a failure that says nothing about the pool.
def fill(cp: Any, pool: Pool, ids: np.ndarray, seed: int) -> dict[int, bytes]:
    """Writes random bytes into the blocks `ids` (all layers, K and V); returns them by id."""
    rng = np.random.default_rng(seed)
    written = {}
    for i in ids.tolist():
        data = rng.integers(0, 256, pool.layout.block_bytes, dtype=np.uint8)
        cp.cuda.runtime.memcpy(
            pool.block_ptr(i), data.ctypes.data, data.nbytes, cp.cuda.runtime.memcpyHostToDevice
        )
        written[i] = data.tobytes()
    return written


def check(cp: Any, pool: Pool, written: dict[int, bytes]) -> None:
    got = np.empty(pool.layout.block_bytes, dtype=np.uint8)
    for i, data in written.items():
        cp.cuda.runtime.memcpy(
            got.ctypes.data, pool.block_ptr(i), got.nbytes, cp.cuda.runtime.memcpyDeviceToHost
        )
        assert got.tobytes() == data, f"block {i} changed"
    pool.check_invariants()


def test_default_chunks_are_256_mib_or_the_whole_reservation(cp: Any) -> None:
    big = Pool(LAYOUT, growable=True, max_num_blocks=20_000, device="cuda")
    assert big.stats()["chunk_bytes"] == 256 * MiB
    small = Pool(LAYOUT, growable=True, max_num_blocks=100, device="cuda")
    reserved = 100 * LAYOUT.block_bytes
    assert small.stats()["chunk_bytes"] == -(-reserved // (2 * MiB)) * 2 * MiB


def test_chunks_are_the_driver_granularity(cp: Any) -> None:
    pool = growable(1000, 1)
    stats = pool.stats()
    assert stats["growable"] is True
    chunk = stats["chunk_bytes"]
    assert isinstance(chunk, int) and chunk >= 2 * MiB and chunk % (2 * MiB) == 0
    assert stats["mapped_bytes"] == chunk
    assert pool.num_blocks == chunk // LAYOUT.block_bytes
    assert stats["device_total_bytes"] > 0


def test_data_survives_growth_and_shrinking_others(cp: Any) -> None:
    pool = growable(4096, 64)
    base = pool.base_ptr
    first = pool.alloc_many(64)
    written = fill(cp, pool, first, seed=1)
    # Growth on demand, several chunks at once.
    second = pool.alloc_many(1000)
    assert pool.base_ptr == base
    assert pool.num_blocks >= 1064
    check(cp, pool, written)
    written.update(fill(cp, pool, second[::7], seed=2))
    # Free most of the second batch (keep a few), shrink: kept blocks keep their bytes.
    keep = second[::7]
    pool.free_many(np.setdiff1d(second, keep))
    mapped_before = pool.stats()["mapped_bytes"]
    freed_top = pool.shrink()  # the kept blocks reach near the top: little or nothing goes
    check(cp, pool, written)
    pool.free_many(keep)
    written = {i: data for i, data in written.items() if i in set(first.tolist())}
    freed = freed_top + pool.shrink()
    # Only the first 64 blocks (3 MiB) are live and no view exists: every chunk above the
    # ones they occupy is released.
    chunk = pool.stats()["chunk_bytes"]
    keep_bytes = -(-(int(first.max()) + 1) * LAYOUT.block_bytes // chunk) * chunk
    assert pool.stats()["mapped_bytes"] == keep_bytes
    assert freed == mapped_before - keep_bytes
    check(cp, pool, written)
    assert pool.num_blocks * LAYOUT.block_bytes <= pool.stats()["mapped_bytes"]
    pool.check_invariants()
    # Grow again: old data intact, new blocks writable.
    third = pool.alloc_many(2000)
    written.update(fill(cp, pool, third[-5:], seed=3))
    check(cp, pool, written)
    pool.check_invariants()


def test_device_memory_falls_on_grow_and_rises_on_shrink(cp: Any) -> None:
    grow_bytes = 512 * MiB
    pool = growable(max_num_blocks=(2 * grow_bytes) // LAYOUT.block_bytes)
    before = device_free_bytes(cp)
    mapped = pool.grow(grow_bytes // LAYOUT.block_bytes)
    assert mapped >= grow_bytes - pool.stats()["chunk_bytes"]
    after_grow = device_free_bytes(cp)
    assert before - after_grow >= 0.9 * mapped, (before, after_grow, mapped)
    released = pool.shrink()
    assert released == mapped
    after_shrink = device_free_bytes(cp)
    assert after_shrink - after_grow >= 0.9 * released, (after_grow, after_shrink, released)


def test_growth_past_the_maximum_changes_nothing(cp: Any) -> None:
    pool = growable(100)
    pool.alloc_many(60)
    before = pool.stats()
    with pytest.raises(OutOfBlocksError) as e:
        pool.alloc_many(50)
    assert e.value.max_num_blocks == 100
    after = pool.stats()
    for key in ("num_blocks", "num_free", "mapped_bytes", "num_chunks"):
        assert after[key] == before[key], key


def test_block_tables_sync_on_a_growable_pool(cp: Any) -> None:
    pool = growable(2048)
    tables = BlockTables(pool, 4, 64)
    for r in range(4):
        tables.add(r, 16 * 50)
    table_dev, _lens_dev = tables.sync()
    cp.cuda.runtime.deviceSynchronize()
    got = cp.asnumpy(cp.asarray(table_dev))[:4]
    np.testing.assert_array_equal(got[:, :50], tables.block_table(range(4))[:, :50])
    tables.check_invariants()


@pytest.mark.skipif(not hasattr(kvpool, "paged_attention_decode"), reason="no decode kernel")
def test_decode_over_blocks_straddling_chunks_matches_reference(cp: Any) -> None:
    layout = LAYOUT
    pool = growable(2048)
    ids = pool.alloc_many(600)  # ~28 MiB: 14 chunks, most chunk boundaries inside a block
    chunk = pool.stats()["chunk_bytes"]
    assert isinstance(chunk, int)
    bb = layout.block_bytes
    straddling = [b for b in ids.tolist() if (b * bb) // chunk != ((b + 1) * bb - 1) // chunk]
    assert len(straddling) >= 10
    rng = np.random.default_rng(5)
    for layer in range(layout.num_layers):
        for view in (pool.k_view(layer), pool.v_view(layer)):
            arr = cp.asarray(view)
            arr[...] = cp.asarray(rng.standard_normal(arr.shape).astype(np.float16))
    # Tables mixing straddling blocks with others, lengths ending mid-block and on a boundary.
    lens = np.array([5 * 16, 3 * 16 + 7, 11 * 16 + 1, 1], dtype=np.int32)
    need = [-(-int(n) // 16) for n in lens]
    others = [b for b in ids.tolist() if b not in set(straddling)]
    num_straddling = min(len(straddling), sum(need) // 2)
    pick = straddling[:num_straddling] + others[: sum(need) - num_straddling]
    assert len(pick) == sum(need)
    rng.shuffle(pick)
    tables = np.full((len(lens), max(need) + 2), -1, dtype=np.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = pick[at : at + n]
        at += n
    q = cp.asarray(rng.standard_normal((len(lens), 8, layout.head_dim)).astype(np.float16))
    out = kvpool.paged_attention_decode(
        q, pool, 2, cp.asarray(tables), cp.asarray(lens), max_seq_len=int(lens.max())
    )
    k = cp.asnumpy(cp.asarray(pool.k_view(2)))
    v = cp.asnumpy(cp.asarray(pool.v_view(2)))
    want = reference.paged_attention_decode(cp.asnumpy(q), k, v, tables, lens, layout.dtype)
    assert_attention_close(out, want, layout.dtype, "decode over chunk-straddling blocks")


def test_shrink_keeps_memory_a_live_view_covers(cp: Any) -> None:
    pool = growable(1024)
    ids = pool.alloc_many(200)  # ~9.4 MiB: 5 chunks of 2 MiB
    view = pool.k_view(0)
    arr = cp.asarray(view)
    arr[...] = 1
    pool.free_many(ids)
    assert pool.shrink() == 0, "the view covers every mapped chunk"
    assert pool.num_blocks >= 200
    # Reading the whole view after the shrink is legal (an unmapped chunk would be an
    # illegal address and poison the context).
    assert float(arr.astype(cp.float64).sum()) == arr.size
    cp.cuda.runtime.deviceSynchronize()
    pool.check_invariants()
    del arr, view
    gc.collect()
    assert pool.shrink() > 0
    assert (pool.num_blocks, pool.stats()["mapped_bytes"]) == (0, 0)
    pool.check_invariants()
