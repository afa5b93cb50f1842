"""MLA extend on the GPU against the float64 reference, per (sequence, query position, head): a
CUDA pool made from a ModelKvSpec with an MLA group of two layers (64-token pages, shuffled by
other requests' pages), ragged batches mixing decode rows, speculative-verify rows (4 new
tokens), chunks crossing pages (17 new on 65 cached: positions 48..64), whole prefills (qo_len
= seq_len) and long chunks on a prefix; 16 / 20 / 128 heads, every head tile, split and
unsplit, float16 and bfloat16. Outputs are poisoned (NaN) before each run; the rows past each
sequence's end in its last page hold NaN in the pool (never read). Mutations (the causal bound
one key short or one key long, the causal mask left out, a wrong latent page) must fail the
same bound. At qo_len 1 the extend plan's output is the decode plan's, bit for bit. Skipped
without a GPU (conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
from attention_inputs import qo_indptr, random_elems
from gpu_fixtures import cp, error_report, poisoned, to_device
from kvpool import reference
from kvpool.kernels import mla_decode_plan, mla_extend_plan
from test_mla_gpu import BOUND, SCALE, layer_cache, make_batch, row_errors, run_case, to_host

pytestmark = pytest.mark.gpu

ERRORS: dict[str, float] = {}
_report = error_report(ERRORS, "KVPOOL_MLA_EXTEND_ERRORS")

LENS = [1, 63, 64, 65, 1000, 4097, 37, 2048]
# qo_len per sequence: decode, decode, whole prefill, a chunk crossing a page, a long chunk on a
# prefix, speculative verify, whole prefill, a chunk ending inside a page.
QO_WIDE = [1, 1, 64, 17, 130, 4, 37, 20]
QO_NARROW = [1, 1, 8, 17, 40, 4, 5, 8]  # 128 heads: the float64 reference stays quick

CASES = [
    # dtype, heads, head_tile, num_splits (None: the plan's), qo lens
    ("bfloat16", 16, None, 1, QO_WIDE),
    ("bfloat16", 16, None, None, QO_WIDE),
    ("bfloat16", 16, 16, 3, QO_WIDE),
    ("float16", 16, None, None, QO_WIDE),
    ("float16", 16, 32, 1, QO_WIDE),
    ("bfloat16", 128, None, None, QO_NARROW),
    ("bfloat16", 128, None, 4, QO_NARROW),
    ("float16", 128, 32, 1, QO_NARROW),
    ("bfloat16", 20, None, 2, QO_WIDE),
    ("float16", 20, 16, None, QO_WIDE),
]


def mutated_rows(qn, qp, cache, pt, lens, qo, seq, dtype, mutation):
    """(rows, reference) of sequence `seq` under a mutated causal bound: "short", every query
    sees one key fewer (seq_len - 1 with the same qo_len); "long", one key more (its first
    qo_len - 1 queries against seq_len with qo_len - 1: query j then sees the keys query j + 1
    sees); "none", the mask left out (every query sees all seq_len keys)."""
    ip = qo_indptr(qo)
    a, b = int(ip[seq]), int(ip[seq + 1])
    n, q = lens[seq], qo[seq]
    table = pt[seq : seq + 1]
    if mutation == "short":
        rows, lens1, qo1 = slice(a, b), [n - 1], [q]
    elif mutation == "long":
        rows, lens1, qo1 = slice(a, b - 1), [n], [q - 1]
    else:
        rows, lens1, qo1 = slice(a, b), [n] * q, [1] * q
        table = np.repeat(table, q, axis=0)
    want = reference.mla_extend_reference(
        qn[rows], qp[rows], cache, table, lens1, qo_indptr(qo1), SCALE, dtype
    )
    return rows, want


@pytest.mark.parametrize(("dtype", "heads", "head_tile", "splits", "qo"), CASES)
def test_mla_extend_matches_float64(dtype, heads, head_tile, splits, qo):
    spec, pool, pt, sl, slab, rng = make_batch(dtype, LENS, heads * 11 + (splits or 0))
    indptr = qo_indptr(qo)
    total_q = int(indptr[-1])
    plan = mla_extend_plan(
        pool,
        spec,
        1,
        indptr,
        cp.asarray(pt),
        sl,
        heads,
        scale=SCALE,
        num_splits=splits,
        head_tile=head_tile,
    )
    if splits is not None:
        assert plan.num_splits == min(splits, -(-max(LENS) // 64))
    name = f"{dtype}-h{heads}-t{head_tile}-s{splits}-q{max(qo)}"
    for layer, idx in ((1, 0), (2, 1)):
        qn, qp, got = run_case(plan, rng, dtype, heads, total_q, layer)
        assert not np.isnan(got).any(), f"{name}: NaN in the output"
        cache = layer_cache(spec, slab, idx, dtype)
        want = reference.mla_extend_reference(qn, qp, cache, pt, sl, indptr, SCALE, dtype)
        err = row_errors(got, want)
        ERRORS[f"{name}-L{layer}"] = float(err.max())
        bad = np.argwhere(err > BOUND[dtype])
        assert not len(bad), (
            f"{name} layer {layer}: {len(bad)} rows over the bound, max {err.max()}"
        )
        if layer != 1 or head_tile is not None or splits is not None:
            continue  # the mutations once per dtype and head count: they test the bound
        # Mutations the bound must catch, on the chunk crossing a page (sequence 3) and the
        # long chunk (4): the causal bound one key short, one key long, left out.
        for seq in (3, 4):
            for mutation in ("short", "long", "none"):
                rows, mut = mutated_rows(qn, qp, cache, pt, LENS, qo, seq, dtype, mutation)
                e = row_errors(got[rows], mut).max()
                assert e > BOUND[dtype], f"{name}: seq {seq} causal bound {mutation} passes"
        # A wrong latent page (another sequence's) in the middle of the 4097-token sequence,
        # whose speculative-verify queries all read it.
        wrong = pt.copy()
        wrong[5, 10] = pt[4, 0]
        a, b = int(indptr[5]), int(indptr[6])
        mut = reference.mla_extend_reference(
            qn[a:b], qp[a:b], cache, wrong[5:6], sl[5:6], qo_indptr(qo[5:6]), SCALE, dtype
        )
        assert row_errors(got[a:b], mut).max() > BOUND[dtype], f"{name}: wrong page passes"


@pytest.mark.parametrize("splits", [1, 5, None])
@pytest.mark.parametrize("heads", [16, 128])
def test_qo_len_one_is_the_decode_kernel(heads, splits):
    """An extend plan of one query token per sequence gives the decode plan's output bit for
    bit (the same launch), and its device-given lengths are read back."""
    dtype = "bfloat16"
    spec, pool, pt, sl, slab, rng = make_batch(dtype, LENS, 3 + heads)
    n = len(LENS)
    dpt = cp.asarray(pt)
    dec = mla_decode_plan(pool, spec, 1, dpt, cp.asarray(sl), heads, scale=SCALE, num_splits=splits)
    ext = mla_extend_plan(
        pool,
        spec,
        1,
        cp.asarray(qo_indptr([1] * n)),
        dpt,
        cp.asarray(sl),
        heads,
        scale=SCALE,
        num_splits=splits,
    )
    assert (ext.variant, ext.kv_split) == (dec.variant, dec.kv_split)
    qn = to_device(random_elems(rng, (n, heads, 512), dtype), dtype)
    qp = to_device(random_elems(rng, (n, heads, 64), dtype), dtype)
    a, b = poisoned((n, heads, 512), dtype), poisoned((n, heads, 512), dtype)
    dec.run(qn, qp, 2, out=a)
    ext.run(qn, qp, 2, out=b)
    cp.cuda.runtime.deviceSynchronize()
    assert not np.isnan(to_host(a, dtype)).any()
    assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all())
