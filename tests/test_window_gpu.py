"""Sliding-window, chunked local attention and attention sinks on a GPU (marker `gpu`): the
tensor-core decode (split-KV and fused merge included) and the Ampere prefill against the
float64 reference per (sequence, head) and per (token, head).

Conventions (kvpool.kernels._window): window w, the query at position p sees (p - w, p]
(transformers' sliding_window for gpt-oss / Gemma 3); chunk c, [p // c * c, p] (Llama 4);
sinks s_h join head h's softmax denominator only. The tests check them against the reference,
and tests/test_window_reference.py checks the reference against the definitions.

Every case: fresh random K/V, ragged lengths (shorter and longer than the window, windows
starting mid-page, chunks crossing pages), outputs poisoned with NaN before each run, and the
K/V of every position before a sequence's first visible key set to NaN in the pool, so that a
kernel that loads one (even masked: 0 * NaN in P.V is NaN) fails. Each kernel runs over the
full tables and over window-relative tables (only the live pages, `first_page`), and the
mutations (a window one token too wide, a chunk one token early, a sink left out) must fail the
bound. On compute capability 9.0 the prefill plans take paged_prefill.cu (the sm_90 kernel has
no windows), which these tests therefore check there too. The last test runs both kernels over
fp8 caches (e4m3 / e5m2 codes, per-head scales), the codes before each window NaN (0x7f).
"""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from attention_check import as_float64, assert_attention_close
from attention_inputs import qo_indptr, shuffled_tables
from gpu_fixtures import (
    NAN_BITS,
    cp,
    cuda_pool,
    device_elems,
    error_report,
    poisoned,
    to_device,
)
from kvpool import reference
from kvpool.kernels import decode_plan, prefill_plan

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16"]
ERRORS: dict[str, float] = {}
_error_report = error_report(ERRORS)

# (head_dim, num_kv_heads, num_q_heads, block_size): gpt-oss (64, GQA 8), Llama 4 (128, GQA 4,
# small pages), Gemma 3 (256, GQA 2, 32-token pages).
SHAPES = [(64, 2, 16, 16), (128, 2, 8, 4), (256, 1, 2, 32)]
# (window, chunk, sinks): gpt-oss's 128 with sinks, a window starting mid-page, Gemma 3's 1024,
# a window of one key, one longer than every sequence, chunks of 64 (page-aligned) and 100
# (crossing pages), full attention with sinks.
MASKS = [
    (128, None, True),
    (37, None, False),
    (1024, None, True),
    (1, None, False),
    (100000, None, True),
    (None, 64, False),
    (None, 100, True),
    (None, None, True),
]
DECODE_LENS = [1, 5, 37, 127, 128, 129, 300, 1100, 4100]


def _mask_id(m):
    w, c, s = m
    return f"w{w}" if w else (f"c{c}" if c else "full") + ("+sink" if s else "")


