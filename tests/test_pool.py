"""Pool on the host: every method and every error path. A failed call must change nothing."""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import kvpool
import numpy as np
import pytest
from kvpool import (
    CudaUnavailableError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidBlockError,
    KvError,
    KvLayout,
    OutOfBlocksError,
    Pool,
)

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)  # 16 KiB blocks
NUM_BLOCKS = 8
STATS_KEYS = {
    "num_blocks",
    "num_free",
    "num_used",
    "high_water",
    "block_bytes",
    "mapped_bytes",
    "device",
}


@pytest.fixture
def pool() -> Pool:
    return Pool(LAYOUT, NUM_BLOCKS, device="host")


def snapshot(pool: Pool) -> tuple[dict[str, int | str], list[int]]:
    """Everything observable about the pool's bookkeeping."""
    return pool.stats(), [pool.ref_cnt(i) for i in range(pool.num_blocks)]


class Unchanged:
    """Asserts that the block in the `with` changes nothing in the pool."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def __enter__(self) -> None:
        self.pool.check_invariants()
        self.before = snapshot(self.pool)

    def __exit__(self, *exc: object) -> None:
        self.pool.check_invariants()
        assert snapshot(self.pool) == self.before


def slab_bytes(pool: Pool) -> np.ndarray:
    """A raw uint8 view of the whole slab, independent of the pool's own views."""
    size = pool.stats()["mapped_bytes"]
    assert isinstance(size, int)
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(pool.base_ptr))


# --- errors ---------------------------------------------------------------------------------


def test_error_hierarchy() -> None:
    # The list itself is checked against the extension's in test_exceptions.py.
    for name in kvpool.exceptions.__all__:
        cls = getattr(kvpool, name)
        assert issubclass(cls, KvError) and (cls is KvError) == (name == "KvError"), name
        assert cls.__module__ == "kvpool.exceptions"
    assert issubclass(KvError, Exception)
    assert set(kvpool.__all__) <= set(dir(kvpool))


# --- constructor ----------------------------------------------------------------------------


def test_construct_by_num_blocks() -> None:
    pools = (
        Pool(LAYOUT, 5, device="host"),
        Pool(LAYOUT, num_blocks=5, device="host"),
        Pool(LAYOUT, 5, device="cpu"),
    )
    for pool in pools:
        assert pool.num_blocks == 5 and pool.num_free == 5 and pool.num_used == 0
        assert pool.device == "host"
        assert pool.layout == LAYOUT
        assert pool.block_bytes == LAYOUT.block_bytes
        assert pool.high_water == 0
        pool.check_invariants()


def test_construct_by_memory_bytes_rounds_down() -> None:
    bb = LAYOUT.block_bytes
    assert Pool(LAYOUT, memory_bytes=3 * bb, device="host").num_blocks == 3
    assert Pool(LAYOUT, memory_bytes=3 * bb + bb - 1, device="host").num_blocks == 3
    with pytest.raises(InvalidArgumentError, match="0 blocks"):
        Pool(LAYOUT, memory_bytes=bb - 1, device="host")


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"num_blocks": 4, "memory_bytes": 4 * LAYOUT.block_bytes},
        {"num_blocks": 4, "gpu_memory_utilization": 0.5},
        {"memory_bytes": 4 * LAYOUT.block_bytes, "gpu_memory_utilization": 0.5},
        {"num_blocks": 4, "memory_bytes": 4 * LAYOUT.block_bytes, "gpu_memory_utilization": 0.5},
    ],
)
def test_size_arguments_are_mutually_exclusive(kwargs: dict[str, Any]) -> None:
    with pytest.raises(
        InvalidArgumentError,
        match="exactly one of num_blocks, memory_bytes, gpu_memory_utilization",
    ):
        Pool(LAYOUT, device="host", **kwargs)


@pytest.mark.parametrize("num_blocks", [0, -1, -(2**40), kvpool.MAX_NUM_BLOCKS + 1])
def test_bad_num_blocks(num_blocks: int) -> None:
    with pytest.raises(InvalidArgumentError, match="num_blocks|0 blocks"):
        Pool(LAYOUT, num_blocks, device="host")


def test_negative_memory_bytes() -> None:
    with pytest.raises(InvalidArgumentError, match="memory_bytes must be >= 0"):
        Pool(LAYOUT, memory_bytes=-1, device="host")


