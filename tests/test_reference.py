"""The NumPy float64 reference and the host backend of the kernel API, without a GPU."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from attention_inputs import fill_host_pool, random_elems, shuffled_tables
from kvpool import reference
from kvpool.kernels import _build, append_kv, copy_blocks, paged_attention_decode
from kvpool.kernels._decode_split import MAX_DECODE_SPLITS, split_kv

DTYPES = ["float16", "bfloat16"]


def _direct(q64, k_rows, v_rows, scale):
    """Plain float64 softmax attention, one query head at a time (no GQA tricks)."""
    hq, hkv = q64.shape[0], k_rows.shape[1]
    out = np.empty_like(q64)
    for h in range(hq):
        kh = k_rows[:, h // (hq // hkv)]
        s = kh @ q64[h] * scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v_rows[:, h // (hq // hkv)]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_round_trip(dtype):
    x = np.array([0.0, 1.0, -2.5, 3.140625, 65504.0 if dtype == "float16" else 2.0**100])
    assert np.array_equal(reference.to_float64(reference.from_float64(x, dtype), dtype), x)
    if dtype == "bfloat16":  # round to nearest even on a tie
        assert (
            reference.to_float64(reference.from_float64(np.array([1 + 2**-8]), dtype), dtype)[0]
            == 1.0
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2), (6, 1), (12, 4)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_matches_direct_attention(dtype, hq, hkv, block_size):
    rng = np.random.default_rng([hq, hkv, block_size, len(dtype)])
    d = 64
    lay = kvpool.KvLayout(2, hkv, d, block_size, dtype)
    pool = kvpool.Pool(lay, 64, device="host")
    fill_host_pool(pool, rng)
    seq_lens = np.array([1, block_size, block_size + 3, 5 * block_size - 1], dtype=np.int32)
    tables = shuffled_tables(rng, seq_lens, block_size, pool.num_blocks)
    q = random_elems(rng, (len(seq_lens), hq, d), dtype)
    scale = 0.3
    got = paged_attention_decode(q, pool, 1, tables, seq_lens, scale=scale)
    assert got.dtype == q.dtype and got.shape == q.shape
    q64 = reference.to_float64(q, dtype)
    k_all = reference.to_float64(pool.k_view(1), dtype)
    v_all = reference.to_float64(pool.v_view(1), dtype)
    for i, n in enumerate(seq_lens):
        toks = [(tables[i, t // block_size], t % block_size) for t in range(n)]
        k_rows = np.stack([k_all[b, o] for b, o in toks])
        v_rows = np.stack([v_all[b, o] for b, o in toks])
        want = _direct(q64[i], k_rows, v_rows, scale)
        exact = reference.paged_attention_decode(
            q[i : i + 1],
            pool.k_view(1),
            pool.v_view(1),
            tables[i : i + 1],
            seq_lens[i : i + 1],
            dtype,
            scale,
        )[0]
        np.testing.assert_allclose(exact, want, rtol=1e-12, atol=1e-12)
        tol = 1e-2 if dtype == "bfloat16" else 2e-3
        np.testing.assert_allclose(reference.to_float64(got[i], dtype), want, rtol=tol, atol=tol)


def test_decode_default_scale_and_empty_sequence():
    rng = np.random.default_rng(7)
    lay = kvpool.KvLayout(1, 2, 64, 8, "float16")
    pool = kvpool.Pool(lay, 8, device="host")
    fill_host_pool(pool, rng)
    q = random_elems(rng, (2, 2, 64), "float16")
    tables = np.array([[3, -1], [-1, -1]], dtype=np.int32)
    lens = np.array([8, 0], dtype=np.int32)
    out = np.full_like(q, np.nan)
    paged_attention_decode(q, pool, 0, tables, lens, out=out)
    want = reference.paged_attention_decode(
        q, pool.k_view(0), pool.v_view(0), tables, lens, "float16", 1 / 8
    )
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-3, atol=2e-3)
    assert (out[1] == 0).all()


def test_decode_rejects_bad_arguments():
    lay = kvpool.KvLayout(1, 2, 64, 8, "float16")
    pool = kvpool.Pool(lay, 8, device="host")
    q = np.zeros((1, 3, 64), dtype=np.float16)
    tables = np.zeros((1, 2), dtype=np.int32)
    lens = np.array([4], dtype=np.int32)
    with pytest.raises(kvpool.InvalidArgumentError, match="multiple"):
        paged_attention_decode(q, pool, 0, tables, lens)
    with pytest.raises(kvpool.InvalidArgumentError, match="layer"):
        paged_attention_decode(np.zeros((1, 2, 64), np.float16), pool, 1, tables, lens)
    with pytest.raises(kvpool.InvalidArgumentError, match="outside the pool"):
        paged_attention_decode(
            np.zeros((1, 2, 64), np.float16), pool, 0, np.array([[9, 0]], np.int32), lens
        )
    with pytest.raises(kvpool.InvalidArgumentError, match="dtype"):
        paged_attention_decode(np.zeros((1, 2, 64), np.float32), pool, 0, tables, lens)


@pytest.mark.parametrize("dtype", DTYPES)
def test_append_kv_writes_slots_and_skips_null(dtype):
    rng = np.random.default_rng(11)
    lay = kvpool.KvLayout(3, 2, 64, 16, dtype)
    pool = kvpool.Pool(lay, 4, device="host")
    fill_host_pool(pool, rng)
    before = [(pool.k_view(i).copy(), pool.v_view(i).copy()) for i in range(3)]
    k = random_elems(rng, (5, 2, 64), dtype)
    v = random_elems(rng, (5, 2, 64), dtype)
    slots = np.array([17, -1, 0, 63, 40], dtype=np.int64)
    append_kv(k, v, pool, 1, slots)
    for layer, (kb, vb) in enumerate(before):
        kc, vc = pool.k_view(layer), pool.v_view(layer)
        if layer != 1:
            assert np.array_equal(kc, kb) and np.array_equal(vc, vb)
            continue
        for i, s in enumerate(slots):
            if s >= 0:
                kb[s // 16, s % 16], vb[s // 16, s % 16] = k[i].view(kb.dtype), v[i].view(vb.dtype)
        assert np.array_equal(kc, kb) and np.array_equal(vc, vb)


def test_copy_blocks_all_layers_and_checks():
    rng = np.random.default_rng(3)
    lay = kvpool.KvLayout(2, 2, 64, 8, "float16")
    pool = kvpool.Pool(lay, 6, device="host")
    fill_host_pool(pool, rng)
    snap = [(pool.k_view(i).copy(), pool.v_view(i).copy()) for i in range(2)]
    copy_blocks(pool, np.array([[0, 3], [2, 5]]))
    for i, (kb, vb) in enumerate(snap):
        kb[[3, 5]], vb[[3, 5]] = kb[[0, 2]], vb[[0, 2]]
        assert np.array_equal(pool.k_view(i), kb) and np.array_equal(pool.v_view(i), vb)
    for bad in ([[0, 6]], [[0, 1], [2, 1]], [[0, 1], [1, 2]], [[-1, 2]]):
        with pytest.raises(kvpool.InvalidArgumentError):
            copy_blocks(pool, np.array(bad))


def test_plan_fills_gpu_and_covers_every_token():
    # One long sequence on 132 SMs: many splits, chunk a multiple of the loop step.
    p = split_kv(1, 8, 32768, 32, 132)
    assert p.num_splits > 1 and p.chunk_tokens % 32 == 0
    assert p.chunk_tokens * p.num_splits >= 32768 > p.chunk_tokens * (p.num_splits - 1)
    # Enough sequences already fill the GPU: no split.
    assert split_kv(256, 8, 2048, 32, 132).num_splits == 1
    # Short sequences are never cut below MIN_CHUNK tokens.
    assert split_kv(1, 1, 100, 32, 132).num_splits <= 2
    assert split_kv(4, 8, 4096, 32, 132, num_splits=1).num_splits == 1
    # The tensor-core kernel's fused merge holds at most MAX_DECODE_SPLITS partials, forced or not.
    assert split_kv(1, 1, 1 << 20, 64, 132, num_splits=1000).num_splits <= MAX_DECODE_SPLITS
    assert split_kv(1, 1, 1 << 20, 64, 10_000).num_splits <= MAX_DECODE_SPLITS


def test_every_supported_decode_shape_maps_to_a_compiled_variant():
    """The run time never asks for a module the CI compile test did not build, and the head
    tiles cover each group exactly (no empty last tile, none over the register cap)."""
    compiled = set(_build.tc_variants())
    for dtype in _build.DTYPES:
        for d in _build.TC_HEAD_DIMS:
            for group in range(1, 66):
                variant, gq = _build.tc_variant(dtype, d, group)
                assert variant in compiled and d <= variant.dp < d + 16
                tiles = -(-group // gq)
                assert (tiles - 1) * gq < group <= tiles * gq
                assert gq <= 8 * variant.nh and (variant.nh == 1 or gq > 8)


def _small_host_pool(dtype):
    pool = kvpool.Pool(kvpool.KvLayout(1, 2, 64, 8, dtype), 8, device="host")
    fill_host_pool(pool, np.random.default_rng(2))
    return pool


@pytest.mark.parametrize(
    ("dtype", "q_dtype"),
    [
        ("float16", np.int16),
        ("float16", np.uint16),
        ("float16", np.float32),
        ("bfloat16", np.float16),
        ("bfloat16", np.float32),
        ("bfloat16", np.int32),
    ],
)
def test_host_decode_rejects_q_element_types_the_gpu_rejects(dtype, q_dtype):
    """No numeric conversion and no float16 read as bfloat16 bits: the CUDA path's rule."""
    pool = _small_host_pool(dtype)
    tables = np.array([[0, 1]], np.int32)
    lens = np.array([4], np.int32)
    with pytest.raises(kvpool.InvalidArgumentError, match="dtype"):
        paged_attention_decode(np.zeros((1, 2, 64), q_dtype), pool, 0, tables, lens)


