"""MLA decode on the GPU against the float64 reference, per (sequence, head): a CUDA pool made
from a ModelKvSpec with an MLA group of two layers (64-token pages), ragged batches (1 to 4097
tokens), 16 / 20 / 128 heads, every head tile, split and unsplit, float16 and bfloat16. The
outputs are poisoned (NaN) before each run; the rows of each sequence's last page past its end
hold NaN in the pool (never read); no NaN may come out. Mutation cases (one token too few, a
wrong latent page) must fail the same bound. Skipped without a GPU (conftest.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from attention_inputs import random_elems
from gpu_fixtures import NAN_BITS, cp, error_report, poisoned, to_device
from kvpool import HybridTables, KvGroup, ModelKvSpec, Pool, reference
from kvpool.kernels import mla_decode_plan, mla_page_tables

pytestmark = pytest.mark.gpu

SCALE = 1 / math.sqrt(192)
DEVICE = "cuda"
# Largest |got - ref| of a (sequence, head) over the largest |ref| of that row: the 16-bit P
# and output roundings give ~2^-9 (bf16) / 2^-11 (fp16) of it.
BOUND = {"bfloat16": 1.5e-2, "float16": 4e-3}
LENS = [1, 63, 64, 65, 1000, 4097, 37, 2048]
ERRORS: dict[str, float] = {}
_report = error_report(ERRORS)


def make_batch(dtype, lens, seed):
    spec = ModelKvSpec(
        [KvGroup.full([0], 2, 64, dtype), KvGroup.mla_latent([1, 2], 512, 64, dtype)],
        num_layers=3,
    )
    assert spec.block_size(1) == 64
    need = sum(-(-n // 64) for n in lens)
    pool = Pool.for_spec(spec, need + 64, device=DEVICE)
    tables = HybridTables(pool, spec)
    rng = np.random.default_rng(seed)
    for i, n in enumerate(lens):
        tables.add(1000 + i, int(rng.integers(1, 200)))  # scatter the pages
        tables.add(i, n)
    for i in range(len(lens)):
        tables.free(1000 + i)
    pt, sl = mla_page_tables(tables, range(len(lens)), 1)
    elems = pool.num_blocks * pool.block_bytes // 2
    host = random_elems(rng, (elems,), dtype).view(np.uint16)
    slab = host.reshape(pool.num_blocks, pool.block_bytes // 2)
    # NaN in every row past a sequence's end in its last page, both layers.
    for idx in range(2):
        for i, n in enumerate(lens):
            if n % 64:
                page = pt[i, (n - 1) // 64]
                start = spec.latent_offset_bytes(1, int(page), idx, n % 64, 0) // 2
                stop = spec.latent_offset_bytes(1, int(page), idx, 63, 575) // 2 + 1
                slab.reshape(-1)[start:stop] = NAN_BITS[dtype]
    if DEVICE == "cuda":
        dev = cp.cuda.UnownedMemory(pool.base_ptr, pool.num_blocks * pool.block_bytes, pool)
        dslab = cp.ndarray((elems,), cp.uint16, cp.cuda.MemoryPointer(dev, 0))
        dslab.set(host)
    return spec, pool, pt, sl, slab, rng


def layer_cache(spec, slab, idx, dtype):
    start = spec.latent_offset_bytes(1, 0, idx, 0, 0) // 2
    lay = slab[:, start : start + 64 * 576].reshape(slab.shape[0], 64, 576)
    return lay.view(np.float16) if dtype == "float16" else lay


def row_errors(got, want):
    denom = np.abs(want).max(axis=2)
    return np.abs(got - want).max(axis=2) / np.maximum(denom, 1e-30)


def to_host(out, dtype):
    bits = cp.asnumpy(out.view(cp.uint16))
    return reference.to_float64(bits.view(np.float16) if dtype == "float16" else bits, dtype)


def run_case(plan, rng, dtype, heads, rows, layer):
    """``plan.run`` of fresh random queries (``rows`` x ``heads``, ``dtype``) for ``layer``
    into a NaN-poisoned output: the queries and the output on the host."""
    qn = random_elems(rng, (rows, heads, 512), dtype)
    qp = random_elems(rng, (rows, heads, 64), dtype)
    out = poisoned((rows, heads, 512), dtype)
    plan.run(to_device(qn, dtype), to_device(qp, dtype), layer, out=out)
    cp.cuda.runtime.deviceSynchronize()
    return qn, qp, to_host(out, dtype)


CASES = [
    # dtype, heads, head_tile, num_splits (None: the plan's)
    ("bfloat16", 16, None, 1),
    ("bfloat16", 16, None, None),
    ("bfloat16", 16, None, 7),
    ("float16", 16, None, None),
    ("float16", 16, None, 1),
    ("bfloat16", 128, None, 1),
    ("bfloat16", 128, None, None),
    ("bfloat16", 128, None, 5),
    ("bfloat16", 128, 32, None),
    ("bfloat16", 128, 16, 3),
    ("float16", 128, None, None),
    ("bfloat16", 20, None, None),
    ("float16", 20, 16, 2),
]


@pytest.mark.parametrize(("dtype", "heads", "head_tile", "splits"), CASES)
def test_mla_decode_matches_float64(dtype, heads, head_tile, splits):
    spec, pool, pt, sl, slab, rng = make_batch(dtype, LENS, heads * 7 + (splits or 0))
    n = len(LENS)
    dpt, dsl = cp.asarray(pt), cp.asarray(sl)
    plan = mla_decode_plan(
        pool,
        spec,
        1,
        dpt,
        dsl,
        heads,
        scale=SCALE,
        max_seq_len=max(LENS),
        num_splits=splits,
        head_tile=head_tile,
    )
    if splits is not None:
        assert plan.num_splits == min(splits, -(-max(LENS) // 64))
    name = f"{dtype}-h{heads}-t{head_tile}-s{splits}"
    for layer, idx in ((1, 0), (2, 1)):
        qn, qp, got = run_case(plan, rng, dtype, heads, n, layer)
        assert not np.isnan(got).any(), f"{name}: NaN in the output"
        cache = layer_cache(spec, slab, idx, dtype)
        want = reference.mla_decode_reference(qn, qp, cache, pt, sl, SCALE, dtype)
        err = row_errors(got, want)
        ERRORS[f"{name}-L{layer}"] = float(err.max())
        bad = np.argwhere(err > BOUND[dtype])
        assert not len(bad), (
            f"{name} layer {layer}: {len(bad)} rows over the bound, max {err.max()}"
        )
        if layer == 1:
            # Mutations the bound must catch: one token too few in a sequence, and a wrong
            # latent page (another sequence's) in the table.
            short = sl.copy()
            short[3] -= 1  # 65 -> 64 tokens
            mut = reference.mla_decode_reference(qn, qp, cache, pt, short, SCALE, dtype)
            assert row_errors(got, mut)[3].max() > BOUND[dtype], f"{name}: one token off passes"
            wrong = pt.copy()
            wrong[5, 10] = pt[4, 0]  # a page in the middle of the 4097-token sequence
            mut = reference.mla_decode_reference(qn, qp, cache, wrong, sl, SCALE, dtype)
            assert row_errors(got, mut)[5].max() > BOUND[dtype], f"{name}: wrong page passes"


def test_empty_and_all_short_batches():
    """Sequences of 0 tokens give zeros; a batch of only 1-token sequences; the plan reads
    max_seq_len from the device when it is not given."""
    dtype = "bfloat16"
    lens = [0, 1, 1, 0]
    spec, pool, pt, sl, slab, rng = make_batch(dtype, lens, 5)
    plan = mla_decode_plan(pool, spec, 1, cp.asarray(pt), cp.asarray(sl), 16, scale=SCALE)
    qn = random_elems(rng, (4, 16, 512), dtype)
    qp = random_elems(rng, (4, 16, 64), dtype)
    out = poisoned((4, 16, 512), dtype)
    plan.run(to_device(qn, dtype), to_device(qp, dtype), 1, out=out)
    got = to_host(out, dtype)
    want = reference.mla_decode_reference(
        qn, qp, layer_cache(spec, slab, 0, dtype), pt, sl, SCALE, dtype
    )
    assert not np.isnan(got).any()
    assert not got[0].any() and not got[3].any()
    assert row_errors(got[1:3], want[1:3]).max() <= BOUND[dtype]
