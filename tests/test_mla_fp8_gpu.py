"""MLA decode and extend over an fp8 (float8_e4m3fn, one scale per layer) latent group on the GPU,
against the float64 reference of the dequantized cache, per (sequence, query position, head): a
CUDA pool made from a ModelKvSpec with an fp8 MLA group of two layers of different scales
(64-token pages, shuffled by other requests' pages), the latents written by mla_append_latent
on the device (checked byte for byte against reference.quantize_fp8), ragged batches (1 to
4097 tokens), 16 / 20 / 128 heads, every head tile, split and unsplit, float16 and bfloat16
queries. Outputs are poisoned (NaN) before each run; the rows past each sequence's end in its
last page hold the e4m3 NaN code (never read); no NaN may come out. Mutations (a wrong scale,
one token too few, the causal bound one key short) must fail the same bound. Skipped without
a GPU (conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
from attention_inputs import qo_indptr, random_elems
from gpu_fixtures import cp, error_report, poisoned, to_device
from kvpool import HybridTables, InvalidArgumentError, KvGroup, ModelKvSpec, Pool, reference
from kvpool.kernels import (
    MlaScales,
    mla_append_latent,
    mla_decode_plan,
    mla_extend_plan,
    mla_page_tables,
)
from test_mla_extend_gpu import QO_NARROW, QO_WIDE
from test_mla_gpu import BOUND, LENS, SCALE, row_errors, run_case, to_host

pytestmark = pytest.mark.gpu

FP8 = "float8_e4m3fn"
LAYER_SCALES = (0.02, 0.012)  # layers 1 and 2: rows of N(0, 1) values stay inside e4m3's range
E4M3_NAN = 0x7F
ERRORS: dict[str, float] = {}
_report = error_report(ERRORS, "KVPOOL_MLA_FP8_ERRORS")


def make_batch(lens, seed, in_dtype="bfloat16"):
    """The pool, its spec and MlaScales, the tables and lengths, the host copy of the group's
    bytes per layer ([num_pages, 64, 576] codes) and the rng."""
    spec = ModelKvSpec(
        [KvGroup.full([0], 2, 64, "bfloat16"), KvGroup.mla_latent([1, 2], 512, 64, FP8)],
        num_layers=3,
    )
    need = sum(-(-n // 64) for n in lens)
    pool = Pool.for_spec(spec, 2 * (need + 2 * len(lens)) + 64, device="cuda")
    tables = HybridTables(pool, spec)
    rng = np.random.default_rng(seed)
    for i, n in enumerate(lens):
        tables.add(1000 + i, int(rng.integers(1, 200)))  # scatter the pages
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
    nbytes = pool.num_blocks * pool.block_bytes
    mem = cp.cuda.UnownedMemory(pool.base_ptr, nbytes, pool)
    dslab = cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))
    dslab[...] = 0x5A  # bytes no write touches: never read as a key
    for layer, s in zip((1, 2), LAYER_SCALES, strict=True):
        scales.set(layer, s)
        rows = random_elems(rng, (len(slots), 576), in_dtype)
        mla_append_latent(
            pool, spec, layer, to_device(rows, in_dtype), cp.asarray(slots), scales=scales
        )
        cp.cuda.runtime.deviceSynchronize()
        # The device append is the reference quantization, byte for byte.
        host = cp.asnumpy(dslab).reshape(pool.num_blocks, pool.block_bytes)
        start = spec.latent_offset_bytes(1, 0, layer - 1, 0, 0)
        lay = host[:, start : start + 64 * 576].reshape(pool.num_blocks, 64, 576)
        x32 = reference.to_float64(rows, in_dtype).astype(np.float32)
        want = reference.quantize_fp8(x32 / np.float32(s), FP8)
        assert np.array_equal(lay[slots // 64, slots % 64], want), f"layer {layer}: append bytes"
    # NaN codes in every row past a sequence's end in its last page, both layers.
    for idx in range(2):
        for i, n in enumerate(lens):
            if n % 64:
                page = int(pt[i, (n - 1) // 64])
                a = spec.latent_offset_bytes(1, page, idx, n % 64, 0)
                b = spec.latent_offset_bytes(1, page, idx, 63, 575) + 1
                dslab[a:b] = E4M3_NAN
    host = cp.asnumpy(dslab).reshape(pool.num_blocks, pool.block_bytes)
    caches = []
    for idx in range(2):
        start = spec.latent_offset_bytes(1, 0, idx, 0, 0)
        caches.append(host[:, start : start + 64 * 576].reshape(pool.num_blocks, 64, 576))
    return spec, pool, scales, pt, sl, caches, rng


def ref_decode(qn, qp, cache, pt, sl, q_dtype, kv_scale):
    return reference.mla_decode_reference(
        qn, qp, cache, pt, sl, SCALE, q_dtype, kv_dtype=FP8, kv_scale=kv_scale
    )


DECODE_CASES = [
    # q dtype, heads, head_tile, num_splits (None: the plan's)
    ("bfloat16", 16, None, 1),
    ("bfloat16", 16, None, None),
    ("float16", 16, None, 7),
    ("float16", 16, None, None),
    ("bfloat16", 128, None, None),
    ("bfloat16", 128, None, 1),
    ("float16", 128, None, 5),
    ("bfloat16", 128, 32, None),
    ("bfloat16", 128, 16, 3),
    ("bfloat16", 20, 16, 2),
    ("float16", 20, None, None),
]


@pytest.mark.parametrize(("q_dtype", "heads", "head_tile", "splits"), DECODE_CASES)
def test_fp8_mla_decode_matches_float64(q_dtype, heads, head_tile, splits):
    spec, pool, scales, pt, sl, caches, rng = make_batch(LENS, heads * 5 + (splits or 0), q_dtype)
    n = len(LENS)
    plan = mla_decode_plan(
        pool,
        spec,
        1,
        cp.asarray(pt),
        cp.asarray(sl),
        heads,
        scale=SCALE,
        max_seq_len=max(LENS),
        num_splits=splits,
        head_tile=head_tile,
        scales=scales,
    )
    name = f"decode-{q_dtype}-h{heads}-t{head_tile}-s{splits}"
    for layer, idx in ((1, 0), (2, 1)):
        qn, qp, got = run_case(plan, rng, q_dtype, heads, n, layer)
        assert not np.isnan(got).any(), f"{name}: NaN in the output"
        s = LAYER_SCALES[idx]
        want = ref_decode(qn, qp, caches[idx], pt, sl, q_dtype, s)
        err = row_errors(got, want)
        ERRORS[f"{name}-L{layer}"] = float(err.max())
        assert not (err > BOUND[q_dtype]).any(), f"{name} layer {layer}: max {err.max()}"
        if layer != 1:
            continue
        # Mutations the bound must catch: a scale 10 % off (every row), the other layer's
        # scale, one token too few in a sequence.
        for wrong in (1.1 * s, LAYER_SCALES[1]):
            mut = ref_decode(qn, qp, caches[idx], pt, sl, q_dtype, wrong)
            assert row_errors(got, mut).min() > BOUND[q_dtype], f"{name}: scale {wrong} passes"
        short = sl.copy()
        short[3] -= 1  # 65 -> 64 tokens
        mut = ref_decode(qn, qp, caches[idx], pt, short, q_dtype, s)
        assert row_errors(got, mut)[3].max() > BOUND[q_dtype], f"{name}: one token off passes"


EXTEND_CASES = [
    # q dtype, heads, head_tile, num_splits, qo lens
    ("bfloat16", 16, None, None, QO_WIDE),
    ("bfloat16", 16, 16, 3, QO_WIDE),
    ("float16", 16, 32, 1, QO_WIDE),
    ("bfloat16", 128, None, 4, QO_NARROW),
    ("float16", 128, None, None, QO_NARROW),
    ("bfloat16", 20, None, 2, QO_WIDE),
]


@pytest.mark.parametrize(("q_dtype", "heads", "head_tile", "splits", "qo"), EXTEND_CASES)
def test_fp8_mla_extend_matches_float64(q_dtype, heads, head_tile, splits, qo):
    spec, pool, scales, pt, sl, caches, rng = make_batch(LENS, heads * 13 + (splits or 0), q_dtype)
    ip = qo_indptr(qo)
    total_q = int(ip[-1])
    plan = mla_extend_plan(
        pool,
        spec,
        1,
        ip,
        cp.asarray(pt),
        sl,
        heads,
        scale=SCALE,
        num_splits=splits,
        head_tile=head_tile,
        scales=scales,
    )
    name = f"extend-{q_dtype}-h{heads}-t{head_tile}-s{splits}-q{max(qo)}"
    for layer, idx in ((1, 0), (2, 1)):
        qn, qp, got = run_case(plan, rng, q_dtype, heads, total_q, layer)
        assert not np.isnan(got).any(), f"{name}: NaN in the output"
        s = LAYER_SCALES[idx]
        want = reference.mla_extend_reference(
            qn, qp, caches[idx], pt, sl, ip, SCALE, q_dtype, kv_dtype=FP8, kv_scale=s
        )
        err = row_errors(got, want)
        ERRORS[f"{name}-L{layer}"] = float(err.max())
        assert not (err > BOUND[q_dtype]).any(), f"{name} layer {layer}: max {err.max()}"
        if layer != 1 or head_tile is not None:
            continue
        mut = reference.mla_extend_reference(
            qn, qp, caches[idx], pt, sl, ip, SCALE, q_dtype, kv_dtype=FP8, kv_scale=1.1 * s
        )
        assert row_errors(got, mut).min() > BOUND[q_dtype], f"{name}: a wrong scale passes"
        # The causal bound one key short on the chunk crossing a page (sequence 3).
        a, b = int(ip[3]), int(ip[4])
        mut = reference.mla_extend_reference(
            qn[a:b],
            qp[a:b],
            caches[idx],
            pt[3:4],
            [LENS[3] - 1],
            qo_indptr([qo[3]]),
            SCALE,
            q_dtype,
            kv_dtype=FP8,
            kv_scale=s,
        )
        assert row_errors(got[a:b], mut).max() > BOUND[q_dtype], f"{name}: causal short passes"


def test_fp8_qo_len_one_is_the_decode_kernel_and_scale_changes_are_seen():
    """An extend plan of one query per sequence gives the decode plan's output bit for bit; a
    scale set after the plan was made is read by the next run (the kernel reads it at launch)."""
    spec, pool, scales, pt, sl, caches, rng = make_batch(LENS, 9)
    n, heads = len(LENS), 16
    dpt = cp.asarray(pt)
    dec = mla_decode_plan(pool, spec, 1, dpt, cp.asarray(sl), heads, scale=SCALE, scales=scales)
    ext = mla_extend_plan(
        pool, spec, 1, qo_indptr([1] * n), dpt, sl, heads, scale=SCALE, scales=scales
    )
    qn = random_elems(rng, (n, heads, 512), "bfloat16")
    qp = random_elems(rng, (n, heads, 64), "bfloat16")
    a, b = poisoned((n, heads, 512), "bfloat16"), poisoned((n, heads, 512), "bfloat16")
    dec.run(to_device(qn, "bfloat16"), to_device(qp, "bfloat16"), 2, out=a)
    ext.run(to_device(qn, "bfloat16"), to_device(qp, "bfloat16"), 2, out=b)
    cp.cuda.runtime.deviceSynchronize()
    assert bool((a == b).all())
    scales.set(2, 2 * LAYER_SCALES[1])
    dec.run(to_device(qn, "bfloat16"), to_device(qp, "bfloat16"), 2, out=a)
    cp.cuda.runtime.deviceSynchronize()
    got = to_host(a, "bfloat16")
    want = ref_decode(qn, qp, caches[1], pt, sl, "bfloat16", 2 * LAYER_SCALES[1])
    assert row_errors(got, want).max() <= BOUND["bfloat16"]


def test_fp8_device_refusals_before_a_launch():
    spec, pool, scales, pt, sl, caches, rng = make_batch([5, 70], 2)
    plan = mla_decode_plan(
        pool, spec, 1, cp.asarray(pt), cp.asarray(sl), 4, scale=SCALE, scales=scales
    )
    qn = cp.zeros((2, 4, 512), cp.float32)
    qp = cp.zeros((2, 4, 64), cp.float16)
    with pytest.raises(InvalidArgumentError, match="float16 or bfloat16, got a 4-byte type"):
        plan.run(qn, qp, 1)
    with pytest.raises(InvalidArgumentError, match="q_pe must hold q_nope's dtype bfloat16"):
        plan.run(cp.zeros((2, 4, 512), cp.uint16), qp, 1)
    with pytest.raises(InvalidArgumentError, match="needs scales=MlaScales"):
        mla_decode_plan(pool, spec, 1, cp.asarray(pt), cp.asarray(sl), 4, scale=SCALE)


def test_fp8_device_auto_calibration_matches_the_host_rule():
    spec = ModelKvSpec([KvGroup.mla_latent([0], 512, 64, FP8)])
    pool = Pool.for_spec(spec, 2, device="cuda")
    s = MlaScales(pool, spec, 0, auto_calibrate=True)
    rng = np.random.default_rng(4)
    rows = random_elems(rng, (3, 576), "bfloat16")
    rows[2, 0] = reference.from_float64(np.array([1000.0]), "bfloat16")[0]  # padding row
    slots = np.array([0, 65, -1], np.int64)
    mla_append_latent(pool, spec, 0, to_device(rows, "bfloat16"), cp.asarray(slots), scales=s)
    amax = np.abs(reference.to_float64(rows[:2], "bfloat16")).max()
    assert s.is_set(0) and s.layer_scale(0) == pytest.approx(amax / 448, rel=1e-6)