def _poison_before(pool, tables, starts, lens, dtype):
    """NaN into the K and V of positions 0 .. starts[i] - 1 of every sequence (the tokens no
    query of the batch sees)."""
    bs = pool.layout.block_size
    nan = NAN_BITS[dtype]
    for view in (pool.k_view(0), pool.v_view(0)):
        arr = cp.asarray(view).view(cp.uint16)
        for i, lo in enumerate(starts):
            pos = np.arange(int(lo))
            if len(pos):
                blk = tables[i, pos // bs]
                arr[cp.asarray(blk), cp.asarray(pos % bs)] = nan


def _window_tables(full, lens, bs, starts):
    """Window-relative tables: row i holds the pages from the one of starts[i] on; first_page."""
    fp = np.array([int(s) // bs for s in starts], np.int32)
    width = max(-(-int(n) // bs) - int(f) for n, f in zip(lens, fp, strict=True)) + 1
    out = np.full((len(lens), width), -1, np.int32)
    for i, (n, f) in enumerate(zip(lens, fp, strict=True)):
        pages = full[i, f : -(-int(n) // bs)]
        out[i, : len(pages)] = pages
    return out, fp


def _host_kv(pool):
    return cp.asnumpy(cp.asarray(pool.k_view(0))), cp.asnumpy(cp.asarray(pool.v_view(0)))


def _must_fail(got, want, dtype, what):
    with pytest.raises(AssertionError, match="exceed"):
        assert_attention_close(got, want, dtype, what)


def _sinks(rng, hq):
    # Logits of the size of q.k * scale (about N(0, 1)) and larger: the sink matters.
    return (rng.standard_normal(hq) * 2 + 1).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "hkv", "hq", "bs"), SHAPES)
@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
def test_window_decode_matches_reference(dtype, d, hkv, hq, bs, mask):
    window, chunk, with_sinks = mask
    rng = np.random.default_rng([d, bs, hq, len(dtype), window or 0, chunk or 0])
    lens = np.array(DECODE_LENS, np.int32)
    need = sum(-(-int(n) // bs) for n in lens)
    pool = cuda_pool(rng, hkv, d, bs, dtype, need + 8, 1)
    full = shuffled_tables(rng, lens, bs, pool.num_blocks)
    starts = reference.key_start(lens - 1, window, chunk)
    k_all, v_all = _host_kv(pool)  # before the poison: the mutations read earlier keys
    _poison_before(pool, full, starts, lens, dtype)
    q = device_elems(rng, (len(lens), hq, d), dtype)
    q_host = cp.asnumpy(q)
    sinks = _sinks(rng, hq) if with_sinks else None
    sinks_dev = None if sinks is None else cp.asarray(sinks)

    def want(**kw):
        args = dict(window=window, chunk=chunk, sinks=sinks)
        args.update(kw)
        return reference.paged_attention_decode(
            q_host, k_all, v_all, full, lens, dtype, None, **args
        )

    ref = want()
    wtab, fp = _window_tables(full, lens, bs, starts)
    runs = {
        "full tables": dict(block_tables=full),
        "window tables": dict(block_tables=wtab, first_page=fp),
        "window tables, 4 splits": dict(block_tables=wtab, first_page=fp, num_splits=4),
    }
    label = f"decode[{dtype},d{d},bs{bs},hq{hq},{_mask_id(mask)}]"
    for name, kw in runs.items():
        tables = cp.asarray(kw.pop("block_tables"))
        if "first_page" in kw:
            kw["first_page"] = cp.asarray(kw["first_page"])
        plan = decode_plan(
            pool,
            tables,
            cp.asarray(lens),
            hq,
            window=window,
            chunk=chunk,
            max_seq_len=int(lens.max()),
            **kw,
        )
        if name.endswith("splits") and min(int(lens.max()), (window or chunk or 10**9)) > 128:
            assert plan.split, plan.kv_split  # the fused merge (and its sink) is exercised
        out = poisoned(q.shape, dtype)
        assert plan.run(q, 0, out=out, sinks=sinks_dev) is out
        got = as_float64(out, dtype)
        assert np.isfinite(got).all(), f"{label} {name}: NaN or unwritten outputs"
        ERRORS[f"{label} {name}"] = assert_attention_close(got, ref, dtype, f"{label} {name}")
    # The bound sees a window one token too wide, a chunk one token early, a sink left out.
    if window is not None and window < int(lens.max()):
        _must_fail(got, want(window=window + 1), dtype, "window one token too wide")
    if chunk is not None:
        early = [reference.key_start(int(n) - 1, None, chunk) - 1 for n in lens]
        wide = np.zeros_like(ref)
        for i, n in enumerate(lens):
            lo = max(int(early[i]), 0)
            k = reference.to_float64(reference.gather_kv(k_all, full[i], int(n)), dtype)[lo:]
            v = reference.to_float64(reference.gather_kv(v_all, full[i], int(n)), dtype)[lo:]
            q64 = reference.to_float64(q_host[i], dtype)
            wide[i] = reference.attention_decode(q64, k, v, d**-0.5, sinks=sinks)
        _must_fail(got, wide, dtype, "chunk one token early")
    if sinks is not None:
        _must_fail(got, want(sinks=None), dtype, "sink left out")


# (seq_len, qo_len): a fresh prompt, a chunk on a long prefix, a decode row on a long context,
# a prompt of one window plus one, a 65-token chunk, a short speculative row.
PREFILL_SEQS = [(300, 300), (1500, 200), (4100, 1), (129, 129), (2000, 65), (37, 5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "hkv", "hq", "bs"), SHAPES[:2])
@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
def test_window_prefill_matches_reference(dtype, d, hkv, hq, bs, mask):
    window, chunk, with_sinks = mask
    rng = np.random.default_rng([7, d, bs, hq, len(dtype), window or 0, chunk or 0])
    lens = np.array([s for s, _ in PREFILL_SEQS], np.int32)
    qo = np.array([t for _, t in PREFILL_SEQS], np.int32)
    ip = qo_indptr(qo)
    need = sum(-(-int(n) // bs) for n in lens)
    pool = cuda_pool(rng, hkv, d, bs, dtype, need + 8, 1)
    full = shuffled_tables(rng, lens, bs, pool.num_blocks)
    starts = reference.key_start(lens - qo, window, chunk)
    k_all, v_all = _host_kv(pool)  # before the poison: the mutations read earlier keys
    _poison_before(pool, full, starts, lens, dtype)
    q = device_elems(rng, (int(ip[-1]), hq, d), dtype)
    q_host = cp.asnumpy(q)
    sinks = _sinks(rng, hq) if with_sinks else None
    sinks_dev = None if sinks is None else cp.asarray(sinks)

    def want(**kw):
        args = dict(window=window, chunk=chunk, sinks=sinks)
        args.update(kw)
        return reference.paged_attention_prefill(
            q_host, k_all, v_all, ip, full, lens, dtype, None, True, **args
        )

    ref = want()
    wtab, fp = _window_tables(full, lens, bs, starts)
    runs = {
        "full tables": dict(block_tables=full),
        "window tables": dict(block_tables=wtab, first_page=fp),
        "window tables, 3 splits": dict(block_tables=wtab, first_page=fp, num_splits=3),
    }
    label = f"prefill[{dtype},d{d},bs{bs},hq{hq},{_mask_id(mask)}]"
    for name, kw in runs.items():
        tables = cp.asarray(kw.pop("block_tables"))
        if "first_page" in kw:
            kw["first_page"] = cp.asarray(kw["first_page"])
        plan = prefill_plan(
            pool,
            ip,
            tables,
            lens,
            hq,
            window=window,
            chunk=chunk,
            use_sinks=sinks is not None,
            **kw,
        )
        assert plan.variant.source == "paged_prefill.cu"  # also on sm_90
        if name.endswith("splits") and (window or chunk or 10**9) >= 128:
            assert plan.split, plan.num_splits  # the merge (and its sink) is exercised
        out = poisoned(q.shape, dtype)
        assert plan.run(q, 0, out=out, sinks=sinks_dev) is out
        got = as_float64(out, dtype)
        assert np.isfinite(got).all(), f"{label} {name}: NaN or unwritten outputs"
        ERRORS[f"{label} {name}"] = assert_attention_close(got, ref, dtype, f"{label} {name}")
    if window is not None and window < int(lens.max()):
        _must_fail(got, want(window=window + 1), dtype, "window one token too wide")
    if sinks is not None:
        _must_fail(got, want(sinks=None), dtype, "sink left out")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "chunk"), [(128, None), (37, None), (None, 100)])
def test_prefill_of_one_query_per_sequence_is_the_decode(dtype, window, chunk):
    """qo_len 1 for every sequence (narrow prefill CTAs): the prefill equals the decode (both
    within the bound of the reference, and of each other)."""
    d, hkv, hq, bs = 64, 2, 16, 16
    rng = np.random.default_rng([11, len(dtype), window or 0, chunk or 0])
    lens = np.array(DECODE_LENS, np.int32)
    need = sum(-(-int(n) // bs) for n in lens)
    pool = cuda_pool(rng, hkv, d, bs, dtype, need + 8, 1)
    full = shuffled_tables(rng, lens, bs, pool.num_blocks)
    starts = reference.key_start(lens - 1, window, chunk)
    wtab, fp = _window_tables(full, lens, bs, starts)
    q = device_elems(rng, (len(lens), hq, d), dtype)
    sinks = cp.asarray(_sinks(rng, hq))
    tables, fpd, lens_d = cp.asarray(wtab), cp.asarray(fp), cp.asarray(lens)
    dec = poisoned(q.shape, dtype)
    decode_plan(pool, tables, lens_d, hq, window=window, chunk=chunk, first_page=fpd).run(
        q, 0, out=dec, sinks=sinks
    )
    pre = poisoned(q.shape, dtype)
    plan = prefill_plan(
        pool,
        qo_indptr([1] * len(lens)),
        tables,
        lens,
        hq,
        window=window,
        chunk=chunk,
        first_page=fpd,
        use_sinks=True,
    )
    assert plan.rows_per_cta == 16  # the narrow (decode-like) tiles
    plan.run(q, 0, out=pre, sinks=sinks)
    k_all, v_all = _host_kv(pool)
    ref = reference.paged_attention_decode(
        cp.asnumpy(q),
        k_all,
        v_all,
        wtab,
        lens,
        dtype,
        window=window,
        chunk=chunk,
        sinks=cp.asnumpy(sinks),
        first_page=fp,
    )
    label = f"qo1[{dtype},{window},{chunk}]"
    ERRORS[label + " decode"] = assert_attention_close(dec, ref, dtype, label + " decode")
    ERRORS[label + " prefill"] = assert_attention_close(pre, ref, dtype, label + " prefill")
    assert_attention_close(pre, as_float64(dec, dtype), dtype, label + " prefill vs decode")


def test_the_cuda_core_decode_refuses_windows():
    from kvpool.kernels import _tuning

    rng = np.random.default_rng(0)
    pool = cuda_pool(rng, 2, 64, 16, "float16", 8, 1)
    tables, lens = cp.zeros((1, 4), cp.int32), cp.ones(1, cp.int32)
    with _tuning.override(decode_pipeline=1):
        with pytest.raises(kvpool.InvalidArgumentError, match="tensor-core decode"):
            decode_plan(pool, tables, lens, 4, window=8, max_seq_len=1)
        plan = decode_plan(pool, tables, lens, 4, max_seq_len=1)
        with pytest.raises(kvpool.InvalidArgumentError, match="sinks run on the tensor-core"):
            plan.run(device_elems(rng, (1, 4, 64), "float16"), 0, sinks=cp.zeros(4, cp.float32))


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("q_dtype", DTYPES)
def test_window_over_an_fp8_cache(fmt, q_dtype):
    """The window decode and prefill over an fp8 cache (per-head scales, sinks, window-relative
    tables): attention over the dequantized cache, the codes before each window NaN (0x7f)."""
    d, hkv, hq, bs, window = 128, 2, 8, 16, 100
    rng = np.random.default_rng([13, len(fmt), len(q_dtype)])
    lens = np.array([1, 37, 300, 1100], np.int32)
    qo = np.array([1, 20, 64, 3], np.int32)
    need = sum(-(-int(n) // bs) for n in lens)
    pool = kvpool.Pool(kvpool.KvLayout(1, hkv, d, bs, fmt), need + 4, device="cuda")
    scales = kvpool.KvScales(pool, "head")
    scales.set(0, np.array([0.05, 0.08], np.float32), np.array([0.04, 0.06], np.float32))
    for view in (pool.k_view(0), pool.v_view(0)):
        arr = cp.asarray(view)
        codes = reference.quantize_fp8(rng.standard_normal(arr.shape) * 8, fmt)
        arr[...] = cp.asarray(codes).view(arr.dtype)
    full = shuffled_tables(rng, lens, bs, pool.num_blocks)
    kc, vc = _host_kv(pool)
    ks, vs = scales.layer_scales(0)
    sinks = _sinks(rng, hq)
    ip = qo_indptr(qo)
    for kind, q_rows, starts in (
        ("decode", len(lens), reference.key_start(lens - 1, window)),
        ("prefill", int(ip[-1]), reference.key_start(lens - qo, window)),
    ):
        wtab, fp = _window_tables(full, lens, bs, starts)
        for i, lo in enumerate(starts):  # NaN codes before the window (restored below)
            pos = np.arange(int(lo))
            for view in (pool.k_view(0), pool.v_view(0)):
                a = cp.asarray(view).view(cp.uint8)
                a[cp.asarray(full[i, pos // bs]), cp.asarray(pos % bs)] = 0x7F
        q_host = reference.from_float64(rng.standard_normal((q_rows, hq, d)), q_dtype)
        q = to_device(q_host, q_dtype)
        out = poisoned(q.shape, q_dtype)
        common = dict(scales=scales, window=window, first_page=cp.asarray(fp))
        if kind == "decode":
            plan = decode_plan(pool, cp.asarray(wtab), cp.asarray(lens), hq, **common)
            want = reference.paged_attention_decode(
                q_host,
                kc,
                vc,
                full,
                lens,
                fmt,
                q_dtype=q_dtype,
                kv_scales=(ks, vs),
                window=window,
                sinks=sinks,
            )
        else:
            plan = prefill_plan(pool, ip, cp.asarray(wtab), lens, hq, use_sinks=True, **common)
            want = reference.paged_attention_prefill(
                q_host,
                kc,
                vc,
                ip,
                full,
                lens,
                fmt,
                None,
                True,
                q_dtype,
                (ks, vs),
                window=window,
                sinks=sinks,
            )
        plan.run(q, 0, out=out, sinks=cp.asarray(sinks))
        label = f"fp8 {kind}[{fmt},{q_dtype}]"
        got = as_float64(out, q_dtype)
        assert np.isfinite(got).all(), f"{label}: NaN or unwritten outputs"
        ERRORS[label] = assert_attention_close(got, want, q_dtype, label)
        for view, host in ((pool.k_view(0), kc), (pool.v_view(0), vc)):
            cp.asarray(view)[...] = cp.asarray(host)
