"""An fp8 (float8_e4m3fn, one scale per layer) MLA latent group on the CPU (CI): the spec and the
supported set, MlaScales (set, freeze, calibration, refusals), mla_append_latent's quantization
round trip on a host pool (bit for bit reference.quantize_fp8 of x / scale, padding slots
skipped), the float64 reference of the dequantized cache, the host decode and extend plans
against it with float16 and bfloat16 queries, the argument checks (each a clear error before
anything changes), and append_latent's parameter block against the .cu. The NVRTC compile of
the KV_FP8 modules is tests/test_mla_compile.py's (they are in _build.mla_variants())."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from attention_inputs import qo_indptr, random_elems
from kvpool import HybridTables, InvalidArgumentError, KvGroup, ModelKvSpec, Pool, reference
from kvpool.kernels import (
    MlaScales,
    _build,
    mla_append_latent,
    mla_decode_plan,
    mla_extend_plan,
    mla_page_tables,
)
from kvpool.kernels._mla import supported_set

SCALE = 1 / math.sqrt(192)
FP8 = "float8_e4m3fn"
LENS = [1, 63, 64, 65, 130, 0, 7]


def make_host(lens, seed, kv_scales=(0.05, 0.02), q_dtype="bfloat16"):
    """A host pool with a full group (layer 0) and an fp8 MLA group (layers 1, 2), the
    sequences' latents written through mla_append_latent (pages shuffled by other requests'),
    and the written rows in float64 per layer (the values before quantization)."""
    spec = ModelKvSpec(
        [KvGroup.full([0], 2, 64, "bfloat16"), KvGroup.mla_latent([1, 2], 512, 64, FP8)],
        num_layers=3,
    )
    need = sum(-(-n // 64) for n in lens)
    pool = Pool.for_spec(spec, 2 * (need + 2 * len(lens)) + 16, device="host")
    tables = HybridTables(pool, spec)
    rng = np.random.default_rng(seed)
    for i, n in enumerate(lens):
        tables.add(1000 + i, int(rng.integers(1, 120)))
        tables.add(i, n)
    for i in range(len(lens)):
        tables.free(1000 + i)
    pt, sl = mla_page_tables(tables, range(len(lens)), 1)
    scales = MlaScales(pool, spec, 1)
    slots = np.concatenate(
        [
            pt[i, np.arange(n) // 64].astype(np.int64) * 64 + np.arange(n) % 64
            for i, n in enumerate(lens)
        ]
    )
    for layer, s in zip((1, 2), kv_scales, strict=True):
        scales.set(layer, s)
        rows = random_elems(rng, (len(slots), 576), q_dtype)
        mla_append_latent(pool, spec, layer, rows, slots, scales=scales)
    return spec, pool, scales, pt, sl, rng


def test_spec_accepts_an_fp8_latent_group_and_the_supported_set_names_it():
    spec = ModelKvSpec([KvGroup.mla_latent([0, 1], 512, 64, FP8)])
    assert spec.groups[0].dtype == FP8
    assert spec.block_size(0) == 64 and spec.page_bytes == 2 * 64 * 576
    assert spec.latent_offset_bytes(0, 0, 0, 1, 0) == 576  # one byte an element
    assert FP8 in supported_set() and FP8 in _build.MLA_FP8_DTYPES
    assert "float8_e5m2" not in _build.MLA_FP8_DTYPES


def test_reference_of_an_fp8_cache_is_the_dequantized_cache():
    rng = np.random.default_rng(3)
    codes = reference.quantize_fp8(rng.standard_normal((6, 8, 576)).astype(np.float32), FP8)
    tables = np.array([[0, 1, 2], [3, 4, -1], [5, -1, -1]])
    lens = [20, 9, 3]
    qn = random_elems(rng, (3, 4, 512), "float16")
    qp = random_elems(rng, (3, 4, 64), "float16")
    s = 0.037
    deq = reference.dequantize_fp8(codes, FP8) * float(np.float32(s))
    got = reference.mla_decode_reference(
        qn, qp, codes, tables, lens, SCALE, "float16", kv_dtype=FP8, kv_scale=s
    )
    want = reference.mla_decode_reference(
        reference.to_float64(qn, "float16"),
        reference.to_float64(qp, "float16"),
        deq,
        tables,
        lens,
        SCALE,
    )
    np.testing.assert_array_equal(got, want)
    ip = qo_indptr([3, 1, 2])
    qn = random_elems(rng, (6, 4, 512), "bfloat16")
    qp = random_elems(rng, (6, 4, 64), "bfloat16")
    got = reference.mla_extend_reference(
        qn, qp, codes, tables, lens, ip, SCALE, "bfloat16", kv_dtype=FP8, kv_scale=s
    )
    want = reference.mla_extend_reference(
        reference.to_float64(qn, "bfloat16"),
        reference.to_float64(qp, "bfloat16"),
        deq,
        tables,
        lens,
        ip,
        SCALE,
    )
    np.testing.assert_array_equal(got, want)
    # The scale matters: twice the scale is another result.
    other = reference.mla_extend_reference(
        qn, qp, codes, tables, lens, ip, SCALE, "bfloat16", kv_dtype=FP8, kv_scale=2 * s
    )
    assert np.abs(other - got).max() > 1e-3


@pytest.mark.parametrize("in_dtype", ["bfloat16", "float16"])
def test_append_quantizes_bit_for_bit_and_skips_padding(in_dtype):
    spec = ModelKvSpec([KvGroup.mla_latent([0, 1], 512, 64, FP8)])
    pool = Pool.for_spec(spec, 4, device="host")
    scales = MlaScales(pool, spec, 0)
    scales.set(1, 0.01)
    rng = np.random.default_rng(7)
    rows = random_elems(rng, (5, 576), in_dtype)
    rows[0, :4] = reference.from_float64(np.array([6e4, -6e4, 0.0, 1e-9]), in_dtype)
    slots = np.array([3, -1, 64 + 7, 4 * 64, 255], dtype=np.int64)  # -1 and past-the-pool skipped
    cache = mla_decode_plan(
        pool, spec, 0, np.zeros((1, 1), np.int32), [0], 1, scale=SCALE, scales=scales
    )._host_latent(1)
    before = cache.copy()
    mla_append_latent(pool, spec, 1, rows, slots, scales=scales)
    x32 = reference.to_float64(rows, in_dtype).astype(np.float32)
    want = reference.quantize_fp8(x32 / np.float32(0.01), FP8)
    for i, slot in enumerate(slots):
        if 0 <= slot < 4 * 64:
            np.testing.assert_array_equal(cache[slot // 64, slot % 64], want[i])
    assert cache[0, 3, 0] == 0x7E and cache[0, 3, 1] == 0xFE  # saturated to +-448
    changed = np.argwhere((cache != before).any(axis=2))
    assert {tuple(x) for x in changed} <= {(0, 3), (1, 7), (3, 63)}
    # The round trip: dequantized * scale within e4m3's half ulp (2^-4 relative) of the input
    # where it is a normal number in range.
    back = reference.dequantize_fp8(cache[1, 7], FP8) * np.float32(0.01)
    x = reference.to_float64(rows[2], in_dtype)
    normal = np.abs(x / 0.01) >= 2.0**-6
    assert np.all(np.abs(back - x)[normal] <= 2.0**-4 * np.abs(x)[normal] + 1e-12)
    # Layer 0 untouched by a write to layer 1.
    assert (
        not mla_decode_plan(
            pool, spec, 0, np.zeros((1, 1), np.int32), [0], 1, scale=SCALE, scales=scales
        )
        ._host_latent(0)
        .any()
    )


def test_scales_set_freeze_and_calibrate():
    spec = ModelKvSpec(
        [KvGroup.full([0], 2, 64), KvGroup.mla_latent([1, 2], 512, 64, FP8)], num_layers=3
    )
    pool = Pool.for_spec(spec, 2, device="host")
    s = MlaScales(pool, spec, 1, auto_calibrate=True)
    assert s.layers == (1, 2) and s.index(2) == 1
    assert not s.is_set(1) and s.layer_scale(1) == 1.0
    rng = np.random.default_rng(1)
    rows = random_elems(rng, (3, 576), "bfloat16")
    rows[1, 5] = reference.from_float64(np.array([-50.0]), "bfloat16")[0]
    rows[2, 5] = reference.from_float64(np.array([900.0]), "bfloat16")[0]  # padding: never counts
    slots = np.array([0, 1, -1], dtype=np.int64)
    mla_append_latent(pool, spec, 2, rows, slots, scales=s)  # auto-calibrates layer 2 first
    assert s.is_set(2) and not s.is_set(1)
    assert s.layer_scale(2) == pytest.approx(50.0 / 448, rel=1e-6)
    assert not s.calibrate_from(2, rows * 0, slots)  # frozen
    assert not s.calibrate_from(1, np.zeros((3, 576), np.uint16), slots)  # all zero: no scale
    assert not s.calibrate_from(1, rows, np.full(3, -1, np.int64))  # no real row
    assert not s.is_set(1)
    s.set(1, 0.25)
    assert s.layer_scale(1) == 0.25 and s.is_set(1)


def test_scales_refusals_change_nothing():
    spec = ModelKvSpec(
        [KvGroup.full([0], 2, 64), KvGroup.mla_latent([1, 2], 512, 64, FP8)], num_layers=3
    )
    pool = Pool.for_spec(spec, 2, device="host")
    s = MlaScales(pool, spec, 1)
    with pytest.raises(InvalidArgumentError, match="needs an fp8 mla_latent group"):
        MlaScales(pool, spec, 0)
    bf = ModelKvSpec([KvGroup.mla_latent([0], 512, 64, "bfloat16")])
    with pytest.raises(InvalidArgumentError, match="bfloat16 mla_latent group"):
        MlaScales(Pool.for_spec(bf, 2, device="host"), bf, 0)
    with pytest.raises(TypeError, match="spec must be a ModelKvSpec"):
        MlaScales(pool, "spec", 1)
    with pytest.raises(InvalidArgumentError, match="group 5 outside"):
        MlaScales(pool, spec, 5)
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e-60, 1e50):
        with pytest.raises(InvalidArgumentError, match="finite and > 0"):
            s.set(1, bad)
    for bad in ("0.1", True, None):
        with pytest.raises(TypeError, match="scale must be a float"):
            s.set(1, bad)
    with pytest.raises(
        InvalidArgumentError, match="layer 0 is in group 0 .full., not in the scales. MLA group 1"
    ):
        s.set(0, 0.5)
    with pytest.raises(InvalidArgumentError, match="layer 3 outside"):
        s.set(3, 0.5)
    with pytest.raises(InvalidArgumentError, match="latent must be"):
        s.calibrate_from(1, np.zeros((2, 512), np.uint16), np.zeros(2, np.int64))
    assert not s.is_set(1) and not s.is_set(2) and s.layer_scale(1) == 1.0


def test_append_refusals_change_nothing():
    spec = ModelKvSpec(
        [KvGroup.full([0], 2, 64), KvGroup.mla_latent([1, 2], 512, 64, FP8)], num_layers=3
    )
    pool = Pool.for_spec(spec, 2, device="host")
    s = MlaScales(pool, spec, 1)
    rows = np.ones((2, 576), np.uint16)
    slots = np.array([0, 1], np.int64)
    before = bytes(
        np.ctypeslib.as_array(
            (np.ctypeslib.ctypes.c_uint8 * (pool.num_blocks * pool.block_bytes)).from_address(
                pool.base_ptr
            )
        )
    )
    err = InvalidArgumentError
    with pytest.raises(err, match="needs scales=MlaScales"):
        mla_append_latent(pool, spec, 1, rows, slots)
    other = MlaScales(Pool.for_spec(spec, 2, device="host"), spec, 1)
    with pytest.raises(err, match="needs scales=MlaScales"):
        mla_append_latent(pool, spec, 1, rows, slots, scales=other)
    with pytest.raises(err, match="is a full group, not mla_latent"):
        mla_append_latent(pool, spec, 0, rows, slots, scales=s)
    with pytest.raises(err, match="latent must be"):
        mla_append_latent(pool, spec, 1, rows[:, :512], slots, scales=s)
    with pytest.raises(err, match="slot_mapping must be"):
        mla_append_latent(pool, spec, 1, rows, slots[:1], scales=s)
    with pytest.raises(err, match="slot_mapping must be int64"):
        mla_append_latent(pool, spec, 1, rows, slots.astype(np.int32), scales=s)
    with pytest.raises(err, match="must be float16 or bfloat16"):
        mla_append_latent(pool, spec, 1, rows.astype(np.float32), slots, scales=s)
    with pytest.raises(err, match="a stream was given"):
        mla_append_latent(pool, spec, 1, rows, slots, scales=s, stream=object())
    with pytest.raises(TypeError, match="layer must be an integer"):
        mla_append_latent(pool, spec, 1.0, rows, slots, scales=s)  # type: ignore[arg-type]
    bf = ModelKvSpec([KvGroup.mla_latent([0], 512, 64, "bfloat16")])
    bpool = Pool.for_spec(bf, 2, device="host")
    with pytest.raises(err, match="scales are for fp8 MLA groups"):
        mla_append_latent(bpool, bf, 0, rows, slots, scales=s)
    with pytest.raises(err, match="must hold the group's dtype bfloat16"):
        mla_append_latent(bpool, bf, 0, rows.view(np.float16), slots)
    after = bytes(
        np.ctypeslib.as_array(
            (np.ctypeslib.ctypes.c_uint8 * (pool.num_blocks * pool.block_bytes)).from_address(
                pool.base_ptr
            )
        )
    )
    assert before == after


def test_sixteen_bit_append_copies_bytes():
    bf = ModelKvSpec([KvGroup.mla_latent([0], 512, 64, "bfloat16")])
    pool = Pool.for_spec(bf, 2, device="host")
    rows = random_elems(np.random.default_rng(2), (2, 576), "bfloat16")
    mla_append_latent(pool, bf, 0, rows, np.array([65, -1], np.int64))
    lat = mla_decode_plan(
        pool, bf, 0, np.zeros((1, 1), np.int32), [0], 1, scale=SCALE
    )._host_latent(0)
    np.testing.assert_array_equal(lat[1, 1], rows[0])
    assert np.count_nonzero(lat.any(axis=2)) == 1


@pytest.mark.parametrize("q_dtype", ["bfloat16", "float16"])
def test_host_decode_plan_is_the_reference_of_the_dequantized_cache(q_dtype):
    spec, pool, scales, pt, sl, rng = make_host(LENS, 11, q_dtype=q_dtype)
    plan = mla_decode_plan(pool, spec, 1, pt, sl, 5, scale=SCALE, scales=scales)
    n = len(LENS)
    for layer, idx in ((1, 0), (2, 1)):
        qn = random_elems(rng, (n, 5, 512), q_dtype)
        qp = random_elems(rng, (n, 5, 64), q_dtype)
        got = plan.run(qn, qp, layer)
        assert got.dtype == qn.dtype
        cache = plan._host_latent(idx)
        assert cache.dtype == np.uint8
        deq = reference.dequantize_fp8(cache, FP8) * float(np.float32(scales.layer_scale(layer)))
        want = reference.mla_decode_reference(
            reference.to_float64(qn, q_dtype), reference.to_float64(qp, q_dtype), deq, pt, sl, SCALE
        )
        np.testing.assert_array_equal(got, reference.from_float64(want, q_dtype).view(qn.dtype))
        out = np.zeros_like(qn)
        assert plan.run(qn, qp, layer, out=out) is out
        np.testing.assert_array_equal(out, got)
        # A wrong scale (the other layer's) gives another result.
        wrong = reference.mla_decode_reference(
            reference.to_float64(qn, q_dtype),
            reference.to_float64(qp, q_dtype),
            deq * 2.5,
            pt,
            sl,
            SCALE,
        )
        assert np.abs(reference.to_float64(got, q_dtype) - wrong).max() > 1e-2


def test_host_extend_plan_is_the_reference_of_the_dequantized_cache():
    spec, pool, scales, pt, sl, rng = make_host(LENS, 12)
    qo = [1, 3, 64, 17, 30, 0, 7]
    ip = qo_indptr(qo)
    plan = mla_extend_plan(pool, spec, 1, ip, pt, sl, 4, scale=SCALE, scales=scales)
    qn = random_elems(rng, (int(ip[-1]), 4, 512), "bfloat16")
    qp = random_elems(rng, (int(ip[-1]), 4, 64), "bfloat16")
    got = plan.run(qn, qp, 2)
    want = reference.mla_extend_reference(
        qn,
        qp,
        plan._host_latent(1),
        pt,
        sl,
        ip,
        SCALE,
        "bfloat16",
        kv_dtype=FP8,
        kv_scale=scales.layer_scale(2),
    )
    np.testing.assert_array_equal(got, reference.from_float64(want, "bfloat16"))


def test_plan_refusals():
    spec, pool, scales, pt, sl, rng = make_host([5, 9], 4)
    err = InvalidArgumentError
    with pytest.raises(err, match="needs scales=MlaScales"):
        mla_decode_plan(pool, spec, 1, pt, sl, 4, scale=SCALE)
    with pytest.raises(err, match="needs scales=MlaScales"):
        mla_extend_plan(pool, spec, 1, qo_indptr([1, 1]), pt, sl, 4, scale=SCALE)
    with pytest.raises(err, match="needs scales=MlaScales"):
        mla_decode_plan(pool, spec, 1, pt, sl, 4, scale=SCALE, scales="s")  # type: ignore[arg-type]
    other_pool = Pool.for_spec(spec, pool.num_blocks, device="host")
    with pytest.raises(err, match="made for another pool"):
        mla_decode_plan(
            pool, spec, 1, pt, sl, 4, scale=SCALE, scales=MlaScales(other_pool, spec, 1)
        )
    bf = ModelKvSpec([KvGroup.mla_latent([0], 512, 64, "bfloat16")])
    bpool = Pool.for_spec(bf, 4, device="host")
    with pytest.raises(err, match="scales are for fp8 MLA groups"):
        mla_decode_plan(bpool, bf, 0, pt, sl, 4, scale=SCALE, scales=scales)
    e5 = ModelKvSpec([KvGroup.mla_latent([0], 512, 64, "float8_e5m2")])
    with pytest.raises(
        err, match="no MLA decode kernel for .*float8_e5m2.*supported: an mla_latent"
    ):
        mla_decode_plan(Pool.for_spec(e5, 4, device="host"), e5, 0, pt, sl, 4, scale=SCALE)
    plan = mla_decode_plan(pool, spec, 1, pt, sl, 4, scale=SCALE, scales=scales)
    qn = random_elems(rng, (2, 4, 512), "bfloat16")
    qp = random_elems(rng, (2, 4, 64), "bfloat16")
    with pytest.raises(err, match="float16 or bfloat16, got a 4-byte type"):
        plan.run(qn.astype(np.float32), qp, 1)
    with pytest.raises(err, match="q_pe must hold q_nope's dtype bfloat16"):
        plan.run(qn, qp.view(np.float16), 1)
    with pytest.raises(err, match="out must hold q_nope's dtype float16"):
        plan.run(qn.view(np.float16), qp.view(np.float16), 1, out=np.zeros((2, 4, 512), np.uint16))
    with pytest.raises(err, match="layer 0 is in group 0"):
        plan.run(qn, qp, 0)


def test_append_latent_args_match_the_kernel():
    from kvpool.kernels._build import read_source
    from kvpool.kernels._mla_append import _AppendLatentArgs

    src = read_source("append_kv.cu")
    sig = re.search(r"append_latent\((.*?)\)\s*\{", src, re.S)
    assert sig is not None
    names = [p.split()[-1].lstrip("*") for p in sig.group(1).split(",")]
    assert names == [f[0] for f in _AppendLatentArgs._fields_]


def test_emulated_kernel_over_fp8_codes_is_the_reference():
    """tools/mla_extend_emulator.py with KV_FP8's arithmetic (unscaled code values in the tile,
    the layer's scale on the logits and on 1 / row sum), split and unsplit, against the
    reference of the dequantized cache; a scale left out fails."""
    from test_mla_extend import emulator

    rng = np.random.default_rng(5)
    bs, heads, s = 16, 3, float(np.float32(0.03))  # the kernel reads a float32 scale
    lens = np.array([1, 40, 65, 130])
    qo = np.array([1, 3, 17, 20])
    ip = qo_indptr(qo)
    width = -(-lens.max() // bs)
    pages = rng.permutation(48)[: len(lens) * width].reshape(len(lens), width)
    codes = reference.quantize_fp8(rng.standard_normal((48, bs, 576)).astype(np.float32) / s, FP8)
    qn = rng.standard_normal((int(ip[-1]), heads, 512))
    qp = rng.standard_normal((int(ip[-1]), heads, 64))
    want = reference.mla_extend_reference(
        qn, qp, codes, pages, lens, ip, SCALE, kv_dtype=FP8, kv_scale=s
    )
    tile_values = reference.dequantize_fp8(codes, FP8)
    for tile, chunk, splits in ((16, 1 << 20, 1), (64, 32, 3)):
        launch = emulator.Launch(tile, chunk, splits, int(qo.max()) * heads)
        got = emulator.emulate(qn, qp, tile_values, pages, lens, ip, SCALE, launch, kv_scale=s)
        assert np.abs(got - want).max() <= 1e-9 * np.abs(want).max()
    got = emulator.emulate(qn, qp, tile_values, pages, lens, ip, SCALE, launch)
    assert np.abs(got - want).max() > 0.1 * np.abs(want).max()


def test_one_call_decode_takes_the_scales():
    from kvpool.kernels import paged_mla_decode

    spec, pool, scales, pt, sl, rng = make_host([5, 70], 8)
    qn = random_elems(rng, (2, 4, 512), "float16")
    qp = random_elems(rng, (2, 4, 64), "float16")
    plan = mla_decode_plan(pool, spec, 1, pt, sl, 4, scale=SCALE, scales=scales)
    got = paged_mla_decode(qn, qp, pool, spec, 2, pt, sl, scale=SCALE, scales=scales)
    np.testing.assert_array_equal(got, plan.run(qn, qp, 2))
    with pytest.raises(InvalidArgumentError, match="needs scales=MlaScales"):
        paged_mla_decode(qn, qp, pool, spec, 2, pt, sl, scale=SCALE)
    with pytest.raises(InvalidArgumentError, match="scales: the plan's own arguments"):
        paged_mla_decode(qn, qp, pool, spec, 2, pt, sl, plan=plan, scales=scales)