@pytest.mark.parametrize(
    ("dtype", "q_dtype"), [("float16", np.float16), ("bfloat16", np.uint16), ("bfloat16", np.int16)]
)
def test_host_decode_accepts_q_element_types_the_gpu_accepts(dtype, q_dtype):
    pool = _small_host_pool(dtype)
    q = random_elems(np.random.default_rng(4), (1, 2, 64), dtype).view(q_dtype)
    tables = np.array([[0, 1]], np.int32)
    lens = np.array([10], np.int32)
    got = paged_attention_decode(q, pool, np.int64(0), tables, lens)
    assert got.dtype == q.dtype and got.shape == q.shape
    out = np.zeros(q.shape, np.float16 if dtype == "float16" else np.uint16)
    assert paged_attention_decode(q, pool, 0, tables, lens, out=out) is out
    assert np.array_equal(out.view(np.uint16), got.view(np.uint16))


def test_host_decode_rejects_bad_out_tables_lens_and_layer():
    pool = _small_host_pool("float16")
    q = np.zeros((1, 2, 64), np.float16)
    tables = np.array([[0, 1]], np.int32)
    lens = np.array([4], np.int32)
    for out in (
        np.zeros((1, 2, 64), np.float32),
        np.zeros((1, 2, 64), np.int16),
        np.zeros((2, 2, 64), np.float16),
        np.zeros((1, 2, 32), np.float16),
        [0.0],
    ):
        with pytest.raises(kvpool.InvalidArgumentError, match="out"):
            paged_attention_decode(q, pool, 0, tables, lens, out=out)
    with pytest.raises(kvpool.InvalidArgumentError, match="block_tables"):
        paged_attention_decode(q, pool, 0, tables.astype(np.float32), lens)
    with pytest.raises(kvpool.InvalidArgumentError, match="seq_lens"):
        paged_attention_decode(q, pool, 0, tables, lens.astype(np.float64))
    for layer in (0.5, 0.0, "0", None):
        with pytest.raises(TypeError, match="layer"):
            paged_attention_decode(q, pool, layer, tables, lens)


def test_host_append_kv_rejects_element_types_and_float_layer():
    slots = np.array([3], np.int64)
    pool16 = _small_host_pool("float16")
    k16 = np.zeros((1, 2, 64), np.float16)
    for bad in (np.int16, np.uint16, np.float32):
        with pytest.raises(kvpool.InvalidArgumentError, match="dtype"):
            append_kv(np.zeros((1, 2, 64), bad), k16, pool16, 0, slots)
    with pytest.raises(TypeError, match="layer"):
        append_kv(k16, k16, pool16, 0.5, slots)
    pool_bf = _small_host_pool("bfloat16")
    with pytest.raises(kvpool.InvalidArgumentError, match="dtype"):
        append_kv(k16, k16, pool_bf, 0, slots)
    bits = np.full((1, 2, 64), 0x3F80, np.uint16)  # 1.0 in bfloat16
    append_kv(bits, bits.view(np.int16), pool_bf, np.int32(0), slots)
    assert (pool_bf.k_view(0)[0, 3].view(np.uint16) == 0x3F80).all()
    assert (pool_bf.v_view(0)[0, 3].view(np.uint16) == 0x3F80).all()
