"""Pools over memory kvpool does not allocate: a caller's buffer (Pool.from_external) and
none at all (device="none", metadata only)."""

import gc
import weakref

import kvpool
import numpy as np
import pytest
from kvpool import BlockTables, KvLayout, Pool

LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_dim=16, block_size=4, dtype="float16")
ALIGN = 256


def aligned_host_buffer(num_bytes, offset=0):
    """A writable uint8 array of num_bytes starting `offset` bytes past a 256-byte boundary."""
    raw = np.zeros(num_bytes + 2 * ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN + offset
    return raw[start : start + num_bytes]


def test_from_external_uses_the_callers_memory_and_keeps_it_alive():
    buf = aligned_host_buffer(5 * LAYOUT.block_bytes + 100)
    pool = Pool.from_external(LAYOUT, buf)
    assert pool.num_blocks == 5
    assert pool.base_ptr == buf.ctypes.data
    assert pool.device == "host"
    block = pool.alloc()
    pool.k_view(1)[block] = 3.0
    assert buf.view(np.uint8).any(), "writes through the pool land in the caller's buffer"
    pool.check_invariants()

    # The pool keeps the buffer's owner alive; dropping the pool lets it go.
    class Owner(np.ndarray):
        pass

    owner = aligned_host_buffer(2 * LAYOUT.block_bytes).view(Owner)
    ref = weakref.ref(owner)
    pool2 = Pool.from_external(LAYOUT, owner, num_blocks=2)
    del owner
    gc.collect()
    assert ref() is not None
    del pool2
    gc.collect()
    assert ref() is None


def test_from_external_takes_buffer_protocol_objects_and_prefix_caching():
    raw = bytearray(4 * LAYOUT.block_bytes + ALIGN)
    address = np.frombuffer(raw, np.uint8).ctypes.data
    view = memoryview(raw)[(-address) % ALIGN :][: 4 * LAYOUT.block_bytes]
    pool = Pool.from_external(LAYOUT, view, enable_prefix_caching=True)
    assert pool.num_blocks == 4 and pool.prefix_caching


def test_from_external_refuses_bad_buffers():
    bb = LAYOUT.block_bytes
    with pytest.raises(kvpool.InvalidArgumentError, match="holds 1 blocks"):
        Pool.from_external(LAYOUT, aligned_host_buffer(bb), num_blocks=2)
    with pytest.raises(kvpool.InvalidArgumentError, match="holds 0 blocks"):
        Pool.from_external(LAYOUT, aligned_host_buffer(bb - 1))
    with pytest.raises(kvpool.InvalidArgumentError, match="256-byte boundary"):
        Pool.from_external(LAYOUT, aligned_host_buffer(2 * bb, offset=8))
    readonly = aligned_host_buffer(2 * bb)
    readonly.flags.writeable = False
    with pytest.raises(kvpool.InvalidArgumentError, match="read-only"):
        Pool.from_external(LAYOUT, readonly)
    strided = aligned_host_buffer(4 * bb)[::2]
    with pytest.raises(kvpool.InvalidArgumentError, match="C-contiguous"):
        Pool.from_external(LAYOUT, strided)
    with pytest.raises(kvpool.InvalidArgumentError, match="cuda_array_interface"):
        Pool.from_external(LAYOUT, aligned_host_buffer(bb), device="cuda:0")
    with pytest.raises(TypeError):
        Pool.from_external(LAYOUT, object())


@pytest.mark.gpu
def test_from_external_over_a_cupy_array():
    cp = pytest.importorskip("cupy")
    if not kvpool.cuda_available():
        pytest.skip("no CUDA device")
    arr = cp.zeros(8 * LAYOUT.block_bytes, dtype=cp.uint8)  # CuPy allocations are 512-aligned
    pool = Pool.from_external(LAYOUT, arr, device="cuda:0")
    assert pool.num_blocks == 8 and pool.base_ptr == arr.data.ptr
    block = pool.alloc()
    cp.asarray(pool.k_view(0))[block] = 1.0
    assert int(arr.sum()) > 0
    torch = pytest.importorskip("torch")
    t = torch.zeros(4 * LAYOUT.block_bytes, dtype=torch.uint8, device="cuda")
    assert Pool.from_external(LAYOUT, t, device="cuda:0").num_blocks == 4


def test_a_metadata_only_pool_keeps_ids_tables_prefix_cache_and_events():
    pool = Pool(LAYOUT, 8, device="none", enable_prefix_caching=True)
    assert pool.device == "none"
    tables = BlockTables(pool, 4, 8)
    pool.enable_kv_cache_events()
    assert tables.add_request(1, range(9)).num_cached_tokens == 0
    tables.free(1)
    assert tables.add_request(2, range(9)).num_cached_tokens == 8
    assert pool.lookup_prefix(range(9)) == 8
    events = pool.take_kv_events()
    assert events and all(e.medium == "GPU" for e in events)
    assert pool.kv_cache_snapshot().blocks
    pool.check_invariants(exact_refs=True)
    ids = pool.alloc_many(3)
    pool.free_many(ids)
    for call in (
        lambda: pool.base_ptr,
        lambda: pool.block_ptr(0),
        lambda: pool.k_view(0),
        lambda: pool.v_view(0),
        lambda: kvpool.HostTier(tables, num_blocks=4),
    ):
        with pytest.raises(kvpool.InvalidArgumentError, match="metadata-only"):
            call()
    with pytest.raises(kvpool.InvalidArgumentError, match="metadata-only"):
        Pool(LAYOUT, 8, device="none", enable_prefix_caching=True, prefix_cache_host_blocks=2)
    with pytest.raises(kvpool.InvalidArgumentError, match="num_blocks alone"):
        Pool(LAYOUT, device="none", memory_bytes=1 << 20)
