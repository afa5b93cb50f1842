"""Sliding-window, chunked local attention and attention sinks on the host (CI, no GPU): the
float64 reference against a brute-force masked softmax written from the definitions, the host
plans over window-relative tables, the argument checks, the prefill work plan's key counts, and
the kernels' signatures against the parameter blocks the plans fill.

Conventions (kvpool.kernels._window): window w, the query at position p sees (p - w, p] (as
transformers' sliding_window for gpt-oss and Gemma 3: kv_idx > q_idx - sliding_window); chunk c,
[p // c * c, p] (Llama 4); a sink s_h joins head h's denominator only.
"""

from __future__ import annotations

import re
from pathlib import Path

import kvpool
import numpy as np
import pytest
from attention_inputs import fill_host_pool, qo_indptr
from kvpool import reference
from kvpool.kernels import _build, decode_plan, prefill_plan
from kvpool.kernels._decode_args import TC_ONLY, DecodeArgs, DecodeFp8Args
from kvpool.kernels._prefill_args import SM80_ONLY, SM90_ONLY, PrefillArgs, PrefillMergeArgs
from kvpool.kernels._prefill_work import plan_work
from kvpool.kernels._window import check_host_window_rows

CUDA = Path(__file__).resolve().parent.parent / "cuda"


def brute_force(q, k, v, positions, scale, window=None, chunk=None, sinks=None):
    """q [T, Hq, D] at `positions`, k/v [L, Hkv, D] at positions 0..L-1: every (query, key)
    pair decided by the definitions, one at a time."""
    t_len, hq, _ = q.shape
    group = hq // k.shape[1]
    out = np.zeros(q.shape)
    for t in range(t_len):
        p = int(positions[t])
        for h in range(hq):
            keys = []
            for j in range(k.shape[0]):
                if j > p:
                    continue
                if window is not None and not j > p - window:  # transformers' overlay
                    continue
                if chunk is not None and j // chunk != p // chunk:
                    continue
                keys.append(j)
            logits = np.array([q[t, h] @ k[j, h // group] * scale for j in keys])
            extra = [] if sinks is None else [float(sinks[h])]
            m = max([*logits.tolist(), *extra]) if keys or extra else 0.0
            w = np.exp(logits - m) if keys else np.zeros(0)
            den = w.sum() + sum(np.exp(e - m) for e in extra)
            if keys:
                out[t, h] = (w[:, None] * v[keys, h // group]).sum(0) / den
    return out


CASES = [
    dict(window=None, chunk=None, sinks=False),
    dict(window=1, chunk=None, sinks=False),
    dict(window=5, chunk=None, sinks=False),
    dict(window=12, chunk=None, sinks=True),
    dict(window=100, chunk=None, sinks=False),  # longer than the sequence
    dict(window=None, chunk=4, sinks=False),
    dict(window=None, chunk=7, sinks=True),
    dict(window=None, chunk=None, sinks=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c))
def test_reference_prefill_matches_the_masked_softmax_by_definition(case):
    rng = np.random.default_rng(1)
    n, t_len, hq, hkv, d = 23, 9, 4, 2, 8
    q = rng.standard_normal((t_len, hq, d))
    k = rng.standard_normal((n, hkv, d))
    v = rng.standard_normal((n, hkv, d))
    sinks = rng.standard_normal(hq) * 2 if case["sinks"] else None
    w, c = case["window"], case["chunk"]
    want = brute_force(q, k, v, np.arange(n - t_len, n), 0.3, w, c, sinks)
    got = reference.attention_prefill(q, k, v, 0.3, True, window=w, chunk=c, sinks=sinks)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # The same with the keys before the first query's window left out (what a window table
    # holds), and as decode for the last query.
    lo = int(reference.key_start(n - t_len, w, c))
    got2 = reference.attention_prefill(
        q, k[lo:], v[lo:], 0.3, True, window=w, chunk=c, sinks=sinks, k_start=lo
    )
    np.testing.assert_allclose(got2, want, rtol=1e-12, atol=1e-12)
    lo_last = int(reference.key_start(n - 1, w, c))
    dec = reference.attention_decode(q[-1], k[lo_last:], v[lo_last:], 0.3, sinks=sinks)
    np.testing.assert_allclose(dec, want[-1], rtol=1e-12, atol=1e-12)


def test_key_start_conventions():
    assert reference.key_start(127, window=128) == 0
    assert reference.key_start(128, window=128) == 1  # (p - w, p]: 128 keys with its own
    assert reference.key_start(8191, chunk=8192) == 0
    assert reference.key_start(8192, chunk=8192) == 8192
    assert reference.key_start(5) == 0
    with pytest.raises(ValueError, match="not both"):
        reference.key_start(5, window=2, chunk=2)


def test_a_sink_lowers_every_weight_and_a_huge_one_silences_the_head():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4), (6, 1, 4), (6, 1, 4)))
    plain = reference.attention_decode(q, k, v, 0.5)
    quiet = reference.attention_decode(q, k, v, 0.5, sinks=np.array([-80.0, 80.0]))
    np.testing.assert_allclose(quiet[0], plain[0], rtol=1e-12)
    assert np.abs(quiet[1]).max() < 1e-30


def window_tables(full: np.ndarray, lens, bs: int, starts) -> tuple[np.ndarray, np.ndarray]:
    """Window-relative tables from full ones: row i keeps the pages from starts[i]'s on, and
    every entry before them is gone (so a read of one would fail)."""
    fp = np.array([int(s) // bs for s in starts], np.int32)
    width = max(-(-int(n) // bs) - int(f) for n, f in zip(lens, fp, strict=True)) + 1
    out = np.full((len(lens), width), -1, np.int32)
    for i, (n, f) in enumerate(zip(lens, fp, strict=True)):
        pages = full[i, f : -(-int(n) // bs)]
        out[i, : len(pages)] = pages
    return out, fp


def host_pool(bs=4, hkv=2, d=16, blocks=96):
    pool = kvpool.Pool(kvpool.KvLayout(1, hkv, d, bs, "float16"), blocks, device="host")
    return fill_host_pool(pool, np.random.default_rng(3))


@pytest.mark.parametrize(("window", "chunk"), [(6, None), (9, None), (None, 8), (None, 5)])
def test_host_decode_over_window_tables_matches_the_full_tables(window, chunk):
    pool = host_pool()
    bs = pool.layout.block_size
    lens = np.array([37, 3, 20, 64], np.int32)
    rng = np.random.default_rng(4)
    full = np.arange(4 * 16, dtype=np.int32).reshape(4, 16)[:, rng.permutation(16)]
    q = rng.standard_normal((4, 4, 16)).astype(np.float16)
    sinks = rng.standard_normal(4).astype(np.float32)
    want = decode_plan(pool, full, lens, 4, window=window, chunk=chunk).run(q, 0, sinks=sinks)
    starts = reference.key_start(lens - 1, window, chunk)
    tables, fp = window_tables(full, lens, bs, starts)
    plan = decode_plan(pool, tables, lens, 4, window=window, chunk=chunk, first_page=fp)
    np.testing.assert_array_equal(plan.run(q, 0, sinks=sinks), want)
    # And what it computes is the definition's.
    k = reference.to_float64(pool.k_view(0), "float16")
    v = reference.to_float64(pool.v_view(0), "float16")
    for i, n in enumerate(lens):
        kk = reference.gather_kv(k, full[i], int(n))
        vv = reference.gather_kv(v, full[i], int(n))
        ref = brute_force(
            q[i : i + 1].astype(np.float64),
            kk,
            vv,
            [n - 1],
            16**-0.5,
            window,
            chunk,
            sinks.astype(np.float64),
        )
        np.testing.assert_allclose(want[i].astype(np.float64), ref[0], rtol=2e-3, atol=2e-3)
    # A window table whose first page is one too late for the window: refused.
    bad = fp.copy()
    bad[0] += 1
    with pytest.raises(kvpool.InvalidArgumentError, match="sequence 0 reads pages"):
        decode_plan(pool, tables, lens, 4, window=window, chunk=chunk, first_page=bad)


@pytest.mark.parametrize(("window", "chunk"), [(6, None), (11, None), (None, 8), (None, 6)])
def test_host_prefill_over_window_tables_matches_the_full_tables(window, chunk):
    pool = host_pool()
    bs = pool.layout.block_size
    lens = np.array([37, 5, 20, 64], np.int32)
    qo = np.array([9, 5, 1, 17])
    ip = qo_indptr(qo)
    rng = np.random.default_rng(5)
    full = np.arange(4 * 16, dtype=np.int32).reshape(4, 16)[:, rng.permutation(16)]
    q = rng.standard_normal((int(ip[-1]), 4, 16)).astype(np.float16)
    sinks = rng.standard_normal(4).astype(np.float32)
    kw = dict(window=window, chunk=chunk, use_sinks=True)
    want = prefill_plan(pool, ip, full, lens, 4, **kw).run(q, 0, sinks=sinks)
    starts = reference.key_start(lens - qo, window, chunk)
    tables, fp = window_tables(full, lens, bs, starts)
    got = prefill_plan(pool, ip, tables, lens, 4, first_page=fp, **kw).run(q, 0, sinks=sinks)
    np.testing.assert_array_equal(got, want)
    # qo_len 1 == decode.
    one = decode_plan(pool, full, lens, 4, window=window, chunk=chunk).run(
        q[ip[1:] - 1], 0, sinks=sinks
    )
    np.testing.assert_array_equal(want[ip[1:] - 1], one)


def test_window_arguments_are_checked():
    pool = host_pool()
    lens = np.array([5], np.int32)
    tables = np.arange(4, dtype=np.int32)[None]
    ip = qo_indptr([2])
    with pytest.raises(kvpool.InvalidArgumentError, match="not both"):
        decode_plan(pool, tables, lens, 4, window=3, chunk=3)
    with pytest.raises(kvpool.InvalidArgumentError, match="window must be in 1"):
        decode_plan(pool, tables, lens, 4, window=0)
    with pytest.raises(TypeError, match="chunk must be an integer"):
        decode_plan(pool, tables, lens, 4, chunk=2.0)
    with pytest.raises(kvpool.InvalidArgumentError, match="needs causal=True"):
        prefill_plan(pool, ip, tables, lens, 4, causal=False, window=2)
    with pytest.raises(kvpool.InvalidArgumentError, match="first_page must be an integer"):
        decode_plan(pool, tables, lens, 4, first_page=np.zeros(2, np.int32))
    q = np.zeros((1, 4, 16), np.float16)
    plan = decode_plan(pool, tables, lens, 4, window=3)
    with pytest.raises(kvpool.InvalidArgumentError, match="sinks must be a float32 \\[4\\]"):
        plan.run(q, 0, sinks=np.zeros(4, np.float64))
    pplan = prefill_plan(pool, ip, tables, lens, 4, window=3)
    with pytest.raises(kvpool.InvalidArgumentError, match="without use_sinks=True"):
        pplan.run(np.zeros((2, 4, 16), np.float16), 0, sinks=np.zeros(4, np.float32))


def test_prefill_work_counts_only_the_window_keys():
    lens, qo = np.array([65536, 4096]), np.array([1, 64])
    full = plan_work(qo_indptr(qo), lens, 8, 8, 1, 64, 64, 132, 1)
    win = plan_work(qo_indptr(qo), lens, 8, 8, 1, 64, 64, 132, 1, window=128)
    assert full.num_splits > 1  # the long context is split ...
    assert win.num_splits == 1  # ... a 128-token window needs no split
    # The work order follows the window's keys: both tiles see about the same.
    assert sorted(win.work[:, 0].tolist()) == [0, 1]


def _kernel_params(source: str, kernel: str) -> list[str]:
    """The parameter names of `kernel` in a .cu (every #if branch's)."""
    text = (CUDA / source).read_text()
    m = re.search(rf"{kernel}\((.*?)\)\s*{{", text, re.S)
    assert m, kernel
    body = re.sub(r"//[^\n]*", "", m.group(1))
    body = re.sub(r"#\w+[^\n]*", "", body)
    return [re.findall(r"(\w+)\s*$", p.strip())[0] for p in body.split(",") if p.strip()]


def test_kernel_signatures_match_the_parameter_blocks():
    tc = _kernel_params("paged_decode_tc.cu", "paged_decode_tc")
    fp8_tail = ["k_scale", "v_scale", "scale_head_stride"]
    assert [f[0] for f in DecodeFp8Args._fields_] == tc
    core = _kernel_params("paged_decode.cu", "paged_decode")
    assert [f[0] for f in DecodeArgs._fields_ if f[0] not in TC_ONLY] == core
    pre = _kernel_params("paged_prefill.cu", "paged_prefill")
    assert [f[0] for f in PrefillArgs._fields_ if f[0] not in SM90_ONLY] + fp8_tail == pre
    sm90 = _kernel_params("paged_prefill_sm90.cu", "paged_prefill_sm90")
    assert [f[0] for f in PrefillArgs._fields_ if f[0] not in SM80_ONLY] == sm90
    merge = _kernel_params("paged_prefill.cu", "merge_prefill_splits")
    assert [f[0] for f in PrefillMergeArgs._fields_] == merge


def test_window_decode_modules_are_their_own_and_in_the_ci_list():
    labels = [_build._label(v) for v in _build.decode_variants()]
    assert "paged_decode_tc[float16,dp64,nh2,win]" in labels
    assert "paged_decode_tc[bfloat16,dp256,nh1,win]" in labels
    win = _build.window_tc_variants()
    assert all("-DWINDOW=1" in v.options() for v in win)
    assert all("-DWINDOW=1" not in v.options() for v in _build.tc_variants())


def test_forcing_the_sm90_prefill_with_a_window_or_sinks_is_refused():
    from kvpool.kernels import _tuning

    pool = host_pool()
    lens, tables, ip = np.array([5], np.int32), np.arange(4, dtype=np.int32)[None], qo_indptr([2])
    with _tuning.override(prefill_kernel="sm90"):
        for kw in (dict(window=3), dict(chunk=4), dict(use_sinks=True)):
            with pytest.raises(kvpool.InvalidArgumentError, match="'sm80' kernel"):
                prefill_plan(pool, ip, tables, lens, 4, **kw)


@pytest.mark.parametrize("kind", ["window", "chunk"])
def test_hybrid_window_tables_are_what_the_kernels_take(kind):
    """HybridTables.table(id, group) of a window (or chunked) group: (first_page, page_ids,
    num_tokens), the page ids starting at page first_page of the sequence. After a prefill or
    decode step of queries from position q0 on, its first page is exactly the page of
    key_start(q0) (the kernels' window start of the step's first query), and the row holds every
    page up to the last token: the kernels' `first_page` and table row, as they are."""
    from kvpool import HybridTables, KvGroup, ModelKvSpec, Pool

    extent = 24
    local = (
        KvGroup.sliding_window([0], extent, 1, 64)
        if kind == "window"
        else KvGroup.chunked_local([0], extent, 1, 64)
    )
    spec = ModelKvSpec([local, KvGroup.full([1], 1, 64)])
    pool = Pool(kvpool.KvLayout(1, 1, spec.page_bytes // 4, 1, "float16"), 256, device="host")
    tables = HybridTables(pool, spec)
    bs = spec.block_size(0)
    kw = {kind: extent}
    tables.add(7, 30)  # a prompt: queries 0 .. 29
    steps = []
    for count in (0, 1, 1, 17, 1, 40, 1, 1, 3):  # the prompt, then decodes and prefill chunks
        q0 = tables.num_tokens(7) if count else 0
        if count:
            tables.append_tokens(7, count)
        n = q0 + count if count else 30
        first, ids, num_tokens = tables.table(7, 0)
        assert num_tokens == n
        assert first == int(reference.key_start(q0, **kw)) // bs, (q0, n, first)
        assert len(ids) == -(-n // bs) - first
        check_host_window_rows(
            ids[None].astype(np.int64),
            np.array([n]),
            np.array([first]),
            reference.key_start(np.array([q0]), **kw),
            bs,
            pool.num_blocks,
        )
        steps.append(first)
    assert steps[-1] > 0  # pages before the window were let go
    full_first, full_ids, _ = tables.table(7, 1)
    assert full_first == 0 and len(full_ids) == -(-n // spec.block_size(1))
