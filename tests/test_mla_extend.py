"""MLA extend on the CPU (CI): the float64 extend reference against a brute-force causal formula
(and, at qo_len 1, against the decode reference), the kernel's tiling emulated
(tools/mla_extend_emulator.py: row tiles, causal key bounds, splits, merge) against the
reference with mutations (the causal bound one token off, a wrong latent page) that must fail,
the host extend plan over the spec's page layout, the kernel signatures against the parameter
blocks, and the argument checks, each a clear error before anything runs."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import kvpool
import numpy as np
import pytest
from attention_inputs import qo_indptr, random_elems
from kvpool import HybridTables, reference
from kvpool.kernels import mla_decode_plan, mla_extend_plan, mla_page_tables
from kvpool.kernels._decode_split import split_kv
from kvpool.kernels._mla import MLA_HEAD_TILES, default_head_tile
from kvpool.kernels._mla_args import MlaArgs, MlaMergeArgs
from test_mla import SCALE, host_setup, mla_spec
from test_window_reference import _kernel_params

_PATH = Path(__file__).resolve().parents[1] / "tools" / "mla_extend_emulator.py"
_spec = importlib.util.spec_from_file_location("mla_extend_emulator", _PATH)
emulator = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["mla_extend_emulator"] = emulator
_spec.loader.exec_module(emulator)  # type: ignore[union-attr]

# Ragged: a decode row, a chunk crossing pages (17 new on 65), a whole prefill (64 on 64), a
# long chunk on a prefix (65 new on 130), a speculative-verify row (3 on 40).
LENS = [1, 40, 64, 65, 130]
QO = [1, 3, 64, 17, 65]
# Largest |got - want| / max |want| of a (sequence, query, head) row the emulator may show
# (float64 arithmetic: ~1e-15); every mutation below gives > 1e-3 on these inputs.
EMU_BOUND = 1e-12


def brute_force(qn, qp, cache, table, n, q_len, scale):
    """One sequence: every (query, head, key) decided by the definition, one at a time."""
    bs = cache.shape[1]
    out = np.zeros((q_len, qn.shape[1], 512))
    for j in range(q_len):
        last = n - q_len + j  # the query's own position
        for h in range(qn.shape[1]):
            logits, rows = [], []
            for t in range(last + 1):
                row = cache[table[t // bs], t % bs]
                rows.append(row[:512])
                logits.append((float(qn[j, h] @ row[:512]) + float(qp[j, h] @ row[512:])) * scale)
            m = max(logits)
            w = [math.exp(x - m) for x in logits]
            out[j, h] = sum(wi * r for wi, r in zip(w, rows, strict=True)) / sum(w)
    return out


def random_batch(rng, lens, qo, heads, bs=16, pages=64):
    cache = rng.standard_normal((pages, bs, 576))
    width = -(-max(lens) // bs)
    tables = np.full((len(lens), width + 1), -1)
    perm = rng.permutation(pages)
    at = 0
    for i, n in enumerate(lens):
        need = -(-n // bs)
        tables[i, :need] = perm[at : at + need]
        at += need
    total = sum(qo)
    qn = rng.standard_normal((total, heads, 512))
    qp = rng.standard_normal((total, heads, 64))
    return cache, tables, qn, qp, qo_indptr(qo)


def rel_rows(got, want):
    return np.abs(got - want).max(axis=2) / np.maximum(np.abs(want).max(axis=2), 1e-30)


def test_extend_reference_matches_the_brute_force_formula():
    rng = np.random.default_rng(0)
    lens, qo = [1, 9, 16, 17, 40], [1, 9, 3, 17, 5]
    cache, tables, qn, qp, indptr = random_batch(rng, lens, qo, 2, bs=8, pages=16)
    got = reference.mla_extend_reference(qn, qp, cache, tables, lens, indptr, SCALE)
    for i, n in enumerate(lens):
        a, b = indptr[i], indptr[i + 1]
        want = brute_force(qn[a:b], qp[a:b], cache, tables[i], n, qo[i], SCALE)
        np.testing.assert_allclose(got[a:b], want, rtol=1e-12, atol=1e-12)


def test_extend_reference_at_qo_len_one_is_the_decode_reference():
    rng = np.random.default_rng(1)
    lens = [1, 7, 33, 0]
    cache, tables, qn, qp, indptr = random_batch(rng, lens, [1, 1, 1, 1], 3, bs=8, pages=16)
    ext = reference.mla_extend_reference(qn, qp, cache, tables, lens, indptr, SCALE)
    dec = reference.mla_decode_reference(qn, qp, cache, tables, lens, SCALE)
    np.testing.assert_allclose(ext, dec, rtol=1e-12, atol=1e-15)


def launch_for(lens, qo, heads, head_tile, num_splits, bn=64):
    rows = max(qo) * heads
    split = split_kv(len(lens), -(-rows // head_tile), max(lens), bn, 132, num_splits, 1)
    return emulator.Launch(head_tile, split.chunk_tokens, split.num_splits, rows, bn)


EMU_CASES = [
    # heads, head_tile, num_splits: unsplit, split into chunks of one tile, head tiles that
    # cut a query position's heads (5 heads, 16-row tiles) or hold several positions (64).
    (5, 16, 1),
    (5, 64, 3),
    (5, 32, 2),
    (16, 64, 1),
    (20, 16, 2),
    (1, 16, 1),
]


@pytest.mark.parametrize(("heads", "head_tile", "splits"), EMU_CASES)
def test_emulated_kernel_matches_the_reference(heads, head_tile, splits):
    rng = np.random.default_rng(heads * 10 + head_tile + splits)
    cache, tables, qn, qp, indptr = random_batch(rng, LENS, QO, heads)
    ln = launch_for(LENS, QO, heads, head_tile, splits)
    assert ln.max_splits == splits
    got = emulator.emulate(qn, qp, cache, tables, np.array(LENS), indptr, SCALE, ln)
    assert not np.isnan(got).any(), "a row was never written"
    want = reference.mla_extend_reference(qn, qp, cache, tables, LENS, indptr, SCALE)
    assert rel_rows(got, want).max() <= EMU_BOUND
    # Mutations: the causal bound one token too far or too short, and a wrong latent page in
    # the table (another sequence's page in the middle of the 130-token one).
    for shift in (1, -1):
        mut = emulator.emulate(qn, qp, cache, tables, np.array(LENS), indptr, SCALE, ln, shift)
        err = rel_rows(np.nan_to_num(mut), want)
        # Every sequence whose queries saw a key more or one fewer: all but none.
        for i in range(len(LENS)):
            rows = err[indptr[i] : indptr[i + 1]]
            if shift == 1 and QO[i] == 1:
                continue  # a decode row has no key past its last: the bound cannot move it
            assert rows.max() > 1e-3, f"limit shift {shift} passes for sequence {i}"
    wrong = tables.copy()
    wrong[4, 4] = tables[1, 0]
    mut = emulator.emulate(qn, qp, cache, wrong, np.array(LENS), indptr, SCALE, ln)
    assert rel_rows(mut, want)[indptr[4] : indptr[5]].max() > 1e-3


def test_emulated_decode_is_the_extend_at_qo_len_one():
    """qo_indptr null (decode) and qo_indptr = 0, 1, .., n (extend of one token each) run the
    same arithmetic."""
    rng = np.random.default_rng(7)
    lens = [1, 63, 64, 65, 200, 0]
    cache, tables, qn, qp, indptr = random_batch(rng, lens, [1] * 6, 20)
    ln = launch_for(lens, [1] * 6, 20, 32, 3)
    dec = emulator.emulate(qn, qp, cache, tables, np.array(lens), None, SCALE, ln)
    ext = emulator.emulate(qn, qp, cache, tables, np.array(lens), indptr, SCALE, ln)
    np.testing.assert_array_equal(dec, ext)
    want = reference.mla_decode_reference(qn, qp, cache, tables, lens, SCALE)
    assert not dec[5].any()  # an empty sequence writes zeros
    assert rel_rows(dec[:5], want[:5]).max() <= EMU_BOUND


def test_kernel_signatures_match_the_parameter_blocks():
    names = [f[0] for f in MlaArgs._fields_]
    assert names == _kernel_params("paged_mla_decode.cu", "paged_mla_decode")
    merge = [f[0] for f in MlaMergeArgs._fields_]
    assert merge == _kernel_params("paged_mla_decode.cu", "mla_merge")


def host_extend(dtype, lens, qo, heads=4, seed=3):
    spec, pool, tables, plan, rng = host_setup(dtype, lens=tuple(lens), seed=seed)
    pt, sl = mla_page_tables(tables, range(len(lens)), 1)
    ext = mla_extend_plan(pool, spec, 1, qo_indptr(qo), pt, sl, heads, scale=SCALE)
    return spec, pool, pt, sl, ext, plan, rng


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_host_extend_plan_reads_the_spec_pages(dtype):
    lens, qo = [1, 63, 64, 65, 200], [1, 2, 64, 17, 40]
    spec, pool, pt, sl, ext, plan, rng = host_extend(dtype, lens, qo)
    assert ext.total_q == sum(qo) and ext.max_qo_len == 64
    qn = random_elems(rng, (sum(qo), 4, 512), dtype)
    qp = random_elems(rng, (sum(qo), 4, 64), dtype)
    for layer, idx in ((1, 0), (2, 1)):
        got = ext.run(qn, qp, layer)
        cache = plan._host_latent(idx)
        want = reference.mla_extend_reference(qn, qp, cache, pt, sl, qo_indptr(qo), SCALE, dtype)
        np.testing.assert_array_equal(got, reference.from_float64(want, dtype).view(got.dtype))
    # qo_len 1 everywhere: the extend plan's result is the decode plan's.
    one = mla_extend_plan(pool, spec, 1, qo_indptr([1] * 5), pt, sl, 4, scale=SCALE)
    qn1, qp1 = qn[:5], qp[:5]
    np.testing.assert_array_equal(one.run(qn1, qp1, 2), plan.run(qn1, qp1, 2))


def test_default_tiles_follow_the_query_rows():
    assert MLA_HEAD_TILES == (16, 32, 64)
    assert [default_head_tile(r) for r in (16, 4 * 16, 512 * 16, 20)] == [16, 64, 64, 32]


def test_extend_argument_errors_name_what_was_wrong():
    lens, qo = [1, 40, 64], [1, 3, 64]
    spec, pool, pt, sl, ext, plan, rng = host_extend("bfloat16", lens, qo)
    err = kvpool.InvalidArgumentError
    with pytest.raises(err, match="sequence 1 has 41 query tokens but seq_len 40"):
        mla_extend_plan(pool, spec, 1, qo_indptr([1, 41, 2]), pt, sl, 4, scale=SCALE)
    with pytest.raises(err, match="qo_indptr has 3 entries; seq_lens has 3"):
        mla_extend_plan(pool, spec, 1, qo_indptr([1, 1]), pt, sl, 4, scale=SCALE)
    with pytest.raises(err, match="qo_indptr must start at 0 and never decrease"):
        mla_extend_plan(pool, spec, 1, np.array([0, 2, 1, 3]), pt, sl, 4, scale=SCALE)
    with pytest.raises(err, match=r"page_tables must be \[3, max_pages\]"):
        mla_extend_plan(pool, spec, 1, qo_indptr(qo), pt[:2], sl, 4, scale=SCALE)
    with pytest.raises(err, match="full group, not mla_latent"):
        mla_extend_plan(pool, spec, 0, qo_indptr(qo), pt, sl, 4, scale=SCALE)
    with pytest.raises(err, match="num_heads 129: MLA attention runs 1..128"):
        mla_extend_plan(pool, spec, 1, qo_indptr(qo), pt, sl, 129, scale=SCALE)
    with pytest.raises(err, match="scale is required"):
        mla_extend_plan(pool, spec, 1, qo_indptr(qo), pt, sl, 4, scale=None)  # type: ignore[arg-type]
    with pytest.raises(err, match="head_tile must be one of"):
        mla_extend_plan(pool, spec, 1, qo_indptr(qo), pt, sl, 4, scale=SCALE, head_tile=48)
    with pytest.raises(err, match="takes no stream"):
        mla_extend_plan(pool, spec, 1, qo_indptr(qo), pt, sl, 4, scale=SCALE, workspace=1)
    big = qo_indptr([(1 << 23) + 1, 1, 1])
    with pytest.raises(err, match=r"at most 1073741824 query rows per sequence"):
        mla_extend_plan(pool, spec, 1, big, pt, np.array([(1 << 23) + 1, 40, 64]), 128, scale=SCALE)
    qn = random_elems(rng, (sum(qo), 4, 512), "bfloat16")
    qp = random_elems(rng, (sum(qo), 4, 64), "bfloat16")
    with pytest.raises(err, match=r"q_nope must be \[total_q, num_heads, 512\] = \[68, 4, 512\]"):
        ext.run(qn[:3], qp, 1)
    with pytest.raises(err, match="layer 0 is in group 0 .full., not in the plan's MLA group 1"):
        ext.run(qn, qp, 0)
    # A page outside the pool: refused at run, nothing written.
    bad = pt.copy()
    bad[2, 0] = pool.num_blocks
    p2 = mla_extend_plan(pool, spec, 1, qo_indptr(qo), bad, sl, 4, scale=SCALE)
    out = np.zeros((sum(qo), 4, 512), np.uint16)
    with pytest.raises(err, match="sequence 2: a page id outside the pool"):
        p2.run(qn, qp, 1, out=out)
    assert not out.any()


def test_extend_plan_of_an_empty_batch_and_of_no_queries():
    spec = mla_spec("bfloat16", 16)
    pool = kvpool.Pool.for_spec(spec, 8, device="host")
    tables = HybridTables(pool, spec)
    tables.add(0, 5)
    pt, sl = mla_page_tables(tables, [0], 1)
    ext = mla_extend_plan(pool, spec, 1, qo_indptr([0]), pt, sl, 4, scale=SCALE)
    assert ext.total_q == 0
    got = ext.run(np.zeros((0, 4, 512), np.uint16), np.zeros((0, 4, 64), np.uint16), 1)
    assert got.shape == (0, 4, 512)
    dec = mla_decode_plan(pool, spec, 1, pt, sl, 4, scale=SCALE)
    assert dec.num_seqs == 1
