"""head_dim 512 K = V attention (kvpool.kernels.shared_kv_decode_plan / shared_kv_extend_plan,
cuda/paged_mla_decode.cu with ROPE = 0) on the GPU against the float64 reference per
(sequence, query position, head): a CUDA pool of two layers, shuffled 16-token blocks, K and
V random and different (the kernel must read K as V), ragged batches (1 .. 4097 tokens), GQA
groups 1, 4 and 8, float16 and bfloat16, split and unsplit, decode and extend (decode rows,
speculative verify, chunks crossing blocks, whole prefills). Outputs are poisoned (NaN) before
each run and the K rows past each sequence's end in its last block hold NaN (never read).
Mutations must fail the same bound: the rows of a wrong KV head, V read from the V half
(K != V), the causal bound one key short. At qo_len 1 the extend plan gives the decode plan's
output bit for bit. Skipped without a GPU (conftest.py)."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from attention_inputs import qo_indptr, random_elems, shuffled_tables
from gpu_fixtures import NAN_BITS, cp, error_report, poisoned, to_device
from kvpool import reference
from kvpool.kernels import shared_kv_decode_plan, shared_kv_extend_plan

pytestmark = pytest.mark.gpu

BOUND = {"bfloat16": 1.5e-2, "float16": 4e-3}
BS = 16
LENS = [1, 15, 16, 17, 300, 4097, 64, 2048]
QO = [1, 1, 16, 5, 130, 4, 64, 20]  # decode, decode, whole prefill, chunks, verify, ...
ERRORS: dict[str, float] = {}
_report = error_report(ERRORS, "KVPOOL_SHARED_KV_ERRORS")

CASES = [
    # dtype, num_kv_heads, group, num_splits (None: the plan's)
    ("bfloat16", 4, 8, None),
    ("bfloat16", 4, 8, 1),
    ("float16", 2, 4, None),
    ("float16", 2, 4, 3),
    ("bfloat16", 8, 1, None),
    ("float16", 1, 8, 5),
]


def device_fill(view, dtype, seed):
    """N(0, 1) elements of `dtype` drawn on the device (bfloat16: float32 rounded to nearest
    even): a host draw of these pools took seconds per test."""
    arr = cp.asarray(view).view(cp.uint16)
    x = cp.random.default_rng(seed).standard_normal(arr.shape, dtype=cp.float32)
    if dtype == "float16":
        arr[...] = x.astype(cp.float16).view(cp.uint16)
    else:
        u = x.view(cp.uint32)
        arr[...] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)


def make_batch(dtype, kv_heads, seed):
    rng = np.random.default_rng(seed)
    need = sum(-(-n // BS) for n in LENS)
    layout = kvpool.KvLayout(2, kv_heads, 512, BS, dtype)
    pool = kvpool.Pool(layout, need + 37, device="cuda")
    for layer in range(2):
        device_fill(pool.k_view(layer), dtype, seed * 4 + 2 * layer)
        device_fill(pool.v_view(layer), dtype, seed * 4 + 2 * layer + 1)
    pt = shuffled_tables(rng, LENS, BS, pool.num_blocks)
    for layer in range(2):  # K rows past each sequence's end: NaN (the kernel must not read them)
        k = cp.asarray(pool.k_view(layer)).view(cp.uint16)
        for i, n in enumerate(LENS):
            if n % BS:
                k[int(pt[i, (n - 1) // BS]), n % BS :] = NAN_BITS[dtype]
    return pool, pt, np.asarray(LENS, np.int32), rng


def host_kv(pool, layer, dtype):
    def host(view):
        bits = cp.asnumpy(cp.asarray(view).view(cp.uint16))
        return bits.view(np.float16) if dtype == "float16" else bits

    return host(pool.k_view(layer)), host(pool.v_view(layer))


def to_host(out, dtype):
    bits = cp.asnumpy(out.view(cp.uint16))
    return reference.to_float64(bits.view(np.float16) if dtype == "float16" else bits, dtype)


def row_errors(got, want):
    denom = np.abs(want).max(axis=2)
    return np.abs(got - want).max(axis=2) / np.maximum(denom, 1e-30)


def run(plan, rng, dtype, tokens, heads, layer):
    q = random_elems(rng, (tokens, heads, 512), dtype)
    out = poisoned((tokens, heads, 512), dtype)
    plan.run(to_device(q, dtype), layer, out=out)
    cp.cuda.runtime.deviceSynchronize()
    return q, to_host(out, dtype)


def wrong_head(k):
    """K with the heads rolled by one: every group reads its neighbour's rows."""
    return np.roll(k, 1, axis=2)


