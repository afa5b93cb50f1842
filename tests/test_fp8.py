"""fp8 KV caches on the CPU: the NumPy quantizer (bit for bit against ml_dtypes where both are
defined, saturation and NaN where they differ), KvScales (checks, frozen layers, calibration
that never looks at padding), and a host pool's fp8 append and decode against the float64
reference on the dequantized cache."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from kvpool import InvalidArgumentError, KvScales, reference

FP8 = ("float8_e4m3fn", "float8_e5m2")


def _ml_dtype(name):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return getattr(ml_dtypes, name)


def _interesting_floats(rng, dtype):
    """Every fp8 value, the midpoints between neighbours (ties: round to nearest even decides),
    values a hair either side of them, and random values across the whole range."""
    codes = np.arange(256, dtype=np.uint8)
    vals = reference.dequantize_fp8(codes, dtype)
    finite = np.unique(vals[np.isfinite(vals)])
    mids = (finite[1:] + finite[:-1]) / 2
    near = np.concatenate([mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    max_value = reference.FP8[dtype].max_value
    rand = rng.uniform(-max_value, max_value, 4000) * 10.0 ** rng.uniform(-9, 0, 4000)
    return np.concatenate([finite, mids, near, rand, [0.0, -0.0]]).astype(np.float32)


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_matches_ml_dtypes_bit_for_bit(dtype):
    ml = _ml_dtype(dtype)
    x = _interesting_floats(np.random.default_rng(1), dtype)
    x = x[np.abs(x) <= reference.FP8[dtype].max_value]  # ml_dtypes overflows where we saturate
    got = reference.quantize_fp8(x, dtype)
    want = x.astype(ml).view(np.uint8)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (
        f"{bad.size} mismatches, first {x[bad[:5]]}: {got[bad[:5]]} vs {want[bad[:5]]}"
    )


@pytest.mark.parametrize("dtype", FP8)
def test_dequantize_matches_ml_dtypes(dtype):
    ml = _ml_dtype(dtype)
    codes = np.arange(256, dtype=np.uint8)
    got = reference.dequantize_fp8(codes, dtype)
    want = codes.view(ml).astype(np.float64)
    np.testing.assert_array_equal(got, want)  # NaN positions equal too


@pytest.mark.parametrize("dtype", FP8)
def test_round_trip_of_every_finite_code(dtype):
    codes = np.arange(256, dtype=np.uint8)
    vals = reference.dequantize_fp8(codes, dtype)
    finite = np.isfinite(vals)
    back = reference.quantize_fp8(vals[finite].astype(np.float32), dtype)
    np.testing.assert_array_equal(back, codes[finite])


@pytest.mark.parametrize("dtype", FP8)
def test_saturation_and_nan(dtype):
    f = reference.FP8[dtype]
    x = np.array(
        [f.max_value * 1.01, 1e30, np.inf, -np.inf, -1e30, np.nan, -np.nan], dtype=np.float32
    )
    got = reference.quantize_fp8(x, dtype)
    assert list(got[:3]) == [f.max_code] * 3
    assert list(got[3:5]) == [0x80 | f.max_code] * 2
    assert got[5] & 0x7F == 0x7F and np.isnan(reference.dequantize_fp8(got[5:], dtype)).all()


def test_known_codes():
    e4m3 = reference.quantize_fp8(
        np.array([1.0, 448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, -(2.0**-6), 0.0], np.float32),
        "float8_e4m3fn",
    )
    # 2^-10 is a tie between 0 and 2^-9: even (0) wins; 3 * 2^-10 ties 2^-9 and 2^-8: 2^-8.
    assert list(e4m3) == [0x38, 0x7E, 0x01, 0x00, 0x02, 0x88, 0x00]
    e5m2 = reference.quantize_fp8(
        np.array([1.0, 57344.0, 2.0**-16, -(2.0**-14)], np.float32), "float8_e5m2"
    )
    assert list(e5m2) == [0x3C, 0x7B, 0x01, 0x84]


def _host_pool(
    dtype="float8_e4m3fn", num_kv_heads=2, head_dim=32, block_size=4, layers=2, num_blocks=8
):
    layout = kvpool.KvLayout(layers, num_kv_heads, head_dim, block_size, dtype)
    return kvpool.Pool(layout, num_blocks, device="host")


def test_layout_knows_e5m2():
    lay = kvpool.KvLayout(1, 1, 32, 8, "e5m2")
    assert lay.dtype == "float8_e5m2" and lay.elem_bytes == 1


def test_scales_checks_change_nothing_on_failure():
    pool = _host_pool()
    s = KvScales(pool)
    assert s.k_scale.shape == (2,) and not s.is_set(0)
    for bad in (0.0, -1.0, np.inf, np.nan, [1.0, 2.0], True, "x", 1e-50):
        with pytest.raises(InvalidArgumentError):
            s.set(0, bad, 1.0)
    assert not s.is_set(0) and (s.k_scale == 1).all()
    with pytest.raises(InvalidArgumentError):
        s.set(2, 1.0, 1.0)
    s.set(1, 0.5, 0.25)
    assert s.is_set(1) and s.k_scale[1] == 0.5 and s.v_scale[1] == 0.25
    heads = KvScales(pool, "head")
    assert heads.k_scale.shape == (2, 2)
    with pytest.raises(InvalidArgumentError, match=r"\[2\]"):
        heads.set(0, [1.0, 2.0, 3.0], 1.0)
    heads.set(0, [1.0, 2.0], 3.0)
    assert heads.k_scale[0].tolist() == [1.0, 2.0] and heads.v_scale[0].tolist() == [3.0, 3.0]
    with pytest.raises(InvalidArgumentError, match="granularity"):
        KvScales(pool, "channel")
    with pytest.raises(InvalidArgumentError, match="fp8 pool"):
        KvScales(_host_pool("float16"))


def test_calibration_ignores_padding_and_freezes():
    pool = _host_pool()
    s = KvScales(pool, "head")
    rng = np.random.default_rng(2)
    k = rng.standard_normal((5, 2, 32)).astype(np.float16)
    v = rng.standard_normal((5, 2, 32)).astype(np.float16)
    k[3] = 1000.0  # a padding row of garbage: must not count
    v[3] = -1000.0
    slots = np.array([0, 1, 2, -1, 5], dtype=np.int64)
    # Warm-up: a batch of only dummy rows leaves the layer unset.
    assert not s.calibrate_from(0, k, v, np.full(5, -1, np.int64))
    assert not s.is_set(0)
    assert s.calibrate_from(0, k, v, slots)
    real = np.array([0, 1, 2, 4])
    want_k = np.abs(k[real].astype(np.float64)).max(axis=(0, 2)) / 448.0
    np.testing.assert_allclose(s.k_scale[0], want_k.astype(np.float32), rtol=1e-7)
    assert s.k_scale[0].max() < 1.0  # not 1000 / 448
    before = s.k_scale.copy()
    assert not s.calibrate_from(0, k * 2, v * 2, slots)  # frozen
    np.testing.assert_array_equal(s.k_scale, before)
    zeros = np.zeros_like(k)
    assert not s.calibrate_from(1, zeros, zeros, slots)  # all-zero data gives no scale
    nan = k.copy()
    nan[0, 0, 0] = np.nan
    with pytest.raises(InvalidArgumentError, match="non-finite"):
        s.calibrate_from(1, nan, v, slots)
    assert not s.is_set(1)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16"])
def test_host_append_and_decode(dtype, granularity, q_dtype):
    rng = np.random.default_rng([len(dtype), len(granularity), len(q_dtype)])
    pool = _host_pool(dtype, num_kv_heads=2, head_dim=32, block_size=4)
    s = KvScales(pool, granularity, auto_calibrate=True)
    n = 10
    k64 = rng.standard_normal((n, 2, 32)) * np.array([1.0, 5.0])[None, :, None]
    v64 = rng.standard_normal((n, 2, 32))
    k, v = (reference.from_float64(x, q_dtype) for x in (k64, v64))
    slots = np.concatenate([np.arange(8, 16), [-1, 20]]).astype(np.int64)
    kvpool.append_kv(k, v, pool, 1, slots, scales=s)
    assert s.is_set(1) and not s.is_set(0)
    ks, vs = s.layer_scales(1)
    # The cache holds exactly the reference quantizer's codes.
    kc = pool.k_view(1).reshape(-1, 2, 32)
    np.testing.assert_array_equal(
        kc[slots[slots >= 0]], reference.quantize_kv(k, q_dtype, ks, dtype)[slots >= 0]
    )
    # Dequantized, it is within fp8's half-ulp of the input (relative 2^-4 / 2^-3).
    deq = reference.to_float64(kc[slots[slots >= 0]], dtype) * ks[None, :, None]
    kin = reference.to_float64(k, q_dtype)[slots >= 0]
    rel = 2.0 ** -(reference.FP8[dtype].mant_bits + 1)
    assert (np.abs(deq - kin) <= rel * np.abs(kin) + ks.max() * 2.0**-9).all()
    # Decode on the host pool is the float64 reference on the dequantized cache.
    tables = np.array([[2, 3, -1], [2, 5, 0]], dtype=np.int32)
    lens = np.array([8, 9], dtype=np.int32)
    q = reference.from_float64(rng.standard_normal((2, 4, 32)), q_dtype)
    got = kvpool.paged_attention_decode(q, pool, 1, tables, lens, scales=s)
    want = reference.paged_attention_decode(
        q, pool.k_view(1), pool.v_view(1), tables, lens, dtype, q_dtype=q_dtype, kv_scales=(ks, vs)
    )
    np.testing.assert_allclose(reference.to_float64(got, q_dtype), want, rtol=1e-2, atol=1e-2)
    # Prefill of one query per sequence (it sees every key) is the same attention.
    pre = kvpool.paged_attention_prefill(
        q, pool, 1, np.array([0, 1, 2], np.int32), tables, lens, scales=s
    )
    assert pre.dtype == q.dtype
    np.testing.assert_allclose(reference.to_float64(pre, q_dtype), want, rtol=1e-2, atol=1e-2)
    # ... and close to attention over the unquantized K/V (the end-to-end quantization error).
    kf = np.zeros((16 * 4, 2, 32))
    vf = np.zeros_like(kf)
    keep = slots >= 0
    kf[slots[keep]] = reference.to_float64(k, q_dtype)[keep]
    vf[slots[keep]] = reference.to_float64(v, q_dtype)[keep]
    exact = reference.paged_attention_decode(
        q,
        kf.reshape(16, 4, 2, 32),
        vf.reshape(16, 4, 2, 32),
        tables,
        lens,
        "float64",
        q_dtype=q_dtype,
    )
    err = np.linalg.norm(want - exact) / np.linalg.norm(exact)
    assert err < (0.16 if dtype == "float8_e5m2" else 0.08)  # rounding of 3 (2) mantissa bits


def test_fp8_bad_inputs_are_refused():
    pool = _host_pool()
    s = KvScales(pool)
    k = np.zeros((2, 2, 32), np.float16)
    slots = np.array([0, 1], np.int64)
    with pytest.raises(InvalidArgumentError, match="scales"):
        kvpool.append_kv(k, k, pool, 0, slots)
    with pytest.raises(InvalidArgumentError, match="float16 or both bfloat16"):
        kvpool.append_kv(
            k.view(np.uint8)[..., :32], k.view(np.uint8)[..., :32], pool, 0, slots, scales=s
        )
    with pytest.raises(InvalidArgumentError, match="float16 or both bfloat16"):
        kvpool.append_kv(k, k.view(np.uint16), pool, 0, slots, scales=s)
    other = KvScales(_host_pool())
    with pytest.raises(InvalidArgumentError, match="of this pool"):
        kvpool.append_kv(k, k, pool, 0, slots, scales=other)
    with pytest.raises(InvalidArgumentError, match="fp8 pools"):
        kvpool.append_kv(k, k, _host_pool("float16"), 0, slots, scales=s)
    tables = np.array([[0]], np.int32)
    lens = np.array([1], np.int32)
    q = np.zeros((1, 2, 32), np.float16)
    with pytest.raises(InvalidArgumentError, match="scales"):
        kvpool.paged_attention_decode(q, pool, 0, tables, lens)
    with pytest.raises(InvalidArgumentError, match="float16 or bfloat16"):
        kvpool.paged_attention_decode(q.view(np.uint8)[..., :32], pool, 0, tables, lens, scales=s)
    with pytest.raises(InvalidArgumentError, match="scales"):
        kvpool.paged_attention_prefill(q, pool, 0, np.array([0, 1], np.int32), tables, lens)
    with pytest.raises(InvalidArgumentError, match="float16 or bfloat16"):
        kvpool.paged_attention_prefill(
            q.view(np.uint8)[..., :32], pool, 0, np.array([0, 1], np.int32), tables, lens, scales=s
        )
    with pytest.raises(InvalidArgumentError, match="fp8 pools"):
        kvpool.paged_attention_prefill(
            q, _host_pool("float16"), 0, np.array([0, 1], np.int32), tables, lens, scales=s
        )
    assert (pool.k_view(0) == 0).all()  # nothing was written by a refused call
