"""Paged prefill attention on a GPU against the float64 reference (marker `gpu`).

Fresh random inputs per case, shuffled block tables with unused (-1) columns, outputs poisoned
with NaN before each run and checked fully written. Every (query token, head) row is checked by
tests/attention_check.py (relative L2 error under the dtype's bound); a mutation case shows
that a one-key causal-mask slip or a wrong block fails it. Long contexts check a sample of
query rows (first, last, around tile and block edges, random). Set KVPOOL_ERROR_REPORT=path to
dump the errors.
"""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from attention_check import as_float64, assert_attention_close, table_with_wrong_block
from attention_inputs import qo_indptr, shuffled_tables
from gpu_fixtures import NAN_BITS, cp, cuda_pool, device_elems, error_report, poisoned
from kvpool import reference
from kvpool.kernels import (
    _tuning,
    append_kv,
    paged_attention_decode,
    paged_attention_prefill,
    prefill_plan,
    prefill_workspace_elems,
)

pytestmark = pytest.mark.gpu


DTYPES = ["float16", "bfloat16"]
ERRORS: dict[str, float] = {}

_error_report = error_report(ERRORS)


def _sample_rows(qo_len, limit=48, rng=None):
    """All rows of a short sequence; for a long one the first and last 8, rows around 64-token
    tile edges and a few random ones."""
    if qo_len <= limit:
        return np.arange(qo_len)
    rows = set(range(8)) | set(range(qo_len - 8, qo_len))
    for edge in (63, 64, 65, 127, 128, qo_len // 2):
        rows.add(min(edge, qo_len - 1))
    rows |= set((rng or np.random.default_rng(0)).integers(0, qo_len, 16).tolist())
    return np.array(sorted(rows))


def _expected(pool, layer, q_host, indptr, tables, lens, causal, scale, sample, shift=0):
    """float64 expected rows {seq: (row indices, [rows, Hq, D])}; `shift` moves every causal
    limit by that many keys (the mutation check)."""
    lay = pool.layout
    k_all = cp.asnumpy(cp.asarray(pool.k_view(layer)))
    v_all = cp.asnumpy(cp.asarray(pool.v_view(layer)))
    q64 = reference.to_float64(q_host, lay.dtype)
    scale = 1 / np.sqrt(lay.head_dim) if scale is None else scale
    hq = q64.shape[1]
    group = hq // lay.num_kv_heads
    res = {}
    for i, n in enumerate(lens):
        a, b = int(indptr[i]), int(indptr[i + 1])
        if b == a:
            continue
        rows = sample[i]
        k = reference.to_float64(reference.gather_kv(k_all, tables[i], int(n)), lay.dtype)
        v = reference.to_float64(reference.gather_kv(v_all, tables[i], int(n)), lay.dtype)
        want = np.empty((len(rows), hq, lay.head_dim))
        for kvh in range(lay.num_kv_heads):  # one KV head's group at a time: [R*g, L] scores
            heads = slice(kvh * group, (kvh + 1) * group)
            qs = q64[a + rows, heads].reshape(-1, lay.head_dim)
            s = (qs @ k[:, kvh].T) * scale
            if causal:
                seen = np.repeat(int(n) - (b - a) + rows + 1 + shift, group)
                s = np.where(np.arange(int(n))[None, :] < seen[:, None], s, -np.inf)
            with np.errstate(invalid="ignore"):  # a row with no key (mutation check only)
                s -= s.max(axis=1, keepdims=True)
                p = np.exp(s)
                p /= p.sum(axis=1, keepdims=True)
            want[:, heads] = (p @ v[:, kvh]).reshape(len(rows), group, lay.head_dim)
        res[i] = (rows, want)
    return res


def _rows(got, indptr, expected):
    """The kernel's rows and the expected ones, stacked in the same order."""
    got_rows = np.concatenate([got[int(indptr[i]) + rows] for i, (rows, _) in expected.items()])
    want_rows = np.concatenate([want for _, want in expected.values()])
    return got_rows, want_rows


def _run_and_check(
    pool, layer, q, qo_lens, tables, lens, label, *, causal=True, scale=None, rng=None, **kw
):
    lay = pool.layout
    indptr = qo_indptr(qo_lens)
    out = poisoned(q.shape, lay.dtype)
    plan = kw.pop("plan", None)
    if plan is not None:  # made for these lengths and tables by the caller
        res = plan.run(q, layer, out=out)
    else:
        res = paged_attention_prefill(
            q,
            pool,
            layer,
            cp.asarray(indptr),
            cp.asarray(tables),
            cp.asarray(np.asarray(lens, np.int32)),
            causal=causal,
            scale=scale,
            out=out,
            **kw,
        )
    assert res is out
    got = as_float64(out, lay.dtype)
    assert not np.isnan(got).any(), f"{label}: unwritten or NaN outputs"
    sample = [_sample_rows(int(n), rng=rng) for n in qo_lens]
    want = _expected(pool, layer, cp.asnumpy(q), indptr, tables, lens, causal, scale, sample)
    ERRORS[label] = assert_attention_close(*_rows(got, indptr, want), lay.dtype, label)
    return got


GROUPS = [(8, 8), (32, 8), (16, 2), (12, 2), (32, 1)]  # MHA, GQA 4, GQA 8, group 6, MQA 32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(("hq", "hkv"), GROUPS)
def test_prefill_mixed_batch_matches_reference(dtype, d, hq, hkv):
    """Fresh prompts, prompts on cached prefixes, decodes (qo_len 1) and a speculative row in
    one batch, lengths across tile and block edges; block size rotates over 8/16/32."""
    bs = (8, 16, 32)[(d // 64 + hq) % 3]
    rng = np.random.default_rng([d, bs, hq, hkv, len(dtype)])
    qo = np.array([1, 70, 5, 64, 1, 130, 4], dtype=np.int32)
    lens = np.array([1, 70, 300, 64 + 33, 700, 130, 513], dtype=np.int32)
    need = sum(-(-int(n) // bs) for n in lens)
    pool = cuda_pool(rng, hkv, d, bs, dtype, need + 40, 2)
    tables = shuffled_tables(rng, lens, bs, pool.num_blocks, extra=3)
    q = device_elems(rng, (int(qo.sum()), hq, d), dtype)
    _run_and_check(pool, 1, q, qo, tables, lens, f"mixed[{dtype},d{d},bs{bs},hq{hq},hkv{hkv}]")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (32, 1)])
def test_prefill_narrow_and_wide_tiles_agree(dtype, d, hq, hkv):
    """The same mixed batch through 16-row CTAs and 64-row CTAs (the plan picks one by
    padding; both are forced here)."""
    bs = 16
    rng = np.random.default_rng([d, hq, hkv, len(dtype), 3])
    qo = np.array([1, 40, 3, 17, 8], dtype=np.int32)
    lens = np.array([1, 300, 90, 17, 600], dtype=np.int32)
    pool = cuda_pool(rng, hkv, d, bs, dtype, sum(-(-int(n) // bs) for n in lens) + 8, 1)
    tables = shuffled_tables(rng, lens, bs, pool.num_blocks, extra=3)
    q = device_elems(rng, (int(qo.sum()), hq, d), dtype)
    for rows in (16, 64):
        with _tuning.override(prefill_rows_per_cta=rows):  # a test knob
            plan = prefill_plan(pool, qo_indptr(qo), cp.asarray(tables), lens, hq)
        assert plan.rows_per_cta == rows
        _run_and_check(
            pool, 0, q, qo, tables, lens, f"rows{rows}[{dtype},d{d},hq{hq},hkv{hkv}]", plan=plan
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [1, 8, 32, 256])
def test_prefill_not_causal_and_block_sizes(dtype, bs):
    rng = np.random.default_rng([bs, len(dtype), 2])
    d, hq, hkv = 128, 8, 2
    qo = np.array([33, 1, 100], dtype=np.int32)
    lens = np.array([33, 200, 180], dtype=np.int32)
    pool = cuda_pool(rng, hkv, d, bs, dtype, sum(-(-int(n) // bs) for n in lens) + 8, 2)
    tables = shuffled_tables(rng, lens, bs, pool.num_blocks, extra=3)
    q = device_elems(rng, (int(qo.sum()), hq, d), dtype)
    for causal in (False, True):
        _run_and_check(
            pool,
            0,
            q,
            qo,
            tables,
            lens,
            f"bs{bs}[{dtype},causal={causal}]",
            causal=causal,
            scale=0.07,
        )


# (new tokens, cached prefix): 1 to 20k-token prompts, prefixes from 0 to 20k tokens.
LONG = [(1, 0), (1, 20000), (2000, 0), (20000, 0), (512, 20000), (17, 5000), (4096, 4096)]


@pytest.mark.parametrize(("qo_len", "prefix"), LONG)
def test_prefill_long_prompts_and_prefixes(qo_len, prefix):
    dtype = "bfloat16" if (qo_len + prefix) % 2 else "float16"
    rng = np.random.default_rng([qo_len, prefix])
    d, bs, hq, hkv = 128, 16, 32, 8
    n = qo_len + prefix
    pool = cuda_pool(rng, hkv, d, bs, dtype, -(-n // bs) + 8, 1)
    tables = shuffled_tables(rng, [n], bs, pool.num_blocks, extra=3)
    q = device_elems(rng, (qo_len, hq, d), dtype)
    _run_and_check(
        pool,
        0,
        q,
        np.array([qo_len]),
        tables,
        [n],
        f"long[{dtype},q{qo_len},prefix{prefix}]",
        rng=rng,
    )


def test_chunked_prefill_with_append_kv():
    """A 3000-token prompt in four chunks, each appended with append_kv and then attended; the
    outputs match one whole-prompt call and the reference."""
    rng = np.random.default_rng(40)
    d, bs, hq, hkv, dtype = 128, 16, 16, 4, "float16"
    n = 3000
    pool = cuda_pool(rng, hkv, d, bs, dtype, -(-n // bs) + 16, 2)
    tables = shuffled_tables(rng, [n], bs, pool.num_blocks, extra=3)
    slots = tables[0, np.arange(n) // bs].astype(np.int64) * bs + np.arange(n) % bs
    k = device_elems(rng, (n, hkv, d), dtype)
    v = device_elems(rng, (n, hkv, d), dtype)
    q = device_elems(rng, (n, hq, d), dtype)
    bt = cp.asarray(tables)
    at, chunks = 0, []
    for size in (1000, 999, 1, 1000):
        append_kv(k[at : at + size], v[at : at + size], pool, 0, cp.asarray(slots[at : at + size]))
        out = poisoned((size, hq, d), dtype)
        paged_attention_prefill(
            q[at : at + size],
            pool,
            0,
            cp.asarray(qo_indptr([size])),
            bt,
            cp.asarray(np.array([at + size], np.int32)),
            out=out,
        )
        chunks.append(as_float64(out, dtype))
        at += size
    chunked = np.concatenate(chunks)
    assert not np.isnan(chunked).any()
    whole = _run_and_check(pool, 0, q, np.array([n]), tables, [n], "chunked_whole", rng=rng)
    diff = float(np.abs(chunked - whole).max())
    ERRORS["chunked_vs_whole_max_abs"] = diff
    assert diff < 2e-3, f"chunked prefill differs from one call by {diff}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_speculative_verification_on_long_contexts(dtype):
    """2-8 draft tokens per sequence over 3k-9k contexts: few query tiles, so the plan splits
    the keys; also forced split counts and a caller workspace."""
    rng = np.random.default_rng([50, len(dtype)])
    d, bs, hq, hkv = 128, 16, 32, 8
    qo = rng.integers(2, 9, 12).astype(np.int32)
    lens = rng.integers(3000, 9000, 12).astype(np.int32)
    pool = cuda_pool(rng, hkv, d, bs, dtype, sum(-(-int(n) // bs) for n in lens) + 8, 1)
    tables = shuffled_tables(rng, lens, bs, pool.num_blocks, extra=3)
    q = device_elems(rng, (int(qo.sum()), hq, d), dtype)
    bt = cp.asarray(tables)
    plan = prefill_plan(pool, qo_indptr(qo), bt, lens, hq)
    if not plan.variant.sm90:  # the Hopper kernel forced: 96 CTAs of 128 rows, one per SM
        assert plan.split, "few query tiles over long contexts should split the keys"
        assert plan.rows_per_cta == 16, "<= 8 draft tokens x GQA-4: 64-row tiles would be padding"
    _run_and_check(pool, 0, q, qo, tables, lens, f"spec[{dtype},auto{plan.num_splits}]", plan=plan)
    for splits in (1, 3, 64):
        sized = prefill_plan(pool, qo_indptr(qo), bt, lens, hq, num_splits=splits)
        ws = cp.empty(max(prefill_workspace_elems(sized, d), 1), cp.float32)
        forced = prefill_plan(pool, qo_indptr(qo), bt, lens, hq, num_splits=splits, workspace=ws)
        assert forced.workspace_elems == sized.workspace_elems
        _run_and_check(pool, 0, q, qo, tables, lens, f"spec[{dtype},split{splits}]", plan=forced)


def test_a_bad_caller_workspace_is_refused_before_a_launch():
    # A split plan with a workspace too small, of another type or not 1-d: refused naming the
    # workspace and what it must be, and the output is left untouched (still all NaN).
    rng = np.random.default_rng(70)
    d, bs, hq, hkv = 128, 16, 32, 8
    qo, lens = np.array([4, 4], np.int32), np.array([3000, 4000], np.int32)
    pool = cuda_pool(rng, hkv, d, bs, "float16", sum(-(-int(n) // bs) for n in lens) + 8, 1)
    tables = shuffled_tables(rng, lens, bs, pool.num_blocks, extra=3)
    q = device_elems(rng, (int(qo.sum()), hq, d), "float16")
    bt = cp.asarray(tables)
    plan = prefill_plan(pool, qo_indptr(qo), bt, lens, hq, num_splits=3)
    assert plan.split
    need = prefill_workspace_elems(plan, d)
    out = poisoned(q.shape, "float16")
    args = (q, pool, 0, cp.asarray(qo_indptr(qo)), bt, cp.asarray(lens))
    for ws in (
        cp.empty(need - 1, cp.float32),
        cp.empty(need, cp.float16),
        cp.empty((need, 1), cp.float32),
    ):
        with pytest.raises(
            kvpool.InvalidArgumentError,
            match=f"workspace must be a contiguous 1-d float32 array of >= {need}",
        ):
            paged_attention_prefill(*args, num_splits=3, out=out, workspace=ws)
        with pytest.raises(kvpool.InvalidArgumentError, match="workspace must be"):
            prefill_plan(pool, qo_indptr(qo), bt, lens, hq, num_splits=3, workspace=ws)
    assert (out.view(cp.uint16) == NAN_BITS["float16"]).all()
    paged_attention_prefill(*args, num_splits=3, out=out, workspace=cp.empty(need, cp.float32))
    assert not cp.isnan(out).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (8, 8), (32, 1)])
def test_one_query_agrees_with_decode(dtype, hq, hkv):
    rng = np.random.default_rng([60, hq, hkv, len(dtype)])
    d, bs = 128, 16
    lens = np.array([1, 15, 16, 17, 1000, 5000], dtype=np.int32)
    pool = cuda_pool(rng, hkv, d, bs, dtype, sum(-(-int(n) // bs) for n in lens) + 8, 1)
    tables = shuffled_tables(rng, lens, bs, pool.num_blocks, extra=3)
    q = device_elems(rng, (len(lens), hq, d), dtype)
    got = _run_and_check(
        pool,
        0,
        q,
        np.ones(len(lens), np.int32),
        tables,
        lens,
        f"as_decode[{dtype},hq{hq},hkv{hkv}]",
    )
    dec = paged_attention_decode(q, pool, 0, cp.asarray(tables), cp.asarray(lens))
    diff = float(np.abs(got - as_float64(dec, dtype)).max())
    ERRORS[f"prefill_vs_decode[{dtype},hq{hq},hkv{hkv}]"] = diff
    assert diff < (2e-3 if dtype == "float16" else 1.6e-2)


def test_the_check_fails_on_a_one_key_mask_slip_or_a_wrong_block():
    """The per-row check flags an expectation whose causal limit is one key off, and one made
    through a table with one block swapped."""
    rng = np.random.default_rng(70)
    d, bs, hq, hkv, dtype = 128, 16, 8, 2, "float16"
    qo = np.array([40, 300], dtype=np.int32)
    lens = np.array([40, 700], dtype=np.int32)
    pool = cuda_pool(rng, hkv, d, bs, dtype, 64, 1)
    tables = shuffled_tables(rng, lens, bs, pool.num_blocks, extra=3)
    q = device_elems(rng, (int(qo.sum()), hq, d), dtype)
    got = _run_and_check(pool, 0, q, qo, tables, lens, "mutation_base")
    indptr = qo_indptr(qo)
    sample = [_sample_rows(int(n)) for n in qo]
    q_host = cp.asnumpy(q)
    wrongs = [
        _expected(pool, 0, q_host, indptr, tables, lens, True, None, sample, shift)
        for shift in (1, -1)
    ]
    wrong_table = table_with_wrong_block(tables, lens, bs, pool.num_blocks, 1, 20)
    wrongs.append(_expected(pool, 0, q_host, indptr, wrong_table, lens, True, None, sample))
    for wrong in wrongs:
        wrong = {i: (r, np.nan_to_num(w)) for i, (r, w) in wrong.items()}  # rows seeing no key
        with np.errstate(over="ignore"), pytest.raises(AssertionError, match="exceed"):
            assert_attention_close(*_rows(got, indptr, wrong), dtype, "mutated")


def test_prefill_takes_synced_tables_and_torch_and_graph_capture():
    """BlockTables.sync arrays (named producer stream), torch tensors on a torch stream, and a
    CUDA-graph capture replayed with a planned call and a caller workspace."""
    rng = np.random.default_rng(80)
    d, bs, hq, hkv, dtype = 128, 16, 8, 2, "float16"
    pool = cuda_pool(rng, hkv, d, bs, dtype, 128, 1)
    tables = kvpool.BlockTables(pool, 4, 64)
    lens = [600, 37, 5]
    for rid, n in enumerate(lens):
        tables.add(rid, n)
    bt, sl = tables.sync()
    ids = tables.request_ids()
    host_bt = np.asarray(tables.block_table(ids), np.int32)
    host_sl = np.asarray(tables.seq_lens(ids), np.int32)
    qo = np.minimum(host_sl, [3, 37, 1]).astype(np.int32)  # rows in request_ids order
    q = device_elems(rng, (int(qo.sum()), hq, d), dtype)
    # From host lengths (the plan uploads them) and the synced table; then from the synced
    # device lengths themselves (read back), through the one-call form with plan=.
    plan = prefill_plan(pool, qo_indptr(qo), bt, host_sl, hq, num_splits=2)
    out = poisoned(q.shape, dtype)
    plan.run(q, 0, out=out)
    cp.cuda.runtime.deviceSynchronize()
    first = as_float64(out, dtype)
    ip_synced = cp.asarray(qo_indptr(qo))
    from_device = prefill_plan(pool, ip_synced, bt, sl, hq, num_splits=2)
    out = poisoned(q.shape, dtype)
    paged_attention_prefill(q, pool, 0, ip_synced, bt, sl, out=out, plan=from_device)
    cp.cuda.runtime.deviceSynchronize()
    assert np.array_equal(first, as_float64(out, dtype))
    got = as_float64(out, dtype)
    want = _expected(
        pool,
        0,
        cp.asnumpy(q),
        qo_indptr(qo),
        host_bt,
        host_sl,
        True,
        None,
        [np.arange(n) for n in qo],
    )
    ERRORS["synced_tables"] = assert_attention_close(
        *_rows(got, qo_indptr(qo), want), dtype, "synced_tables"
    )

    # CUDA graph: capture a planned call with a caller workspace, poison, replay.
    s = cp.cuda.Stream(non_blocking=True)
    ws = cp.empty(prefill_workspace_elems(plan, d), cp.float32)
    ip_dev, bt_dev, sl_dev = (cp.asarray(qo_indptr(qo)), cp.asarray(host_bt), cp.asarray(host_sl))
    graph_plan = prefill_plan(
        pool, qo_indptr(qo), bt_dev, host_sl, hq, num_splits=2, workspace=ws, stream=s
    )
    with s:
        graph_plan.run(q, 0, out=out)  # warm: compile, prepare the launch block
        s.synchronize()
        s.begin_capture()
        graph_plan.run(q, 0, out=out)
        graph = s.end_capture()
    out.view(cp.uint16)[...] = NAN_BITS[dtype]
    cp.cuda.runtime.deviceSynchronize()
    graph.launch(s)
    s.synchronize()
    assert_attention_close(
        *_rows(as_float64(out, dtype), qo_indptr(qo), want), dtype, "graph replay"
    )

    torch = pytest.importorskip("torch")
    ts = torch.cuda.Stream()
    tq = torch.as_tensor(q, device="cuda")
    with torch.cuda.stream(ts):
        res = paged_attention_prefill(
            tq,
            pool,
            0,
            torch.as_tensor(ip_dev, device="cuda"),
            torch.as_tensor(bt_dev, device="cuda"),
            torch.as_tensor(sl_dev, device="cuda"),
            stream=ts,
        )
    ts.synchronize()
    assert_attention_close(
        *_rows(as_float64(cp.asarray(res), dtype), qo_indptr(qo), want), dtype, "torch"
    )


def test_prefill_rejects_bad_arguments_before_any_launch():
    rng = np.random.default_rng(90)
    d, bs, hq, hkv, dtype = 64, 16, 4, 2, "float16"
    pool = cuda_pool(rng, hkv, d, bs, dtype, 16, 1)
    other = cuda_pool(rng, hkv, d, bs, dtype, 16, 1)
    q = device_elems(rng, (5, hq, d), dtype)
    ip = cp.asarray(qo_indptr([5]))
    bt = cp.asarray(np.array([[0, 1, -1]], np.int32))
    sl = cp.asarray(np.array([20], np.int32))
    out = poisoned(q.shape, dtype)
    err = kvpool.InvalidArgumentError
    cases = [
        (dict(seq_lens=cp.asarray(np.array([4], np.int32))), "query tokens but seq_len"),
        (dict(seq_lens=cp.asarray(np.array([60], np.int32))), "exceeds"),
        (dict(qo_indptr=cp.asarray(np.array([0, 5], np.int64))), "qo_indptr"),
        (dict(qo_indptr=cp.asarray(np.array([0, 2, 5], np.int32))), "qo_indptr"),
        (dict(block_tables=cp.asarray(np.array([[0, 1]], np.int64))), "block_tables"),
        (dict(q=cp.zeros((5, hq, d), cp.float32)), "q"),
        (dict(out=cp.zeros((5, hq, d), cp.float32)), "out"),
        (dict(out=cp.zeros((4, hq, d), cp.float16)), "out"),
        (dict(plan=prefill_plan(pool, qo_indptr([4]), bt, np.array([20]), hq)), "plan"),
        (
            dict(plan=prefill_plan(pool, qo_indptr([5]), bt, np.array([20]), hq, causal=False)),
            "plan",
        ),
        (dict(plan=prefill_plan(other, qo_indptr([5]), bt, np.array([20]), hq)), "another pool"),
    ]
    with pytest.raises(TypeError, match="causal"):  # a wrong type (the binding's convention)
        paged_attention_prefill(q, pool, 0, ip, bt, sl, causal=1, out=out)
    for change, match in cases:
        args = dict(q=q, qo_indptr=ip, block_tables=bt, seq_lens=sl, out=out)
        args.update(change)
        with pytest.raises(err, match=match):
            paged_attention_prefill(
                args.pop("q"),
                pool,
                0,
                args.pop("qo_indptr"),
                args.pop("block_tables"),
                args.pop("seq_lens"),
                **args,
            )
    with pytest.raises(TypeError, match="PrefillPlan"):
        paged_attention_prefill(q, pool, 0, ip, bt, sl, out=out, plan="plan")
    tables = kvpool.BlockTables(other, 2, 4)
    tables.add(0, 20)
    obt, osl = tables.sync()
    with pytest.raises(err, match="another pool"):
        paged_attention_prefill(q, pool, 0, ip, obt, osl, out=out)
    with pytest.raises(err, match="another pool"):
        paged_attention_prefill(q, pool, 0, ip, bt, osl, out=out)
    cp.cuda.runtime.deviceSynchronize()
    assert (out.view(cp.uint16) == NAN_BITS[dtype]).all(), "a kernel ran"
    bad_d = kvpool.Pool(kvpool.KvLayout(1, 1, 96, 16, dtype), 4, device="cuda")
    with pytest.raises(err, match="no prefill kernel"):
        paged_attention_prefill(
            cp.zeros((1, 1, 96), cp.float16),
            bad_d,
            0,
            cp.asarray(qo_indptr([1])),
            cp.zeros((1, 1), cp.int32),
            cp.ones(1, cp.int32),
        )
    # An empty batch is a no-op.
    e = paged_attention_prefill(
        cp.empty((0, hq, d), cp.float16),
        pool,
        0,
        cp.zeros(1, cp.int32),
        cp.empty((0, 2), cp.int32),
        cp.empty((0,), cp.int32),
    )
    assert e.shape == (0, hq, d)
