"""Pool on a CUDA device, seen from CuPy (and PyTorch when it is installed).

Every test here is marked `gpu`; conftest.py skips them unless CuPy imports and
`kvpool.cuda_available()` is True.
"""

from __future__ import annotations

import gc
import importlib.util
from typing import Any

import kvpool
import numpy as np
import pytest
from gpu_fixtures import device_free_bytes
from kvpool import KvLayout, OutOfBlocksError, Pool

pytestmark = pytest.mark.gpu

MiB = 1 << 20
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)  # 16 KiB blocks
UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def raw_slab(cp: Any, pool: Pool, dtype: Any) -> Any:
    """The whole slab as one flat CuPy array (independent of the pool's views)."""
    nbytes = pool.stats()["mapped_bytes"]
    assert isinstance(nbytes, int)
    memory = cp.cuda.UnownedMemory(pool.base_ptr, nbytes, owner=pool)
    return cp.ndarray(
        (nbytes // np.dtype(dtype).itemsize,), dtype=dtype, memptr=cp.cuda.MemoryPointer(memory, 0)
    )


def test_create_alloc_free_destroy(cp: Any) -> None:
    pool = Pool(LAYOUT, 64, device="cuda")
    assert pool.device == "cuda:0"
    assert pool.base_ptr % 256 == 0
    ids = pool.alloc_many(16)
    assert ids.dtype == np.int32 and sorted(ids.tolist()) == sorted(set(ids.tolist()))
    one = pool.alloc()
    for i in [*ids.tolist(), one]:
        assert pool.ref_cnt(i) == 1
        assert pool.block_ptr(i) == pool.base_ptr + i * LAYOUT.block_bytes
    with pytest.raises(OutOfBlocksError):
        pool.alloc_many(64)
    pool.free(one)
    pool.free_many(ids)
    assert pool.num_free == 64
    pool.check_invariants()
    del pool
    gc.collect()


def test_cuda_ordinal_spelling(cp: Any) -> None:
    assert Pool(LAYOUT, 4, device="cuda:0").device == "cuda:0"
    count = cp.cuda.runtime.getDeviceCount()
    with pytest.raises(kvpool.CudaUnavailableError):
        Pool(LAYOUT, 4, device=f"cuda:{count}")


def test_auto_picks_cuda(cp: Any) -> None:
    assert Pool(LAYOUT, 4).device == "cuda:0"
    assert Pool(LAYOUT, 4, device="auto").device == "cuda:0"
    assert Pool(LAYOUT, 4, device="host").device == "host"


def test_stats_has_device_memory(cp: Any) -> None:
    pool = Pool(LAYOUT, 8, device="cuda")
    stats = pool.stats()
    assert stats["device"] == "cuda:0"
    assert stats["mapped_bytes"] == 8 * LAYOUT.block_bytes
    free, total = cp.cuda.runtime.memGetInfo()
    assert stats["device_total_bytes"] == total
    assert isinstance(stats["device_free_bytes"], int)
    assert 0 < stats["device_free_bytes"] <= total
    assert abs(stats["device_free_bytes"] - free) < 256 * MiB


def test_views_are_cuda_arrays(cp: Any) -> None:
    pool = Pool(LAYOUT, 8, device="cuda")
    s = LAYOUT.strides()
    for layer in range(LAYOUT.num_layers):
        for part, view in enumerate((pool.k_view(layer), pool.v_view(layer))):
            assert isinstance(view, kvpool._core.SlabView)
            iface = view.__cuda_array_interface__
            assert iface["shape"] == (8, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
            assert iface["strides"] == (s["block"], s["token"], s["head"], s["elem"])
            assert iface["typestr"] == "<f2"
            assert iface["data"] == (pool.base_ptr + layer * s["layer"] + part * s["kv"], False)
            assert iface["version"] >= 2
            with pytest.raises(AttributeError):
                view.__array_interface__  # noqa: B018
    with pytest.raises(kvpool.InvalidArgumentError):
        pool.k_view(LAYOUT.num_layers)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn"])
def test_writes_through_cupy_land_where_the_layout_says(cp: Any, dtype: str) -> None:
    layout = KvLayout(3, 2, 64, 4, dtype=dtype)
    pool = Pool(layout, 5, device="cuda")
    s = layout.strides()
    storage = UINT_OF_SIZE[layout.elem_bytes]
    raw = raw_slab(cp, pool, storage)
    assert not raw.any()  # a fresh slab is zeroed
    nb, bs, nh, hd = pool.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim
    b, t, h, d = np.indices((nb, bs, nh, hd))
    for layer in range(layout.num_layers):
        for part, view in enumerate((pool.k_view(layer), pool.v_view(layer))):
            arr = cp.asarray(view)
            assert arr.shape == (nb, bs, nh, hd) and arr.itemsize == layout.elem_bytes
            assert arr.data.ptr == view.__cuda_array_interface__["data"][0]
            pattern = (np.arange(arr.size).reshape(arr.shape) * 7 + 1 + layer * 3 + part).astype(
                storage
            )
            arr.view(storage)[...] = cp.asarray(pattern)
            offset = (
                b * s["block"]
                + layer * s["layer"]
                + part * s["kv"]
                + t * s["token"]
                + h * s["head"]
            )
            offset += d * s["elem"]
            got = cp.asnumpy(raw)[offset // layout.elem_bytes]
            assert np.array_equal(got, pattern)
            assert np.array_equal(cp.asnumpy(cp.asarray(view).view(storage)), pattern)
    # The views tile the slab: with distinct tags everywhere, no element is left zero.
    for tag, view in enumerate(
        [pool.k_view(i) for i in range(3)] + [pool.v_view(i) for i in range(3)], start=1
    ):
        cp.asarray(view).view(storage)[...] = tag
    counts = np.bincount(cp.asnumpy(raw), minlength=7)
    assert counts[0] == 0 and (counts[1:7] == raw.size // 6).all()


def test_float_values_round_trip_through_cupy(cp: Any) -> None:
    pool = Pool(LAYOUT, 4, device="cuda")
    k = cp.asarray(pool.k_view(1))
    v = cp.asarray(pool.v_view(1))
    assert k.dtype == cp.float16
    k[2, 3, 1] = cp.linspace(-1, 1, LAYOUT.head_dim, dtype=cp.float16)
    v[...] = 0.25
    back = cp.asarray(pool.k_view(1))
    assert cp.allclose(back[2, 3, 1], cp.linspace(-1, 1, LAYOUT.head_dim, dtype=cp.float16))
    assert int(cp.count_nonzero(back)) == int(cp.count_nonzero(back[2, 3, 1])) == LAYOUT.head_dim
    assert bool((cp.asarray(pool.v_view(1)) == 0.25).all())
    assert not bool(cp.asarray(pool.k_view(0)).any()) and not bool(cp.asarray(pool.v_view(0)).any())


def test_view_keeps_the_pool_alive(cp: Any) -> None:
    pool = Pool(LAYOUT, 4, device="cuda")
    view = pool.k_view(0)
    del pool
    gc.collect()
    arr = cp.asarray(view)
    arr[...] = 1.5
    assert bool((arr == 1.5).all())
    assert view.pool.num_blocks == 4


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_sees_the_same_memory(cp: Any) -> None:
    import torch

    pool = Pool(KvLayout(2, 2, 64, 16, dtype="bfloat16"), 4, device="cuda")
    k = torch.as_tensor(pool.k_view(1), device="cuda")
    assert k.data_ptr() == pool.k_view(1).__cuda_array_interface__["data"][0]
    assert k.dtype == torch.uint16 or k.dtype == torch.int16  # bf16 storage
    k_bf16 = k.view(torch.bfloat16)
    k_bf16[1, 2] = 3.0
    torch.cuda.synchronize()
    same = cp.asarray(pool.k_view(1)).view(cp.uint16)
    assert (
        int(same[1, 2, 0, 0])
        == int(torch.tensor(3.0, dtype=torch.bfloat16).view(torch.int16).item()) & 0xFFFF
    )

    half = Pool(LAYOUT, 4, device="cuda")
    v = torch.as_tensor(half.v_view(0), device="cuda")
    assert v.dtype == torch.float16 and v.shape == (4, 16, 2, 64)
    v.fill_(2.0)
    torch.cuda.synchronize()
    assert bool((cp.asarray(half.v_view(0)) == 2.0).all())


def test_device_memory_returns_after_drop(cp: Any) -> None:
    Pool(LAYOUT, 4, device="cuda")  # warm-up: context, module loads, the pool's stream
    gc.collect()
    before = device_free_bytes(cp)
    slab = 512 * MiB
    pool = Pool(LAYOUT, memory_bytes=slab, device="cuda")
    during = device_free_bytes(cp)
    assert before - during >= slab - 4 * MiB
    del pool
    gc.collect()
    after = device_free_bytes(cp)
    assert abs(after - before) <= 4 * MiB, (before, during, after)


def test_gpu_memory_utilization_sizing(cp: Any) -> None:
    free_before = device_free_bytes(cp)
    pool = Pool(LAYOUT, gpu_memory_utilization=0.05, device="cuda")
    expected = int(free_before * 0.05) // LAYOUT.block_bytes
    assert pool.device == "cuda:0"
    assert abs(pool.num_blocks - expected) <= max(8, expected // 100), (pool.num_blocks, expected)
    assert pool.num_blocks * LAYOUT.block_bytes <= 0.05 * free_before + 64 * MiB
    pool.check_invariants()
