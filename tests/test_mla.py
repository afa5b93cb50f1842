"""MLA decode on the CPU (CI): the float64 reference against a brute-force per-head formula,
the host plan (HybridTables' pages of a host pool) against the reference, mla_page_tables, and
the argument checks (wrong types and values, a group that is not MLA, head counts, a layer of
another group), each a clear error before anything runs."""

from __future__ import annotations

import math

import kvpool
import numpy as np
import pytest
from attention_inputs import random_elems
from kvpool import HybridTables, KvGroup, ModelKvSpec, Pool, reference
from kvpool.kernels import mla_decode_plan, mla_page_tables, paged_mla_decode
from kvpool.kernels._mla import default_head_tile

SCALE = 1 / math.sqrt(192)


def brute_force(qn, qp, cache, table, n, scale):
    """One sequence, head by head, token by token: the definition written out."""
    bs = cache.shape[1]
    out = np.zeros((qn.shape[0], 512))
    for h in range(qn.shape[0]):
        logits = []
        rows = []
        for t in range(n):
            row = cache[table[t // bs], t % bs]
            rows.append(row[:512])
            logits.append((float(qn[h] @ row[:512]) + float(qp[h] @ row[512:])) * scale)
        m = max(logits)
        w = [math.exp(x - m) for x in logits]
        out[h] = sum(wi * r for wi, r in zip(w, rows, strict=True)) / sum(w)
    return out


def test_reference_matches_the_brute_force_formula():
    rng = np.random.default_rng(0)
    bs, pages, heads = 8, 12, 3
    cache = rng.standard_normal((pages, bs, 576))
    lens = [1, 7, 8, 9, 40, 0]
    tables = np.full((len(lens), 6), -1)
    perm = rng.permutation(pages)
    k = 0
    for i, n in enumerate(lens):
        need = -(-n // bs)
        tables[i, :need] = perm[k : k + need] if k + need <= pages else perm[:need]
        k = (k + need) % pages
    qn = rng.standard_normal((len(lens), heads, 512))
    qp = rng.standard_normal((len(lens), heads, 64))
    got = reference.mla_decode_reference(qn, qp, cache, tables, lens, SCALE)
    for i, n in enumerate(lens):
        if n == 0:
            assert not got[i].any()
            continue
        want = brute_force(qn[i], qp[i], cache, tables[i], n, SCALE)
        np.testing.assert_allclose(got[i], want, rtol=1e-12, atol=1e-12)


def test_reference_bfloat16_bits_are_decoded():
    rng = np.random.default_rng(1)
    cache = random_elems(rng, (2, 4, 576), "bfloat16")
    qn = random_elems(rng, (1, 2, 512), "bfloat16")
    qp = random_elems(rng, (1, 2, 64), "bfloat16")
    tables = np.array([[1, 0]])
    got = reference.mla_decode_reference(qn, qp, cache, tables, [6], SCALE, "bfloat16")
    f = [reference.to_float64(x, "bfloat16") for x in (qn, qp, cache)]
    want = reference.mla_decode_reference(f[0], f[1], f[2], tables, [6], SCALE)
    np.testing.assert_array_equal(got, want)


def mla_spec(dtype="bfloat16", page_tokens=None) -> ModelKvSpec:
    groups = [KvGroup.full([0], 2, 64, dtype), KvGroup.mla_latent([1, 2], 512, 64, dtype)]
    if page_tokens is None:
        return ModelKvSpec(groups, num_layers=3)
    row = 2 * 576 * 2  # two MLA layers of a 576-element row
    return ModelKvSpec(groups, page_tokens * row, num_layers=3)


def host_setup(dtype="bfloat16", lens=(1, 63, 64, 65, 200), page_tokens=16, seed=2):
    spec = mla_spec(dtype, page_tokens)
    pool = Pool.for_spec(spec, 64, device="host")
    tables = HybridTables(pool, spec)
    for i, n in enumerate(lens):
        tables.add(i, n)
    rng = np.random.default_rng(seed)
    plan = mla_decode_plan(
        pool, spec, 1, *mla_page_tables(tables, range(len(lens)), 1), 4, scale=SCALE
    )
    for idx in range(2):
        lat = plan._host_latent(idx)
        lat[...] = random_elems(rng, lat.shape, dtype).view(lat.dtype)
    return spec, pool, tables, plan, rng


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_host_plan_reads_the_groups_pages_as_the_spec_places_them(dtype):
    """The host run against the reference over rows gathered element by element through
    ModelKvSpec.latent_offset_bytes, per layer of the group."""
    spec, pool, tables, plan, rng = host_setup(dtype)
    n = plan.num_seqs
    qn = random_elems(rng, (n, 4, 512), dtype)
    qp = random_elems(rng, (n, 4, 64), dtype)
    slab = np.ctypeslib.as_array(
        (np.ctypeslib.ctypes.c_uint8 * (pool.num_blocks * pool.block_bytes)).from_address(
            pool.base_ptr
        )
    )
    elem = np.float16 if dtype == "float16" else np.uint16
    page_tables, lens = mla_page_tables(tables, range(n), 1)
    for layer, idx in ((1, 0), (2, 1)):
        got = plan.run(qn, qp, layer)
        cache = np.zeros((pool.num_blocks, 16, 576), dtype=elem)
        for p in range(pool.num_blocks):
            for t in (0, 5, 15):  # spot rows: the layer's start, the page stride, the row stride
                off = spec.latent_offset_bytes(1, p, idx, t, 0)
                assert off == p * spec.page_bytes + idx * 16 * 1152 + t * 1152
            start = spec.latent_offset_bytes(1, p, idx, 0, 0)
            cache[p] = slab[start : start + 16 * 1152].view(elem).reshape(16, 576)
        want = reference.mla_decode_reference(qn, qp, cache, page_tables, lens, SCALE, dtype)
        np.testing.assert_array_equal(got, reference.from_float64(want, dtype).view(got.dtype))
    # The two layers hold different data: their results differ.
    assert not np.array_equal(plan.run(qn, qp, 1), plan.run(qn, qp, 2))


def test_mla_page_tables_pads_with_minus_one():
    spec, pool, tables, plan, _ = host_setup(lens=(1, 40))
    pt, lens = mla_page_tables(tables, [0, 1], 1)
    assert pt.dtype == np.int32 and lens.tolist() == [1, 40]
    assert pt.shape == (2, 3) and pt[0, 1:].tolist() == [-1, -1]
    assert pt[1].tolist() == tables.table(1, 1)[1].tolist()


def test_default_head_tiles():
    assert [default_head_tile(h) for h in (1, 16, 17, 32, 33, 64, 128)] == [
        16,
        16,
        32,
        32,
        64,
        64,
        64,
    ]


def test_argument_errors_name_what_was_wrong():
    spec, pool, tables, plan, rng = host_setup()
    pt, lens = mla_page_tables(tables, range(plan.num_seqs), 1)
    err = kvpool.InvalidArgumentError
    with pytest.raises(err, match="full group, not mla_latent"):
        mla_decode_plan(pool, spec, 0, pt, lens, 16, scale=SCALE)
    with pytest.raises(err, match="group 5 outside"):
        mla_decode_plan(pool, spec, 5, pt, lens, 16, scale=SCALE)
    with pytest.raises(TypeError, match="spec must be a ModelKvSpec"):
        mla_decode_plan(pool, "spec", 1, pt, lens, 16, scale=SCALE)
    for heads in (0, 129):
        with pytest.raises(err, match=f"num_heads {heads}: MLA attention runs 1..128"):
            mla_decode_plan(pool, spec, 1, pt, lens, heads, scale=SCALE)
    with pytest.raises(TypeError, match="num_heads must be an integer"):
        mla_decode_plan(pool, spec, 1, pt, lens, 16.0, scale=SCALE)
    with pytest.raises(err, match="scale is required"):
        mla_decode_plan(pool, spec, 1, pt, lens, 16, scale=None)  # type: ignore[arg-type]
    with pytest.raises(err, match="scale must be finite"):
        mla_decode_plan(pool, spec, 1, pt, lens, 16, scale=float("nan"))
    with pytest.raises(err, match="head_tile must be one of"):
        mla_decode_plan(pool, spec, 1, pt, lens, 16, scale=SCALE, head_tile=8)
    other = ModelKvSpec([KvGroup.mla_latent([0], 512, 64, "bfloat16")], 4096 * 1152)
    with pytest.raises(err, match="not the spec's pages"):
        mla_decode_plan(pool, other, 0, pt, lens, 16, scale=SCALE)
    for bad, why in (
        (KvGroup.mla_latent([0], 256, 64, "bfloat16"), "latent_dim 256"),
        (KvGroup.mla_latent([0], 512, 32, "bfloat16"), "rope_dim 32"),
        (KvGroup.mla_latent([0], 512, 64, "float8_e5m2"), "dtype float8_e5m2"),
    ):
        s = ModelKvSpec([bad])
        p = Pool.for_spec(s, 4, device="host")
        with pytest.raises(
            err, match=f"no MLA decode kernel for .*{why}.*supported: an mla_latent"
        ):
            mla_decode_plan(p, s, 0, pt, lens, 16, scale=SCALE)

    n = plan.num_seqs
    qn = random_elems(rng, (n, 4, 512), "bfloat16")
    qp = random_elems(rng, (n, 4, 64), "bfloat16")
    with pytest.raises(err, match="layer 0 is in group 0 .full., not in the plan's MLA group 1"):
        plan.run(qn, qp, 0)
    with pytest.raises(err, match="layer 3 outside"):
        plan.run(qn, qp, 3)
    with pytest.raises(err, match="q_nope must hold the group's dtype bfloat16"):
        plan.run(qn.view(np.float16), qp, 1)
    with pytest.raises(err, match=r"q_pe must be \[num_seqs, num_heads, 64\]"):
        plan.run(qn, random_elems(rng, (n, 4, 32), "bfloat16"), 1)
    with pytest.raises(err, match=r"q_nope must be \[num_seqs, num_heads, 512\] = \[5, 4, 512\]"):
        plan.run(random_elems(rng, (n, 3, 512), "bfloat16"), qp, 1)
    with pytest.raises(err, match="takes no stream"):
        mla_decode_plan(pool, spec, 1, pt, lens, 4, scale=SCALE, stream=object())
    # The tables changed to a page outside the pool: refused at run, nothing written.
    bad_pt = pt.copy()
    bad_pt[1, 0] = pool.num_blocks
    p2 = mla_decode_plan(pool, spec, 1, bad_pt, lens, 4, scale=SCALE)
    out = np.zeros((n, 4, 512), np.uint16)
    with pytest.raises(err, match="sequence 1: a page id outside the pool"):
        p2.run(qn, qp, 1, out=out)
    assert not out.any()
    # The one-call form: the layer names the group; a plan's own arguments are refused with it.
    np.testing.assert_array_equal(
        paged_mla_decode(qn, qp, pool, spec, 2, pt, lens, scale=SCALE), plan.run(qn, qp, 2)
    )
    with pytest.raises(err, match="full group, not mla_latent"):
        paged_mla_decode(qn, qp, pool, spec, 0, pt, lens, scale=SCALE)
    with pytest.raises(err, match="scale: the plan's own arguments"):
        paged_mla_decode(qn, qp, pool, spec, 1, pt, lens, scale=SCALE, plan=plan)
    with pytest.raises(TypeError, match="plan must be an MlaDecodePlan"):
        paged_mla_decode(qn, qp, pool, spec, 1, pt, lens, plan=object())  # type: ignore[arg-type]