@pytest.mark.parametrize(("dtype", "kv_heads", "group", "splits"), CASES)
def test_decode_matches_float64(dtype, kv_heads, group, splits):
    pool, pt, sl, rng = make_batch(dtype, kv_heads, kv_heads * 7 + group)
    heads = kv_heads * group
    plan = shared_kv_decode_plan(pool, cp.asarray(pt), cp.asarray(sl), heads, num_splits=splits)
    name = f"decode-{dtype}-kv{kv_heads}-g{group}-s{splits}"
    for layer in (0, 1):
        q, got = run(plan, rng, dtype, len(LENS), heads, layer)
        assert not np.isnan(got).any(), f"{name}: NaN in the output"
        k, v = host_kv(pool, layer, dtype)
        want = reference.paged_attention_decode(q, k, k, pt, sl, dtype, plan.scale)
        err = row_errors(got, want)
        ERRORS[f"{name}-L{layer}"] = float(err.max())
        assert err.max() <= BOUND[dtype], f"{name} L{layer}: max {err.max()}"
        if layer:
            continue
        # Mutations: V from the V half; another KV head's rows (MQA has none to confuse).
        mut = reference.paged_attention_decode(q, k, v, pt, sl, dtype, plan.scale)
        assert row_errors(got, mut)[1:].max() > BOUND[dtype], f"{name}: K != V misread passes"
        if kv_heads > 1:
            mut = reference.paged_attention_decode(
                q, wrong_head(k), wrong_head(k), pt, sl, dtype, plan.scale
            )
            assert row_errors(got, mut)[1:].max() > BOUND[dtype], f"{name}: wrong head passes"


@pytest.mark.parametrize(("dtype", "kv_heads", "group", "splits"), CASES)
def test_extend_matches_float64(dtype, kv_heads, group, splits):
    pool, pt, sl, rng = make_batch(dtype, kv_heads, kv_heads * 5 + group + 1)
    heads = kv_heads * group
    ip = qo_indptr(QO)
    plan = shared_kv_extend_plan(pool, ip, cp.asarray(pt), sl, heads, num_splits=splits)
    name = f"extend-{dtype}-kv{kv_heads}-g{group}-s{splits}"
    for layer in (0, 1):
        q, got = run(plan, rng, dtype, int(ip[-1]), heads, layer)
        assert not np.isnan(got).any(), f"{name}: NaN in the output"
        k, v = host_kv(pool, layer, dtype)
        want = reference.paged_attention_prefill(q, k, k, ip, pt, sl, dtype, plan.scale)
        err = row_errors(got, want)
        ERRORS[f"{name}-L{layer}"] = float(err.max())
        assert err.max() <= BOUND[dtype], f"{name} L{layer}: max {err.max()}"
        if layer:
            continue
        mut = reference.paged_attention_prefill(q, k, v, ip, pt, sl, dtype, plan.scale)
        assert row_errors(got, mut)[1:].max() > BOUND[dtype], f"{name}: K != V misread passes"
        if kv_heads > 1:
            mut = reference.paged_attention_prefill(
                q, wrong_head(k), wrong_head(k), ip, pt, sl, dtype, plan.scale
            )
            assert row_errors(got, mut)[1:].max() > BOUND[dtype], f"{name}: wrong head passes"
        # The causal bound one key short on the chunk crossing blocks (sequence 3: 5 new on 17)
        # and the long chunk (4): every query one key fewer.
        for seq in (3, 4):
            a, b = int(ip[seq]), int(ip[seq + 1])
            mut = reference.paged_attention_prefill(
                q[a:b],
                k,
                k,
                qo_indptr([QO[seq]]),
                pt[seq : seq + 1],
                sl[seq : seq + 1] - 1,
                dtype,
                plan.scale,
            )
            assert row_errors(got[a:b], mut).max() > BOUND[dtype], f"{name}: seq {seq} short"


@pytest.mark.parametrize("splits", [1, 5, None])
@pytest.mark.parametrize(("kv_heads", "group"), [(4, 8), (8, 1)])
def test_qo_len_one_is_the_decode_kernel(kv_heads, group, splits):
    dtype = "bfloat16"
    pool, pt, sl, rng = make_batch(dtype, kv_heads, 3 + group)
    n, heads = len(LENS), kv_heads * group
    dpt = cp.asarray(pt)
    dec = shared_kv_decode_plan(pool, dpt, cp.asarray(sl), heads, num_splits=splits)
    ext = shared_kv_extend_plan(pool, qo_indptr([1] * n), dpt, sl, heads, num_splits=splits)
    assert (ext.variant, ext.kv_split) == (dec.variant, dec.kv_split)
    q = to_device(random_elems(rng, (n, heads, 512), dtype), dtype)
    a, b = poisoned((n, heads, 512), dtype), poisoned((n, heads, 512), dtype)
    dec.run(q, 1, out=a)
    ext.run(q, 1, out=b)
    cp.cuda.runtime.deviceSynchronize()
    assert not np.isnan(to_host(a, dtype)).any()
    assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all())
