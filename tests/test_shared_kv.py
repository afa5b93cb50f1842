"""head_dim 512 K = V plans (kvpool.kernels.shared_kv_decode_plan / shared_kv_extend_plan) on
the CPU (CI): the host plans' float64 results against a brute-force softmax per (sequence,
query, head) that reads the K rows as V, with mutations (V from the V half, a wrong KV head,
the causal bound one key short) shown to differ; qo_len 1 equals decode; the launch geometry
(row tiles per KV head, modules without the rope part); the argument checks naming the
supported set; decode_plan / prefill_plan's refusals pointing at these plans."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import kvpool
import numpy as np
import pytest
from attention_inputs import qo_indptr, random_elems, shuffled_tables
from kvpool import reference
from kvpool.kernels import _build, shared_kv_decode_plan, shared_kv_extend_plan

_PATH = Path(__file__).resolve().parents[1] / "tools" / "mla_extend_emulator.py"
_spec = importlib.util.spec_from_file_location("mla_extend_emulator", _PATH)
assert _spec is not None and _spec.loader is not None
emulator = sys.modules.get("mla_extend_emulator") or importlib.util.module_from_spec(_spec)
if "mla_extend_emulator" not in sys.modules:  # test_mla_extend.py may have loaded it
    sys.modules["mla_extend_emulator"] = emulator  # dataclasses look their module up here
    _spec.loader.exec_module(emulator)

BS = 16
LENS = [1, 15, 17, 40, 70]
QO = [1, 3, 17, 5, 64]


def host_pool(dtype="float16", kv_heads=2, seed=0):
    rng = np.random.default_rng(seed)
    need = sum(-(-n // BS) for n in LENS)
    pool = kvpool.Pool(kvpool.KvLayout(2, kv_heads, 512, BS, dtype), need + 3, device="cpu")
    for layer in range(2):
        for view in (pool.k_view(layer), pool.v_view(layer)):
            view[...] = random_elems(rng, view.shape, dtype).view(view.dtype)
    pt = shuffled_tables(rng, LENS, BS, pool.num_blocks)
    return pool, pt, np.asarray(LENS, np.int32), rng


def brute_force(q, k_cache, pt, lens, indptr, dtype, scale):
    """Per (sequence, query, head): softmax over the keys it sees of K, weighting K rows."""
    q64 = reference.to_float64(q, dtype)
    k64 = reference.to_float64(k_cache, dtype)
    hq, hkv = q.shape[1], k_cache.shape[2]
    out = np.zeros(q64.shape)
    for i, n in enumerate(lens):
        a, b = int(indptr[i]), int(indptr[i + 1])
        rows = np.stack([k64[pt[i, t // BS], t % BS] for t in range(n)])  # [n, Hkv, 512]
        for j in range(a, b):
            seen = n - (b - a) + (j - a) + 1
            for h in range(hq):
                kv = rows[:seen, h // (hq // hkv)]
                s = kv @ q64[j, h] * scale
                p = np.exp(s - s.max())
                out[j, h] = p @ kv / p.sum()
    return out


def rel(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.parametrize(("dtype", "kv_heads", "group"), [("float16", 2, 4), ("bfloat16", 1, 8)])
def test_host_plans_match_the_brute_force_formula(dtype, kv_heads, group):
    pool, pt, sl, rng = host_pool(dtype, kv_heads)
    heads = kv_heads * group
    ip = qo_indptr(QO)
    q = random_elems(rng, (int(ip[-1]), heads, 512), dtype)
    plan = shared_kv_extend_plan(pool, ip, pt, sl, heads)
    assert plan.scale == 1 / np.sqrt(512)
    got = reference.to_float64(plan.run(q, 1), dtype)
    want = brute_force(q, pool.k_view(1), pt, sl, ip, dtype, plan.scale)
    bound = 1e-2 if dtype == "bfloat16" else 2e-3  # the 16-bit rounding of the output
    assert rel(got, want) < bound
    # The mutations a kernel test relies on give results far from the right one.
    k, v = pool.k_view(1), pool.v_view(1)
    kv_misread = reference.paged_attention_prefill(q, k, v, ip, pt, sl, dtype, plan.scale)
    assert rel(kv_misread, want) > 10 * bound
    a, b = int(ip[3]), int(ip[4])  # 5 new tokens on 40: each sees one key fewer
    short = reference.paged_attention_prefill(
        q[a:b], k, k, qo_indptr([QO[3]]), pt[3:4], sl[3:4] - 1, dtype, plan.scale
    )
    assert rel(short, want[a:b]) > 10 * bound
    if kv_heads > 1:
        wrong = np.roll(k, 1, axis=2)
        mut = reference.paged_attention_prefill(q, wrong, wrong, ip, pt, sl, dtype, plan.scale)
        assert rel(mut, want) > 10 * bound
    # Decode: the last query token of each sequence; an extend plan of qo_len 1 is the same.
    qd = random_elems(rng, (len(LENS), heads, 512), dtype)
    dec = shared_kv_decode_plan(pool, pt, sl, heads).run(qd, 0)
    one = shared_kv_extend_plan(pool, qo_indptr([1] * len(LENS)), pt, sl, heads).run(qd, 0)
    np.testing.assert_array_equal(dec, one)
    wantd = brute_force(qd, pool.k_view(0), pt, sl, qo_indptr([1] * len(LENS)), dtype, plan.scale)
    assert rel(reference.to_float64(dec, dtype), wantd) < bound


def test_launch_geometry_per_kv_head():
    # Rows per KV head = qo_len x group; a CTA tile holds the smallest of 16 / 32 / 64 that
    # fits them; the module has no rope part (ROPE=0) and 1024-byte rows.
    pool, pt, sl, _ = host_pool("bfloat16", 2)
    dec = shared_kv_decode_plan(pool, pt, sl, 16)
    assert (dec._rows_per_seq, dec._group_heads, dec._num_kv_heads) == (8, 8, 2)
    assert dec.variant == _build.MlaVariant("bfloat16", 1, 4, rope=0)
    assert "-DROPE=0" in dec.variant.options()
    v = dec.variant
    assert v.dynamic_smem_bytes == 2 * 64 * 1024 + 16 * 1024 + 16 * 64 * 2 + 2 * 4 * 16 * 4
    ext = shared_kv_extend_plan(pool, qo_indptr(QO), pt, sl, 16)
    assert ext._rows_per_seq == 64 * 8 and ext.variant.heads_per_cta == 64
    st = pool.layout.strides()
    assert (dec._kv_head_stride, dec._token_stride, dec._page_stride) == (
        st["head"],
        st["token"],
        st["block"],
    )
    assert dec._kv_base(1) - dec._kv_base(0) == st["layer"]


def test_argument_errors_name_the_supported_set():
    err = kvpool.InvalidArgumentError
    pool, pt, sl, rng = host_pool()
    for layout in (
        kvpool.KvLayout(1, 2, 256, BS, "float16"),
        kvpool.KvLayout(1, 2, 512, BS, "float32"),
    ):
        p = kvpool.Pool(layout, 8, device="cpu")
        with pytest.raises(
            err, match="no shared K = V kernel .*supported: head_dim 512 with K = V"
        ):
            shared_kv_decode_plan(p, pt, sl, 4)
    with pytest.raises(TypeError, match="pool must be a kvpool Pool"):
        shared_kv_decode_plan(object(), pt, sl, 4)
    with pytest.raises(err, match="num_q_heads 3 is not a multiple of num_kv_heads 2"):
        shared_kv_decode_plan(pool, pt, sl, 3)
    with pytest.raises(err, match="scale must be finite"):
        shared_kv_decode_plan(pool, pt, sl, 4, scale=float("inf"))
    with pytest.raises(err, match="head_tile must be one of"):
        shared_kv_extend_plan(pool, qo_indptr(QO), pt, sl, 4, head_tile=8)
    with pytest.raises(err, match="2 query tokens but seq_len 1"):
        shared_kv_extend_plan(pool, qo_indptr([2] + QO[1:]), pt, [1] + LENS[1:], 4)
    plan = shared_kv_decode_plan(pool, pt, sl, 4)
    q = random_elems(rng, (len(LENS), 4, 512), "float16")
    with pytest.raises(err, match="layer 2 outside 0..1"):
        plan.run(q, 2)
    with pytest.raises(err, match=r"q must be \[num_seqs, num_q_heads, 512\] = \[5, 4, 512\]"):
        plan.run(q[:, :2], 0)
    with pytest.raises(err, match=r"block_tables must be \[5, max_pages\]"):
        shared_kv_decode_plan(pool, pt[:2], sl, 4)
    bad = pt.copy()
    bad[2, 0] = pool.num_blocks
    out = np.zeros_like(q)
    with pytest.raises(err, match="a page id outside the pool"):
        shared_kv_decode_plan(pool, bad, sl, 4).run(q, 0, out=out)
    assert not out.any()


def test_the_other_plans_name_these_for_head_dim_512():
    assert "shared_kv_decode_plan" in _build.supported_set()
    from kvpool.kernels import _decode_args

    msg = _decode_args.unsupported("float16", 512, 16, _build.TC)
    assert msg is not None and "head_dim 512 with K = V: kvpool.kernels.shared_kv" in msg


@pytest.mark.parametrize(
    ("kv_heads", "group", "tile", "chunk", "splits"),
    [(2, 4, 16, 1 << 20, 1), (4, 8, 64, 64, 3), (8, 1, 32, 128, 2), (1, 8, 16, 64, 4)],
)
def test_emulated_kernel_matches_the_reference(kv_heads, group, tile, chunk, splits):
    """The tile-level emulation of the ROPE=0 launch (tools/mla_extend_emulator.py: the grid
    over (KV head, row tile), the query head of each row, the KV head's rows, split partials
    per KV head and their merge) against the float64 reference; the rows of a wrong KV head
    and a causal bound one key off fail."""
    rng = np.random.default_rng(kv_heads * 10 + group)
    heads = kv_heads * group
    lens = np.array([1, 140, 17, 200])
    qo = np.array([1, 3, 17, 9])
    ip = qo_indptr(qo)
    pages = 2 + int(sum(-(-lens // BS)))
    cache = rng.standard_normal((pages, BS, kv_heads, 512))
    pt = shuffled_tables(rng, lens, BS, pages)
    q = rng.standard_normal((int(ip[-1]), heads, 512))
    want = reference.paged_attention_prefill(q, cache, cache, ip, pt, lens, "float32", 0.05)
    launch = emulator.Launch(tile, chunk, splits, int(qo.max()) * group)
    got = emulator.emulate(q, None, cache, pt, lens, ip, 0.05, launch)
    assert not np.isnan(got).any()
    assert rel(got, want) < 1e-12
    for shift in (-1, 1):
        mut = emulator.emulate(q, None, cache, pt, lens, ip, 0.05, launch, limit_shift=shift)
        assert rel(mut, want) > 1e-3
    if kv_heads > 1:
        mut = emulator.emulate(q, None, cache, pt, lens, ip, 0.05, launch, kv_head_shift=1)
        assert rel(mut, want) > 1e-2
