"""The float64 prefill reference, its host-pool dispatch and the prefill plan, without a GPU."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from attention_inputs import fill_host_pool, qo_indptr, random_elems, shuffled_tables
from kvpool import reference
from kvpool.kernels import paged_attention_decode, paged_attention_prefill
from kvpool.kernels._prefill_work import PrefillWork, choose_rows, head_tile, plan_work

DTYPES = ["float16", "bfloat16"]


def _host_pool(rng, hkv, d, bs, dtype, num_blocks=96):
    layout = kvpool.KvLayout(2, hkv, d, bs, dtype)
    return fill_host_pool(kvpool.Pool(layout, num_blocks, device="host"), rng)


def _direct(q64, k_rows, v_rows, scale, causal):
    """Query by query, head by head: softmax over the keys each query may see."""
    t_len, hq, _ = q64.shape
    n, hkv = k_rows.shape[:2]
    out = np.zeros_like(q64)
    for t in range(t_len):
        seen = n - t_len + t + 1 if causal else n
        for h in range(hq):
            kh = k_rows[:seen, h // (hq // hkv)]
            s = kh @ q64[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v_rows[:seen, h // (hq // hkv)]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_matches_direct_attention(dtype, hq, hkv, causal):
    rng = np.random.default_rng([hq, hkv, int(causal), len(dtype)])
    d, bs = 64, 8
    pool = _host_pool(rng, hkv, d, bs, dtype)
    qo_lens = np.array([1, 7, 20, 3], dtype=np.int32)
    seq_lens = np.array([1, 30, 20, 41], dtype=np.int32)  # prefixes 0, 23, 0, 38
    tables = shuffled_tables(rng, seq_lens, bs, pool.num_blocks)
    indptr = qo_indptr(qo_lens)
    q = random_elems(rng, (int(indptr[-1]), hq, d), dtype)
    got = paged_attention_prefill(q, pool, 1, indptr, tables, seq_lens, causal=causal, scale=0.2)
    assert got.dtype == q.dtype and got.shape == q.shape
    q64 = reference.to_float64(q, dtype)
    k_all = reference.to_float64(pool.k_view(1), dtype)
    v_all = reference.to_float64(pool.v_view(1), dtype)
    exact = reference.paged_attention_prefill(
        q, pool.k_view(1), pool.v_view(1), indptr, tables, seq_lens, dtype, 0.2, causal
    )
    for i, n in enumerate(seq_lens):
        toks = [(tables[i, t // bs], t % bs) for t in range(n)]
        k_rows = np.stack([k_all[b, o] for b, o in toks])
        v_rows = np.stack([v_all[b, o] for b, o in toks])
        a, b = indptr[i], indptr[i + 1]
        want = _direct(q64[a:b], k_rows, v_rows, 0.2, causal)
        np.testing.assert_allclose(exact[a:b], want, rtol=1e-12, atol=1e-12)
        tol = 1e-2 if dtype == "bfloat16" else 2e-3
        np.testing.assert_allclose(reference.to_float64(got[a:b], dtype), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_of_one_query_is_decode(dtype):
    rng = np.random.default_rng(5)
    pool = _host_pool(rng, 2, 64, 16, dtype)
    seq_lens = np.array([1, 17, 64, 100], dtype=np.int32)
    tables = shuffled_tables(rng, seq_lens, 16, pool.num_blocks)
    q = random_elems(rng, (4, 8, 64), dtype)
    want = reference.paged_attention_decode(
        q, pool.k_view(0), pool.v_view(0), tables, seq_lens, dtype
    )
    got = reference.paged_attention_prefill(
        q, pool.k_view(0), pool.v_view(0), qo_indptr([1, 1, 1, 1]), tables, seq_lens, dtype
    )
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    host = paged_attention_prefill(q, pool, 0, qo_indptr([1, 1, 1, 1]), tables, seq_lens)
    assert np.array_equal(host, paged_attention_decode(q, pool, 0, tables, seq_lens))


def test_chunked_prefill_equals_one_call():
    """A prompt split over three calls (each chunk appended before its call) gives the rows of
    one whole-prompt call."""
    rng = np.random.default_rng(9)
    pool = _host_pool(rng, 1, 64, 8, "float16")
    n = 37
    tables = shuffled_tables(rng, [n], 8, pool.num_blocks)
    q = random_elems(rng, (n, 2, 64), "float16")
    whole = paged_attention_prefill(q, pool, 0, qo_indptr([n]), tables, np.array([n], np.int32))
    at = 0
    for chunk in (10, 16, 11):
        part = paged_attention_prefill(
            q[at : at + chunk],
            pool,
            0,
            qo_indptr([chunk]),
            tables,
            np.array([at + chunk], np.int32),
        )
        assert np.array_equal(part, whole[at : at + chunk])
        at += chunk


def test_empty_context_and_empty_batch():
    rng = np.random.default_rng(3)
    pool = _host_pool(rng, 1, 64, 8, "float16")
    tables = np.full((2, 2), -1, np.int32)
    q = np.zeros((0, 2, 64), np.float16)
    out = paged_attention_prefill(q, pool, 0, qo_indptr([0, 0]), tables, np.array([0, 0], np.int32))
    assert out.shape == (0, 2, 64)


def test_prefill_rejects_bad_arguments():
    rng = np.random.default_rng(4)
    pool = _host_pool(rng, 2, 64, 8, "float16")
    q = np.zeros((5, 4, 64), np.float16)
    tables = np.array([[1, 2, -1]], np.int32)
    lens = np.array([10], np.int32)
    ip = qo_indptr([5])
    paged_attention_prefill(q, pool, 0, ip, tables, lens)  # the good call
    err = kvpool.InvalidArgumentError
    with pytest.raises(err, match="query tokens but seq_len"):
        paged_attention_prefill(q, pool, 0, ip, tables, np.array([4], np.int32))
    with pytest.raises(err, match="start at 0"):
        paged_attention_prefill(q, pool, 0, np.array([1, 5], np.int32), tables, lens)
    with pytest.raises(err, match="qo_indptr ends"):
        paged_attention_prefill(q, pool, 0, qo_indptr([4]), tables, lens)
    with pytest.raises(err, match="qo_indptr has 3 entries"):
        paged_attention_prefill(q, pool, 0, np.array([0, 2, 5], np.int32), tables, lens)
    with pytest.raises(err, match="multiple"):
        paged_attention_prefill(np.zeros((5, 3, 64), np.float16), pool, 0, ip, tables, lens)
    with pytest.raises(err, match="outside the pool"):
        paged_attention_prefill(q, pool, 0, ip, np.array([[1, 99, -1]], np.int32), lens)
    with pytest.raises(err, match="more blocks"):
        paged_attention_prefill(q, pool, 0, ip, tables, np.array([25], np.int32))
    with pytest.raises(err, match="dtype"):
        paged_attention_prefill(q.astype(np.float32), pool, 0, ip, tables, lens)
    with pytest.raises(TypeError, match="causal must be a bool"):
        paged_attention_prefill(q, pool, 0, ip, tables, lens, causal=1)
    with pytest.raises(err, match="layer"):
        paged_attention_prefill(q, pool, 2, ip, tables, lens)
    with pytest.raises(TypeError, match="layer must be an integer"):
        paged_attention_prefill(q, pool, 0.0, ip, tables, lens)
    out = np.zeros((5, 4, 32), np.float16)
    with pytest.raises(err, match="out must be"):
        paged_attention_prefill(q, pool, 0, ip, tables, lens, out=out)


def _covered(plan: PrefillWork, qo_lens) -> list[tuple[int, int]]:
    toks = []
    for seq, qt0 in plan.work:
        toks += [(int(seq), t) for t in range(qt0, min(qt0 + plan.q_tile_tokens, qo_lens[seq]))]
    return sorted(toks)


@pytest.mark.parametrize("causal", [True, False])
def test_plan_covers_every_query_once_longest_first(causal):
    qo_lens = np.array([100, 1, 0, 37, 1], dtype=np.int64)
    seq_lens = np.array([100, 500, 5, 2000, 64], dtype=np.int64)
    plan = plan_work(qo_indptr(qo_lens), seq_lens, 32, 8, 4, 64, 64, 132, 2, causal=causal)
    assert plan.q_tile_tokens == 16 and plan.work.dtype == np.int32
    assert _covered(plan, qo_lens) == sorted(
        (i, t) for i, n in enumerate(qo_lens) for t in range(n)
    )
    prefix = seq_lens - qo_lens
    keys = [
        seq_lens[s] if not causal else prefix[s] + min(q0 + 16, qo_lens[s]) for s, q0 in plan.work
    ]
    assert keys == sorted(keys, reverse=True)


def test_plan_splits_few_long_tiles_and_not_many():
    few = plan_work(qo_indptr([4]), np.array([32768]), 32, 8, 4, 64, 64, 132, 2)
    assert few.num_items == 1 and few.num_splits > 1
    many = plan_work(qo_indptr([4096] * 8), np.array([4096] * 8), 32, 8, 4, 64, 64, 132, 2)
    assert many.num_splits == 1
    short = plan_work(qo_indptr([1]), np.array([100]), 32, 8, 4, 64, 64, 132, 2)
    assert short.num_splits == 1  # two KV tiles: nothing worth splitting
    forced = plan_work(qo_indptr([1]), np.array([100]), 32, 8, 4, 64, 64, 132, 2, num_splits=5)
    assert forced.num_splits == 2  # never more splits than KV tiles


def test_narrow_tiles_for_few_queries_per_sequence():
    # GQA-4: 64-row tiles hold 16 tokens, 16-row tiles 4.
    assert choose_rows(qo_indptr([4] * 64), 4, 64, 16) == 16  # speculative: 25% of 64 rows used
    assert choose_rows(qo_indptr([1] * 8), 1, 64, 16) == 16  # MHA decode
    assert choose_rows(qo_indptr([8] * 64), 4, 64, 16) == 16  # 32 of 64 rows: half padding
    assert choose_rows(qo_indptr([12] * 64), 4, 64, 16) == 64
    assert choose_rows(qo_indptr([4096, 1, 1]), 4, 64, 16) == 64  # a prompt beside decodes
    assert choose_rows(qo_indptr([]), 4, 64, 16) == 64
    assert head_tile(32, 16) == 16 and head_tile(12, 16) == 12 and head_tile(6, 4) == 3
