"""The host tier on a GPU: byte-exact round trips of random blocks with every copy method,
decode after swap-in against the float64 reference, a swap overlapping compute on another
stream, and the tier's refusals. Skipped without a GPU (conftest.py)."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from attention_check import assert_attention_close
from gpu_fixtures import cp
from kvpool import reference

pytestmark = pytest.mark.gpu

BS = 16
LAYOUT = kvpool.KvLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=BS)
POISON = 0xA5


def _slab(pool, nbytes=None):
    """The whole device slab as a uint8 CuPy array."""
    nbytes = nbytes or pool.num_blocks * pool.block_bytes
    mem = cp.cuda.UnownedMemory(pool.base_ptr, nbytes, pool)
    return cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))


def _host_bytes(pool):
    import ctypes

    n = pool.num_blocks * pool.block_bytes
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(pool.base_ptr))


def _fragmented_requests(tables, rng, lens):
    """Adds requests whose blocks are scattered: fillers taken in between are freed after."""
    fillers = []
    for i, n in enumerate(lens):
        tables.add(1000 + i, BS * int(rng.integers(1, 3)))
        fillers.append(1000 + i)
        tables.add(i, int(n))
    for f in fillers:
        tables.free(f)


def _block_bytes(slab, blocks, block_bytes):
    return [slab[b * block_bytes : (b + 1) * block_bytes] for b in blocks]


@pytest.mark.parametrize("method", ["auto", "batch", "runs"])
def test_round_trip_is_byte_exact(method):
    rng = np.random.default_rng(7)
    pool = kvpool.Pool(LAYOUT, 256, device="cuda")
    tables = kvpool.BlockTables(pool, 32, 64)
    try:
        tier = kvpool.HostTier(tables, 200, copy_method=method)
    except kvpool.InvalidArgumentError as e:  # "batch" on a driver without cuMemcpyBatchAsync
        pytest.skip(str(e))
    lens = [1, BS - 1, BS, 3 * BS + 5, 137, 300, 511]
    _fragmented_requests(tables, rng, lens)
    bb = pool.block_bytes
    slab = _slab(pool)
    slab[...] = cp.asarray(rng.integers(0, 256, slab.size, dtype=np.uint8))
    cp.cuda.runtime.deviceSynchronize()
    before = {
        r: [cp.asnumpy(x) for x in _block_bytes(slab, tables.blocks(r), bb)]
        for r in range(len(lens))
    }

    stats = tier.swap_out(list(range(len(lens))))
    assert stats["num_blocks"] == sum(len(v) for v in before.values())
    assert stats["num_copies"] > 1  # the fragmented layout really needs several copies
    tier.wait()
    assert tier.num_pending == (0, 0) and pool.num_used == 0
    host = _host_bytes(tier.pool)
    for r, blocks in before.items():
        for b, want in zip(tier.blocks(r), blocks):
            assert (host[b * bb : (b + 1) * bb] == want).all(), f"host copy of request {r}"
    slab[...] = POISON  # the freed device blocks: nothing may read them back
    cp.cuda.runtime.deviceSynchronize()

    tier.swap_in(list(range(len(lens))))
    tier.wait()
    cp.cuda.Stream.from_external(pool.stream).synchronize()
    for r, blocks in before.items():
        got = _block_bytes(slab, tables.blocks(r), bb)
        for i, (g, want) in enumerate(zip(got, blocks)):
            assert (cp.asnumpy(g) == want).all(), f"request {r} block {i} after the round trip"
    tables.check_invariants()
    pool.check_invariants(exact_refs=True)
    tier.check_invariants()
    assert tier.pool.num_used == 0


def test_mutation_is_caught():
    """The round-trip check can fail: one flipped byte in the host copy is seen."""
    pool = kvpool.Pool(LAYOUT, 16, device="cuda")
    tables = kvpool.BlockTables(pool, 4, 8)
    tier = kvpool.HostTier(tables, 16)
    tables.add(1, 3 * BS)
    slab = _slab(pool)
    slab[...] = 7
    cp.cuda.runtime.deviceSynchronize()
    tier.swap_out([1])
    tier.wait()
    host = _host_bytes(tier.pool)
    host[tier.blocks(1)[1] * pool.block_bytes + 5] ^= 0xFF
    tier.swap_in([1])
    tier.wait()
    cp.cuda.Stream.from_external(pool.stream).synchronize()
    got = np.concatenate(
        [cp.asnumpy(x) for x in _block_bytes(slab, tables.blocks(1), pool.block_bytes)]
    )
    assert (got != 7).sum() == 1


def test_decode_after_swap_in_matches_reference():
    rng = np.random.default_rng(3)
    hq, d = 8, LAYOUT.head_dim
    pool = kvpool.Pool(LAYOUT, 128, device="cuda")
    tables = kvpool.BlockTables(pool, 16, 32)
    tier = kvpool.HostTier(tables, 128)
    lens = np.array([5, BS, 77, 200], dtype=np.int32)
    _fragmented_requests(tables, rng, lens)
    slab = _slab(pool)
    vals = (rng.standard_normal(slab.size // 2) * 0.5).astype(np.float16)
    slab.view(cp.float16)[...] = cp.asarray(vals)
    ids = list(range(len(lens)))
    q = cp.asarray((rng.standard_normal((len(ids), hq, d)) * 0.5).astype(np.float16))
    cp.cuda.runtime.deviceSynchronize()

    def decode(layer):
        table, seq_lens = tables.block_table(ids), tables.seq_lens(ids)
        out = cp.full((len(ids), hq, d), np.nan, dtype=cp.float16)
        cp.cuda.runtime.deviceSynchronize()  # the fills above ran on CuPy's stream
        kvpool.paged_attention_decode(
            q,
            pool,
            layer,
            cp.asarray(table),
            cp.asarray(seq_lens),
            out=out,
            stream=cp.cuda.Stream.from_external(pool.stream),
        )
        cp.cuda.Stream.from_external(pool.stream).synchronize()
        k = cp.asnumpy(cp.asarray(pool.k_view(layer)))
        v = cp.asnumpy(cp.asarray(pool.v_view(layer)))
        want = reference.paged_attention_decode(cp.asnumpy(q), k, v, table, seq_lens, "float16")
        return cp.asnumpy(out), want

    before = {layer: decode(layer) for layer in range(LAYOUT.num_layers)}
    tier.swap_out(ids)
    tier.wait()
    slab[...] = POISON
    cp.cuda.runtime.deviceSynchronize()
    tier.swap_in(ids)  # the decode below is queued on the pool's stream: it waits for the copy
    for layer in range(LAYOUT.num_layers):
        got, want = decode(layer)
        assert_attention_close(cp.asarray(got), want, "float16", f"after swap-in layer {layer}")
        np.testing.assert_array_equal(got, before[layer][0])  # bit for bit as before the swap
        assert not np.isnan(got).any()


SPIN = r"""
extern "C" __global__ void spin_until(const volatile unsigned int* word, unsigned int want,
                                      unsigned long long max_iters, unsigned int* saw) {
    unsigned long long i = 0;
    while (*word != want && i < max_iters) { __nanosleep(1000); ++i; }
    *saw = (*word == want) ? 1u : 0u;
}
"""


def test_swap_overlaps_compute_on_another_stream():
    """A kernel on a compute stream spins until the swap-out's bytes reach the host tier. It
    can end with `saw == 1` only if the copy ran while it occupied its stream: overlap shown
    by the data itself, with no timing (the spin gives up after a bound and reports 0)."""
    magic = 0xC0FFEE11
    pool = kvpool.Pool(LAYOUT, 64, device="cuda")
    tables = kvpool.BlockTables(pool, 4, 16)
    tier = kvpool.HostTier(tables, 64)
    tables.add(1, 8 * BS)
    slab = _slab(pool)
    slab[...] = 0
    first = int(min(tables.blocks(1)))
    slab[first * pool.block_bytes : first * pool.block_bytes + 4].view(cp.uint32)[0] = magic
    cp.cuda.runtime.deviceSynchronize()
    host = _host_bytes(tier.pool)
    host[:] = 0
    # A fresh tier hands out its lowest ids first and the plan gives the lowest source the
    # lowest destination: the magic word lands at the start of host block 0.
    spin = cp.RawKernel(SPIN, "spin_until")
    saw = cp.zeros(1, dtype=cp.uint32)
    compute = cp.cuda.Stream(non_blocking=True)
    started, finished = cp.cuda.Event(), cp.cuda.Event()
    with compute:
        started.record()
        spin(
            (1,), (1,), (np.uint64(tier.pool.base_ptr), np.uint32(magic), np.uint64(5_000_000), saw)
        )
        finished.record()
    started.synchronize()
    assert not finished.done  # the compute kernel is still spinning: no copy has run yet
    tier.swap_out([1])  # ordered after the pool's stream (idle), not after `compute`
    finished.synchronize()
    assert int(saw[0]) == 1, "the swap did not run while the compute stream was busy"
    tier.wait()
    assert int(host[:4].view(np.uint32)[0]) == magic


def test_refusals_move_nothing():
    pool = kvpool.Pool(LAYOUT, 32, device="cuda")
    tables = kvpool.BlockTables(pool, 4, 16)
    tier = kvpool.HostTier(tables, 4)
    tables.add(1, 2 * BS)
    tables.add(2, 8 * BS)
    with pytest.raises(kvpool.HostTierFullError):
        tier.swap_out([1, 2])
    with pytest.raises(kvpool.UnknownRequestError):
        tier.swap_out([1, 9])
    assert tier.pool.num_used == 0 and sorted(tables.request_ids()) == [1, 2]
    tier.swap_out([1])
    with pytest.raises(kvpool.WrongTierError):
        tier.swap_out([1])
    with pytest.raises(kvpool.WrongTierError):
        tier.swap_in([2])
    tier.wait()
    assert tier.location(1) == "host" and tier.location(2) == "device"
    tier.check_invariants()
    pool.check_invariants(exact_refs=True)


def test_prefix_cache_host_tier_round_trip_is_byte_exact():
    """Cached blocks the pool evicts spill to the prefix cache's host tier and come back on a
    hit byte for byte (the device slab is poisoned in between, so only the host had them)."""
    rng = np.random.default_rng(11)
    pool = kvpool.Pool(
        LAYOUT, 64, device="cuda", enable_prefix_caching=True, prefix_cache_host_blocks=64
    )
    tables = kvpool.BlockTables(pool, 4, 64)
    prompt = rng.integers(0, 50_000, 40 * BS + 3)
    tables.add_request(1, prompt)
    bb = pool.block_bytes
    slab = _slab(pool)
    slab[...] = cp.asarray(rng.integers(0, 256, slab.size, dtype=np.uint8))
    cp.cuda.runtime.deviceSynchronize()
    blocks = tables.blocks(1).tolist()[:40]
    before = [cp.asnumpy(x) for x in _block_bytes(slab, blocks, bb)]
    tables.free(1)
    held = pool.alloc_many(64)  # 24 free + the 40 cached blocks, evicted: they spill
    assert pool.prefix_cache_stats()["host_num_cached_blocks"] == 40
    cp.cuda.runtime.deviceSynchronize()
    slab[...] = POISON
    cp.cuda.runtime.deviceSynchronize()
    pool.free_many(held)
    assert tables.add_request(2, prompt).num_cached_tokens == 40 * BS
    cp.cuda.runtime.deviceSynchronize()
    for k, (b, want) in enumerate(zip(tables.blocks(2).tolist()[:40], before)):
        assert (cp.asnumpy(slab[b * bb : (b + 1) * bb]) == want).all(), (
            f"block {k} after the swap-in"
        )
    s = pool.prefix_cache_stats()
    assert (s["host_num_cached_blocks"], s["swapped_in_blocks"]) == (0, 40)
    pool.check_invariants(exact_refs=True)