def test_max_num_blocks() -> None:
    assert kvpool.MAX_NUM_BLOCKS == 2**31 - 1  # ids fit int32


def test_gpu_memory_utilization_on_host_is_invalid() -> None:
    with pytest.raises(InvalidArgumentError, match="needs a CUDA device"):
        Pool(LAYOUT, gpu_memory_utilization=0.5, device="host")


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.01, float("nan"), float("inf")])
def test_gpu_memory_utilization_out_of_range(fraction: float) -> None:
    with pytest.raises(InvalidArgumentError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        Pool(LAYOUT, gpu_memory_utilization=fraction, device="host")


@pytest.mark.parametrize(
    "device", ["bogus", "", "gpu", "cuda:", "cuda:x", "cuda:-1", "cuda0", "host:0"]
)
def test_bad_device_string(device: str) -> None:
    with pytest.raises(InvalidArgumentError, match="device"):
        Pool(LAYOUT, 4, device=device)


@pytest.mark.parametrize("device", ["host", "HOST", "cpu"])
def test_host_device_spellings(device: str) -> None:
    assert Pool(LAYOUT, 4, device=device).device == "host"


def test_auto_device_without_cuda_is_host() -> None:
    if kvpool.cuda_available():
        pytest.skip("CUDA is available: auto picks it (covered by test_pool_gpu.py)")
    assert Pool(LAYOUT, 4).device == "host"
    assert Pool(LAYOUT, 4, device="auto").device == "host"


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_driver_raises(device: str) -> None:
    if kvpool.cuda_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(CudaUnavailableError):
        Pool(LAYOUT, 4, device=device)
    with pytest.raises(CudaUnavailableError):
        Pool(LAYOUT, gpu_memory_utilization=0.5, device=device)


def test_cuda_available_is_a_bool() -> None:
    assert isinstance(kvpool.cuda_available(), bool)


def test_layout_must_be_a_kvlayout() -> None:
    with pytest.raises(TypeError):
        Pool((2, 2, 64, 16), 4)  # type: ignore[arg-type]


def test_pool_is_frozen(pool: Pool) -> None:
    with pytest.raises(AttributeError):
        pool.num_blocks = 3  # type: ignore[misc]


def test_repr(pool: Pool) -> None:
    pool.alloc()
    assert (
        repr(pool)
        == f"Pool(device='host', num_blocks=8, num_free=7, block_bytes={LAYOUT.block_bytes})"
    )


# --- alloc / alloc_many -----------------------------------------------------------------------


def test_alloc_returns_distinct_ints(pool: Pool) -> None:
    ids = [pool.alloc() for _ in range(NUM_BLOCKS)]
    assert all(type(i) is int for i in ids)
    assert sorted(ids) == list(range(NUM_BLOCKS))
    assert all(pool.ref_cnt(i) == 1 for i in ids)
    assert pool.num_free == 0 and pool.num_used == NUM_BLOCKS
    pool.check_invariants()


def test_alloc_many_returns_int32_array(pool: Pool) -> None:
    ids = pool.alloc_many(3)
    assert isinstance(ids, np.ndarray)
    assert ids.dtype == np.int32 and ids.shape == (3,) and ids.ndim == 1
    assert ids.flags.c_contiguous and ids.flags.writeable
    assert len(set(ids.tolist())) == 3
    assert all(0 <= i < NUM_BLOCKS and pool.ref_cnt(i) == 1 for i in ids.tolist())
    assert (pool.num_free, pool.num_used) == (NUM_BLOCKS - 3, 3)
    rest = pool.alloc_many(NUM_BLOCKS - 3)
    assert sorted(ids.tolist() + rest.tolist()) == list(range(NUM_BLOCKS))
    pool.check_invariants()


def test_alloc_many_zero(pool: Pool) -> None:
    with Unchanged(pool):
        ids = pool.alloc_many(0)
    assert ids.dtype == np.int32 and ids.shape == (0,)


def test_alloc_many_negative(pool: Pool) -> None:
    with Unchanged(pool), pytest.raises(InvalidArgumentError, match="n must be >= 0"):
        pool.alloc_many(-1)


def test_alloc_many_needs_an_int(pool: Pool) -> None:
    with Unchanged(pool):
        for bad in (1.5, "2", None):
            with pytest.raises(TypeError):
                pool.alloc_many(bad)  # type: ignore[arg-type]


def test_alloc_many_is_all_or_nothing(pool: Pool) -> None:
    held = pool.alloc_many(5)
    with Unchanged(pool), pytest.raises(OutOfBlocksError) as info:
        pool.alloc_many(4)
    err = info.value
    assert isinstance(err, KvError)
    assert (err.requested, err.free, err.num_blocks) == (4, 3, NUM_BLOCKS)
    assert "requested 4" in str(err) and "only 3 of 8" in str(err)
    assert pool.alloc_many(3).size == 3  # exactly what is left still works
    pool.free_many(held)
    pool.check_invariants()


def test_alloc_when_empty(pool: Pool) -> None:
    pool.alloc_many(NUM_BLOCKS)
    with Unchanged(pool):
        with pytest.raises(OutOfBlocksError) as info:
            pool.alloc()
        assert (info.value.requested, info.value.free, info.value.num_blocks) == (1, 0, NUM_BLOCKS)
        with pytest.raises(OutOfBlocksError) as info:
            pool.alloc_many(1)
        assert (info.value.requested, info.value.free) == (1, 0)


@pytest.mark.parametrize("n", [NUM_BLOCKS + 1, 2**31 - 1, 2**31, 2**32 + 1])
def test_alloc_many_more_than_num_blocks(pool: Pool, n: int) -> None:
    with Unchanged(pool), pytest.raises(OutOfBlocksError) as info:
        pool.alloc_many(n)
    assert (info.value.requested, info.value.free, info.value.num_blocks) == (
        n,
        NUM_BLOCKS,
        NUM_BLOCKS,
    )


def test_alloc_many_huge_count_raises_instead_of_aborting() -> None:
    # Run in a child: before the fix, the binding sized a Vec for `n` ids first, so 2**40
    # aborted the process ("memory allocation of 4398046511104 bytes failed") and 2**62
    # raised a PanicException ("capacity overflow").
    code = textwrap.dedent(
        """
        import kvpool
        pool = kvpool.Pool(kvpool.KvLayout(2, 2, 64, 16), 8, device="host")
        for n in (2**40, 2**62, 2**63 - 1):
            try:
                pool.alloc_many(n)
            except kvpool.OutOfBlocksError as e:
                assert (e.requested, e.free, e.num_blocks) == (n, 8, 8), (n, e.requested)
            else:
                raise AssertionError(n)
        pool.check_invariants()
        assert pool.num_free == 8
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_high_water(pool: Pool) -> None:
    assert pool.high_water == 0
    a = pool.alloc_many(5)
    assert pool.high_water == 5
    pool.free_many(a[:3])
    assert pool.high_water == 5
    b = pool.alloc_many(2)
    assert pool.high_water == 5
    c = pool.alloc_many(3)
    assert pool.high_water == 7
    pool.free_many(np.concatenate([a[3:], b, c]))
    assert pool.num_used == 0 and pool.high_water == 7
    assert pool.stats()["high_water"] == 7
    pool.check_invariants()


# --- free / free_many: accepted inputs -----------------------------------------------------------


def as_int32(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


def as_int64(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64)


def as_strided_int32(ids: list[int]) -> np.ndarray:
    spread = np.full(2 * len(ids), -1, dtype=np.int32)
    spread[::2] = ids
    return spread[::2]  # non-contiguous


def as_generator(ids: list[int]) -> Iterator[int]:
    return (i for i in ids)


def as_numpy_scalars(ids: list[int]) -> list[Any]:
    kinds = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
    return [kinds[k % len(kinds)](i) for k, i in enumerate(ids)]


CONTAINERS: dict[str, Callable[[list[int]], Any]] = {
    "int32": as_int32,
    "int64": as_int64,
    "int32-strided": as_strided_int32,
    "int64-bigendian": lambda ids: np.asarray(ids, dtype=">i8"),
    "uint32": lambda ids: np.asarray(ids, dtype=np.uint32),
    "list": list,
    "tuple": tuple,
    "generator": as_generator,
    "object-array": lambda ids: np.asarray(ids, dtype=object),
    "dict-keys": lambda ids: dict.fromkeys(ids).keys(),
    "numpy-scalars": as_numpy_scalars,
}


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_free_many_accepts(pool: Pool, container: str) -> None:
    held = pool.alloc_many(6).tolist()
    pool.free_many(CONTAINERS[container](held[:4]))
    assert pool.num_free == NUM_BLOCKS - 2
    assert [pool.ref_cnt(i) for i in held] == [0, 0, 0, 0, 1, 1]
    pool.check_invariants()


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_free_many_empty(pool: Pool, container: str) -> None:
    pool.alloc_many(2)
    with Unchanged(pool):
        pool.free_many(CONTAINERS[container]([]))


def test_free_many_of_alloc_many_output(pool: Pool) -> None:
    pool.free_many(pool.alloc_many(NUM_BLOCKS))
    assert pool.num_free == NUM_BLOCKS
    pool.check_invariants()


@pytest.mark.parametrize(
    "make",
    [int, np.int8, np.int32, np.int64, np.uint8, np.uint64, lambda i: np.array(i, dtype=np.int32)],
)
def test_free_accepts_integers(pool: Pool, make: Callable[[int], Any]) -> None:
    i = pool.alloc()
    pool.free(make(i))
    assert pool.ref_cnt(i) == 0 and pool.num_free == NUM_BLOCKS
    pool.check_invariants()


def test_freed_blocks_are_reused(pool: Pool) -> None:
    first = pool.alloc_many(NUM_BLOCKS)
    pool.free_many(first[2:5])
    again = pool.alloc_many(3)
    assert sorted(again.tolist()) == sorted(first[2:5].tolist())
    pool.check_invariants()


# --- invalid ids --------------------------------------------------------------------------------

BAD_IDS: dict[str, Any] = {
    "negative": -1,
    "very-negative": -(2**40),
    "num_blocks": NUM_BLOCKS,
    "num_blocks+1": NUM_BLOCKS + 1,
    "2**31": 2**31,
    "2**32": 2**32,
    "2**63": 2**63,
    "2**64": 2**64,
    "2**200": 2**200,
    "-2**200": -(2**200),
    "float": 1.0,
    "nan": float("nan"),
    "str": "1",
    "bytes": b"\x01",
    "none": None,
    "true": True,
    "false": False,
    "numpy-float": np.float64(1.0),
    "numpy-float32": np.float32(1.0),
    "numpy-bool": np.bool_(True),
    "numpy-negative": np.int64(-1),
    "numpy-uint64-max": np.uint64(2**64 - 1),
    "complex": 1 + 0j,
    "list": [1],
    "object": object(),
}


def id_error(value: Any) -> type[Exception]:
    """What a bad id raises: a wrong value InvalidBlockError, a wrong type TypeError."""
    is_int = isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)
    return InvalidBlockError if is_int else TypeError


@pytest.mark.parametrize("name", sorted(BAD_IDS))
def test_free_invalid_id(pool: Pool, name: str) -> None:
    pool.alloc_many(
        NUM_BLOCKS
    )  # every in-range id is allocated, so only the id's validity can fail
    bad = BAD_IDS[name]
    with Unchanged(pool), pytest.raises(id_error(bad)) as info:
        pool.free(bad)
    if id_error(bad) is InvalidBlockError:
        assert isinstance(info.value, KvError)
        assert "invalid block id" in str(info.value)
    else:
        assert str(info.value).startswith("argument 'block_id': must be an int, not ")


@pytest.mark.parametrize("name", sorted(BAD_IDS))
def test_free_many_invalid_id_frees_nothing(pool: Pool, name: str) -> None:
    pool.alloc_many(NUM_BLOCKS)
    for ids in ([0, 1, BAD_IDS[name]], [BAD_IDS[name], 2, 3], (i for i in (4, BAD_IDS[name], 5))):
        with Unchanged(pool), pytest.raises(id_error(BAD_IDS[name])):
            pool.free_many(ids)


@pytest.mark.parametrize("name", sorted(BAD_IDS))
def test_ref_cnt_and_block_ptr_invalid_id(pool: Pool, name: str) -> None:
    with Unchanged(pool):
        with pytest.raises(id_error(BAD_IDS[name])):
            pool.ref_cnt(BAD_IDS[name])
        with pytest.raises(id_error(BAD_IDS[name])):
            pool.block_ptr(BAD_IDS[name])


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("bad", [-1, NUM_BLOCKS, 2**31 - 1])
def test_free_many_array_with_invalid_id(pool: Pool, dtype: type, bad: int) -> None:
    pool.alloc_many(NUM_BLOCKS)
    with Unchanged(pool), pytest.raises(InvalidBlockError):
        pool.free_many(np.array([0, 1, bad], dtype=dtype))


def test_free_many_int64_array_beyond_int32(pool: Pool) -> None:
    pool.alloc_many(NUM_BLOCKS)
    with Unchanged(pool), pytest.raises(InvalidBlockError, match=str(2**40)):
        pool.free_many(np.array([0, 2**40], dtype=np.int64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_, np.complex64])
def test_free_many_array_of_non_integers(pool: Pool, dtype: type) -> None:
    pool.alloc_many(NUM_BLOCKS)
    with Unchanged(pool), pytest.raises(TypeError, match="must be an integer array"):
        pool.free_many(np.array([0, 1], dtype=dtype))


@pytest.mark.parametrize(
    "ids",
    [
        [3, 3],
        [1, 2, 3, 1],
        (5, 6, 5),
        np.array([4, 7, 4], dtype=np.int32),
        np.array([7, 0, 0], dtype=np.int64),
    ],
    ids=repr,
)
def test_free_many_repeated_id_frees_nothing(pool: Pool, ids: Any) -> None:
    pool.alloc_many(NUM_BLOCKS)
    with Unchanged(pool), pytest.raises(InvalidBlockError, match="repeated"):
        pool.free_many(ids)


@pytest.mark.parametrize(
    "ids",
    [
        np.zeros((2, 2), dtype=np.int32),
        np.zeros((1, 3), dtype=np.int64),
        np.zeros((2, 1), dtype=np.uint8),
        np.array(3, dtype=np.int32),
        np.zeros((0, 0), dtype=np.int32),
    ],
    ids=lambda a: f"{a.dtype}{a.shape}",
)
def test_free_many_needs_one_dimension(pool: Pool, ids: np.ndarray) -> None:
    pool.alloc_many(NUM_BLOCKS)
    with Unchanged(pool), pytest.raises(InvalidArgumentError, match="one-dimensional"):
        pool.free_many(ids)


@pytest.mark.parametrize("ids", [3, None, 2.5, object()], ids=repr)
def test_free_many_needs_an_iterable(pool: Pool, ids: Any) -> None:
    pool.alloc_many(NUM_BLOCKS)
    with Unchanged(pool), pytest.raises(TypeError, match="must be an iterable of ints"):
        pool.free_many(ids)


def test_free_many_iterator_that_raises(pool: Pool) -> None:
    def ids() -> Iterator[int]:
        yield 0
        raise RuntimeError("boom")

    pool.alloc_many(NUM_BLOCKS)
    # The caller's own exception, as it is (tests/test_binding_args.py covers every iterable).
    with Unchanged(pool), pytest.raises(RuntimeError, match="boom"):
        pool.free_many(ids())


def test_free_many_string_is_not_ids(pool: Pool) -> None:
    pool.alloc_many(NUM_BLOCKS)
    with Unchanged(pool), pytest.raises(TypeError, match="not str"):
        pool.free_many("01")


# --- double free ---------------------------------------------------------------------------------


def test_double_free(pool: Pool) -> None:
    i = pool.alloc()
    pool.free(i)
    with Unchanged(pool), pytest.raises(DoubleFreeError, match=f"block {i}") as info:
        pool.free(i)
    assert isinstance(info.value, KvError)


def test_free_of_never_allocated_block(pool: Pool) -> None:
    with Unchanged(pool), pytest.raises(DoubleFreeError):
        pool.free(3)


@pytest.mark.parametrize("container", ["int32", "int64", "list", "generator"])
def test_free_many_with_one_free_block_frees_nothing(pool: Pool, container: str) -> None:
    held = pool.alloc_many(4).tolist()
    pool.free(held[2])
    with Unchanged(pool), pytest.raises(DoubleFreeError, match=f"block {held[2]}"):
        pool.free_many(CONTAINERS[container](held))
    assert [pool.ref_cnt(i) for i in held] == [1, 1, 0, 1]


def test_free_many_twice(pool: Pool) -> None:
    held = pool.alloc_many(5)
    pool.free_many(held)
    with Unchanged(pool), pytest.raises(DoubleFreeError):
        pool.free_many(held)


# --- ref_cnt, block_ptr, stats ---------------------------------------------------------------------


def test_ref_cnt(pool: Pool) -> None:
    assert [pool.ref_cnt(i) for i in range(NUM_BLOCKS)] == [0] * NUM_BLOCKS
    held = pool.alloc_many(3).tolist()
    for i in range(NUM_BLOCKS):
        assert pool.ref_cnt(i) == (1 if i in held else 0)
        assert pool.ref_cnt(np.int64(i)) == pool.ref_cnt(np.int32(i)) == pool.ref_cnt(i)
    pool.free(held[0])
    assert pool.ref_cnt(held[0]) == 0


def test_block_ptr(pool: Pool) -> None:
    assert pool.base_ptr > 0 and pool.base_ptr % 256 == 0
    for i in range(NUM_BLOCKS):  # allocated or not
        assert pool.block_ptr(i) == pool.base_ptr + i * pool.block_bytes
        assert pool.block_ptr(np.int32(i)) == pool.block_ptr(i)
        assert pool.block_ptr(i) % 256 == 0
    assert (
        pool.block_ptr(NUM_BLOCKS - 1) + pool.block_bytes
        == pool.base_ptr + NUM_BLOCKS * pool.block_bytes
    )


def test_stats(pool: Pool) -> None:
    held = pool.alloc_many(3)
    pool.free(held[0])
    stats = pool.stats()
    # Growable pools add their own keys (tests/test_growable.py); these are the common ones.
    assert set(stats) >= STATS_KEYS
    assert "device_free_bytes" not in stats and "device_total_bytes" not in stats  # host
    assert {k: stats[k] for k in STATS_KEYS} == {
        "num_blocks": NUM_BLOCKS,
        "num_free": NUM_BLOCKS - 2,
        "num_used": 2,
        "high_water": 3,
        "block_bytes": LAYOUT.block_bytes,
        "mapped_bytes": NUM_BLOCKS * LAYOUT.block_bytes,
        "device": "host",
    }
    assert stats["num_free"] == pool.num_free and stats["num_used"] == pool.num_used


def test_fresh_slab_is_zeroed(pool: Pool) -> None:
    assert not slab_bytes(pool).any()


# --- K/V views ------------------------------------------------------------------------------------

VIEW_DTYPES = {
    "float16": np.float16,
    "float32": np.float32,
    "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8,
}
UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32}


@pytest.fixture(params=sorted(VIEW_DTYPES))
def view_pool(request: pytest.FixtureRequest) -> Pool:
    return Pool(KvLayout(3, 2, 64, 4, dtype=request.param), 5, device="host")


def test_view_shape_dtype_strides(view_pool: Pool) -> None:
    layout = view_pool.layout
    s = layout.strides()
    for layer in range(layout.num_layers):
        for view in (view_pool.k_view(layer), view_pool.v_view(layer)):
            assert isinstance(view, np.ndarray)
            assert view.shape == (
                view_pool.num_blocks,
                layout.block_size,
                layout.num_kv_heads,
                layout.head_dim,
            )
            assert view.dtype == VIEW_DTYPES[layout.dtype]
            assert view.itemsize == layout.elem_bytes
            assert view.strides == (s["block"], s["token"], s["head"], s["elem"])
            assert view.flags.writeable and not view.flags.owndata


def test_view_data_pointers(view_pool: Pool) -> None:
    s = view_pool.layout.strides()
    for layer in range(view_pool.layout.num_layers):
        k = view_pool.k_view(layer).__array_interface__["data"][0]
        v = view_pool.v_view(layer).__array_interface__["data"][0]
        assert k == view_pool.base_ptr + layer * s["layer"]
        assert v == k + s["kv"]


def test_view_writes_land_where_the_layout_says(view_pool: Pool) -> None:
    layout = view_pool.layout
    s = layout.strides()
    storage = UINT_OF_SIZE[layout.elem_bytes]
    raw = slab_bytes(view_pool).view(storage)
    nb, bs, nh, hd = view_pool.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim
    b, t, h, d = np.indices((nb, bs, nh, hd))
    for layer in range(layout.num_layers):
        for part, view in enumerate((view_pool.k_view(layer), view_pool.v_view(layer))):
            # A distinct bit pattern per element (wrapping is fine: neighbours still differ).
            pattern = (np.arange(view.size).reshape(view.shape) * 7 + 1 + layer * 3 + part).astype(
                storage
            )
            view.view(storage)[...] = pattern
            offset = (
                b * s["block"]
                + layer * s["layer"]
                + part * s["kv"]
                + t * s["token"]
                + h * s["head"]
            )
            offset += d * s["elem"]
            assert np.array_equal(raw[offset // layout.elem_bytes], pattern)
            # And a write through the raw slab shows up in the view.
            raw[offset[1, 2, 1, 3] // layout.elem_bytes] = storage(5)
            assert view.view(storage)[1, 2, 1, 3] == 5


def test_views_tile_the_slab_without_overlap(view_pool: Pool) -> None:
    layout = view_pool.layout
    storage = UINT_OF_SIZE[layout.elem_bytes]
    raw = slab_bytes(view_pool).view(storage)
    views = [view_pool.k_view(layer) for layer in range(layout.num_layers)]
    views += [view_pool.v_view(layer) for layer in range(layout.num_layers)]
    for tag, view in enumerate(views, start=1):
        view.view(storage)[...] = tag
    # Each view still reads its own tag (nothing wrote over it)...
    for tag, view in enumerate(views, start=1):
        assert (view.view(storage) == tag).all()
    # ...and every element of the slab belongs to exactly one view.
    counts = np.bincount(raw, minlength=len(views) + 1)
    assert counts[0] == 0
    assert (counts[1 : len(views) + 1] == views[0].size).all()
    assert counts.sum() == raw.size


def test_float_views_hold_values(pool: Pool) -> None:
    k, v = pool.k_view(1), pool.v_view(1)
    k[3, 0, 1, :] = np.linspace(-2, 2, LAYOUT.head_dim)
    v[3] = 0.5
    assert np.allclose(pool.k_view(1)[3, 0, 1], np.linspace(-2, 2, LAYOUT.head_dim), atol=1e-3)
    assert (pool.v_view(1)[3] == 0.5).all()
    assert not pool.k_view(0).any() and not pool.v_view(0).any()
    assert not k[:3].any() and not k[4:].any()


def test_view_keeps_the_pool_alive() -> None:
    pool = Pool(LAYOUT, 4, device="host")
    pool.alloc()
    view = pool.v_view(1)
    base_ptr = pool.base_ptr
    del pool
    gc.collect()
    # The array's memory is the SlabView's, which holds the Pool, which holds the slab.
    slab_view = view.slab_view
    assert isinstance(slab_view, kvpool._core.SlabView)
    assert slab_view.layer == 1 and slab_view.kind == "v"
    assert isinstance(slab_view.pool, Pool)
    assert slab_view.pool.base_ptr == base_ptr and slab_view.pool.num_used == 1
    view[...] = 3.0
    garbage = [np.ones(1 << 16) for _ in range(8)]  # churn the allocator a little
    del garbage
    assert (view == 3.0).all()
    slab_view.pool.check_invariants()


def test_k_view_metadata(pool: Pool) -> None:
    k = pool.k_view(0).slab_view
    assert (k.layer, k.kind) == (0, "k")
    assert k.pool.base_ptr == pool.base_ptr
    assert k.__array_interface__["version"] == 3
    with pytest.raises(AttributeError, match="host pool"):
        k.__cuda_array_interface__  # noqa: B018


@pytest.mark.parametrize("method", ["k_view", "v_view"])
def test_view_layer_out_of_range(pool: Pool, method: str) -> None:
    with Unchanged(pool):
        with pytest.raises(InvalidArgumentError, match="layer 2 is out of range"):
            getattr(pool, method)(LAYOUT.num_layers)
        with pytest.raises(InvalidArgumentError):
            getattr(pool, method)(2**40)
        with pytest.raises(InvalidArgumentError, match="layer must be >= 0"):
            getattr(pool, method)(-1)
        with pytest.raises(InvalidArgumentError, match="out of range|is too large"):
            getattr(pool, method)(2**70)


@pytest.mark.parametrize("n", [True, False])
def test_alloc_many_refuses_bools(pool: Pool, n: bool) -> None:
    with Unchanged(pool), pytest.raises(TypeError, match="^argument 'n': must be an int, not bool"):
        pool.alloc_many(n)


@pytest.mark.parametrize("n", [2**63, 2**200])
def test_alloc_many_of_more_than_any_int_is_out_of_blocks(pool: Pool, n: int) -> None:
    with Unchanged(pool), pytest.raises(OutOfBlocksError):
        pool.alloc_many(n)


def test_huge_constructor_sizes_raise_kv_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="num_blocks"):
        Pool(LAYOUT, 2**63, device="host")
    with pytest.raises(InvalidArgumentError, match="num_blocks"):
        Pool(LAYOUT, -(2**70), device="host")
