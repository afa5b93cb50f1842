"""Hybrid tables on a GPU: a CUDA pool made from a spec, every group of scattered requests
swapped to the host and back byte for byte with each copy method (the device pages poisoned
in between), and the host pool's pinned memory holding the same bytes. Skipped without a GPU
(conftest.py)."""

from __future__ import annotations

import ctypes

import kvpool
import numpy as np
import pytest
from gpu_fixtures import cp
from kvpool import HybridHostTier, HybridTables, KvGroup, ModelKvSpec, Pool

pytestmark = pytest.mark.gpu

POISON = 0xA5


def mixed_spec() -> ModelKvSpec:
    return ModelKvSpec(
        [
            KvGroup.sliding_window(range(0, 8, 2), 64, 2, 64, "bfloat16"),
            KvGroup.full([1, 3], 2, 64, "bfloat16"),
            KvGroup.mla_latent([5], 512, 64, "bfloat16"),
            KvGroup.recurrent_state([7], 40_000),
        ],
        num_layers=8,
    )


def device_pages(pool: Pool):
    """The device slab as a CuPy uint8 array [num_blocks, block_bytes]."""
    nbytes = pool.num_blocks * pool.block_bytes
    mem = cp.cuda.UnownedMemory(pool.base_ptr, nbytes, pool)
    flat = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
    return flat.reshape(pool.num_blocks, pool.block_bytes)


def host_pages(pool: Pool) -> np.ndarray:
    n = pool.num_blocks * pool.block_bytes
    flat = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(pool.base_ptr))
    return flat.reshape(pool.num_blocks, pool.block_bytes)


def request_pages(tables: HybridTables, rid: int) -> list[tuple[int, int, int]]:
    """(group, page_index, page_id) of every page, in the tier's order."""
    out = []
    for g in range(tables.spec.num_groups):
        first, ids, _ = tables.table(rid, g)
        out.extend((g, first + i, int(p)) for i, p in enumerate(ids))
    return out


@pytest.mark.parametrize("method", ["auto", "batch", "runs"])
def test_every_group_round_trips_byte_exact(method):
    spec = mixed_spec()
    pool = Pool.for_spec(spec, 256, device="cuda")
    tables = HybridTables(pool, spec)
    try:
        tier = HybridHostTier(tables, 200, copy_method=method)
    except kvpool.InvalidArgumentError as e:  # "batch" on a driver without cuMemcpyBatchAsync
        pytest.skip(str(e))
    rng = np.random.default_rng(3)
    # Scattered pages: fillers taken between the requests are freed after.
    lens = [1, 15, 16, 130, 300]
    for i, n in enumerate(lens):
        tables.add(1000 + i, int(rng.integers(1, 40)))
        tables.add(i, n)
        tables.append_tokens(i, 1)  # the window moves: tables start past page 0
    for i in range(len(lens)):
        tables.free(1000 + i)
    slab = device_pages(pool)
    slab[...] = cp.asarray(rng.integers(0, 256, slab.shape, dtype=np.uint8))
    cp.cuda.runtime.deviceSynchronize()
    before = {
        r: {(g, k): cp.asnumpy(slab[p]) for g, k, p in request_pages(tables, r)}
        for r in range(len(lens))
    }
    firsts = {r: [tables.table(r, g)[0] for g in range(4)] for r in range(len(lens))}

    stats = tier.swap_out(list(range(len(lens))))
    assert stats["num_blocks"] == sum(len(v) for v in before.values())
    tier.wait()
    assert tier.num_pending == (0, 0) and pool.num_used == 0
    host = host_pages(tier.pool)
    for r, pages in before.items():
        _, _, rows = tier.swapped(r)
        for g, k, p in rows:
            assert (host[p] == pages[(int(g), int(k))]).all(), f"host copy of {r} group {g}"
    slab[...] = POISON
    cp.cuda.runtime.deviceSynchronize()

    tier.swap_in(list(range(len(lens))))
    tier.wait()
    cp.cuda.Stream.from_external(pool.stream).synchronize()
    for r, pages in before.items():
        assert [tables.table(r, g)[0] for g in range(4)] == firsts[r]
        for g, k, p in request_pages(tables, r):
            assert (cp.asnumpy(slab[p]) == pages[(g, k)]).all(), f"request {r} group {g} page {k}"
    tables.check_invariants()
    tier.check_invariants()
    assert tier.pool.num_used == 0
