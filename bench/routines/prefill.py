"""Paged prefill attention on the GPU: kvpool against FlashInfer and torch SDPA, same run.

Per shape (new tokens x sequences on a cached prefix): a 1-layer pool whose block layout is
FlashInfer's NHD paged cache, so FlashInfer's BatchPrefillWithPagedKVCacheWrapper (fa2 and,
when the wheel carries it, fa3) reads the very same shuffled pages; torch SDPA (flash, cuDNN)
runs on contiguous K/V gathered from them (bottom-right causal mask when a prefix is cached).
Timing: CUDA events around a loop of calls, medians over repetitions after warm-up. Reported as
TFLOP/s of causal FLOPs (4 * head_dim * num_q_heads * attended (query, key) pairs) and as a
fraction of a dense matmul (8192^3, same dtype) measured in the same run.

Usage: python3 bench/kvbench.py --routine prefill [--out DIR] [--quick] [--grid issue26]
       [--head-dims 64,128,256] [--groups 1,4,8]  (default D 128, group 4: Hq 32 over Hkv 8)
"""

from __future__ import annotations

import argparse
import json
import traceback

import cupy as cp
import numpy as np
import provenance
import torch
import torch.nn.functional as F
from kvpool.kernels import _tuning, prefill_plan
from timing import event_us
from torch.nn.attention import SDPBackend, sdpa_kernel

from routines.decode import paged_pool

HQ, HKV, D, BS = 32, 8, 128, 16
# (label, sequences, new tokens each, cached prefix each)
SHAPES = [
    ("1 x 4k", 1, 4096, 0),
    ("1 x 32k", 1, 32768, 0),
    ("8 x 2k", 8, 2048, 0),
    ("32 x 512 on 2k", 32, 512, 2048),
    ("4 x 8k chunk on 24k", 4, 8192, 24576),
    ("64 x 4 spec on 8k", 64, 4, 8192),
]
BF16_SHAPES = ("1 x 4k", "4 x 8k chunk on 24k", "64 x 4 spec on 8k")
# Issue 26's prefill grid at head_dim 128 (--grid issue26), bf16 on the two long shapes.
ISSUE26_SHAPES = [
    ("1 x 16k", 1, 16384, 0),
    ("4 x 8k chunk on 24k", 4, 8192, 24576),
    ("32 x 512 on 1.5k", 32, 512, 1536),
    ("64 x 2k", 64, 2048, 0),
    ("256 x 128", 256, 128, 0),
]
ISSUE26_BF16 = ("1 x 16k", "4 x 8k chunk on 24k")
GRIDS = {"default": (SHAPES, BF16_SHAPES), "issue26": (ISSUE26_SHAPES, ISSUE26_BF16)}


def grid_rows(grid, head_dims=(D,), groups=(HQ // HKV,), dtypes=("float16", "bfloat16")):
    """(label, sequences, new tokens, prefix, dtype, num_q_heads, head_dim) of every row a run
    measures: each shape of `grid` at every head_dim and GQA group (HKV KV heads, group x HKV
    query heads), fp16 on all of them, bf16 on the grid's bf16 shapes."""
    shapes, bf16_shapes = GRIDS[grid]
    out = []
    for dtype in dtypes:
        for d in head_dims:
            for g in groups:
                for label, n, qo, prefix in shapes:
                    if dtype == "bfloat16" and label not in bf16_shapes:
                        continue
                    out.append((label, n, qo, prefix, dtype, g * HKV, d))
    return out


def _ints(text):
    return tuple(int(x) for x in text.split(",") if x)


def matmul_tflops(tdt):
    n = 8192
    a = torch.randn(n, n, device="cuda").to(tdt)
    b = torch.randn(n, n, device="cuda").to(tdt)
    us = event_us(lambda: torch.matmul(a, b), reps=10, inner=5)
    return 2 * n**3 / (us * 1e-6) / 1e12


def causal_flops(num_seqs, qo, prefix, hq=HQ, d=D):
    pairs = qo * prefix + qo * (qo + 1) // 2
    return 4 * d * hq * pairs * num_seqs


def bench_shape(
    label, num_seqs, qo, prefix, dtype, dense_tflops, quick, kvpool_only=False, hq=HQ, d=D
):
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    seq_len = qo + prefix
    blocks_per_seq = -(-seq_len // BS)
    num_blocks = num_seqs * blocks_per_seq + 8
    pool, cache = paged_pool(dtype, num_blocks, BS, d)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(num_seqs * 7919 + seq_len)
    cache.copy_(torch.randn(cache.shape, device="cuda", generator=gen).to(tdt))
    rng = np.random.default_rng(num_seqs * 31 + seq_len)
    perm = rng.permutation(num_blocks)[: num_seqs * blocks_per_seq].astype(np.int32)
    tables = perm.reshape(num_seqs, blocks_per_seq)
    tables_t = torch.from_numpy(tables).cuda()
    lens = np.full(num_seqs, seq_len, np.int32)
    indptr = np.arange(num_seqs + 1, dtype=np.int32) * qo
    indptr_t = torch.from_numpy(indptr).cuda()
    q = torch.randn(num_seqs * qo, hq, d, device="cuda", generator=gen).to(tdt)
    out = torch.empty_like(q)
    as_arg = (lambda t: t.view(torch.int16)) if dtype == "bfloat16" else (lambda t: t)
    # Made once, outside the timed calls (like FlashInfer's plan below); it owns its split
    # workspace, and the timed call is the per-layer run.
    plan = prefill_plan(pool, indptr, tables_t, lens, hq)
    # Both kernels, forced (the Hopper one only on compute capability 9.0, with cp.async and
    # with TMA K/V loads), next to the default.
    forced = {}
    for kernel, tma in (("sm80", False), ("sm90", False), ("sm90", True)):
        name = "sm90_tma" if tma else kernel
        try:
            with _tuning.override(prefill_kernel=kernel, prefill_tma=tma):
                forced[name] = prefill_plan(pool, indptr, tables_t, lens, hq)
        except Exception as e:
            forced[name] = f"{type(e).__name__}: {e}"[:300]
    flops = causal_flops(num_seqs, qo, prefix, hq, d)
    row = {
        "shape": label,
        "dtype": dtype,
        "num_seqs": num_seqs,
        "new_tokens": qo,
        "cached_prefix": prefix,
        "num_q_heads": hq,
        "num_kv_heads": HKV,
        "head_dim": d,
        "block_size": BS,
        "causal_flops": flops,
        "num_items": plan.work.num_items,
        "rows_per_cta": plan.rows_per_cta,
        "num_splits": plan.num_splits,
        "kernel": ("sm90_tma" if plan.variant.tma else "sm90") if plan.variant.sm90 else "sm80",
    }
    reps = 4 if quick else 10

    def ours():
        plan.run(as_arg(q), 0, out=as_arg(out))

    def record(name, fn):
        try:
            us = event_us(fn, reps=reps)
            row[f"{name}_us"] = round(us, 2)
            row[f"{name}_tflops"] = round(flops / (us * 1e-6) / 1e12, 1)
            row[f"{name}_frac_dense"] = round(row[f"{name}_tflops"] / dense_tflops, 3)
        except Exception as e:  # a peer may refuse a shape
            row[f"{name}_us"] = None
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]

    record("kvpool", ours)
    record("kvpool_repeat", ours)  # noise check
    ours_out = out.float().clone()
    for kernel, p in forced.items():
        name = f"kvpool_{kernel}"
        if isinstance(p, str):
            row[f"{name}_us"] = None
            row[f"{name}_error"] = p
            continue
        row[f"{name}_rows_per_cta"], row[f"{name}_num_splits"] = p.rows_per_cta, p.num_splits
        kout = torch.empty_like(q)
        p.run(as_arg(q), 0, out=as_arg(kout))
        torch.cuda.synchronize()
        row[f"max_abs_diff_{name}_vs_default"] = float((kout.float() - ours_out).abs().max())
        record(name, lambda p=p, kout=kout: p.run(as_arg(q), 0, out=as_arg(kout)))

    if kvpool_only:  # peers measured in another run
        return _finish(row)
    try:
        import flashinfer

        kv_indptr = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda") * blocks_per_seq
        last = torch.full(
            (num_seqs,), seq_len - (blocks_per_seq - 1) * BS, dtype=torch.int32, device="cuda"
        )
        for backend in ("fa2", "fa3"):
            name = f"flashinfer_{backend}"
            try:
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD", backend=backend
                )
                w.plan(
                    indptr_t,
                    kv_indptr,
                    tables_t.reshape(-1),
                    last,
                    hq,
                    HKV,
                    d,
                    BS,
                    causal=True,
                    q_data_type=tdt,
                    kv_data_type=tdt,
                )
                fout = torch.empty_like(q)
                w.run(q, cache, out=fout)
                torch.cuda.synchronize()
                row[f"max_abs_diff_vs_{name}"] = float((fout.float() - ours_out).abs().max())
                record(name, lambda w=w, fout=fout: w.run(q, cache, out=fout))
            except Exception as e:
                row[f"{name}_us"] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    except Exception as e:  # not installed, or its import failed
        row["flashinfer_fa2_us"] = row["flashinfer_fa3_us"] = None
        row["flashinfer_error"] = f"not run: {e}"[:300]
    torch.cuda.synchronize()

    # SDPA on contiguous K/V (sequences of equal length: a plain batch, no varlen needed).
    pages = cache[tables_t.long()]  # [S, blocks, 2, BS, HKV, d]
    k = pages[:, :, 0].reshape(num_seqs, -1, HKV, d)[:, :seq_len].transpose(1, 2).contiguous()
    v = pages[:, :, 1].reshape(num_seqs, -1, HKV, d)[:, :seq_len].transpose(1, 2).contiguous()
    del pages
    q4 = q.view(num_seqs, qo, hq, d).transpose(1, 2)
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(qo, seq_len) if prefix else None
    expanded = {}

    def kv_for(gqa):
        if gqa:
            return k, v
        if not expanded:  # the backend refused enable_gqa: repeat the KV heads instead
            expanded["k"] = k.repeat_interleave(hq // HKV, dim=1)
            expanded["v"] = v.repeat_interleave(hq // HKV, dim=1)
        return expanded["k"], expanded["v"]

    for name, backend in (
        ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
        ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
    ):

        def sdpa(backend=backend, gqa=True):
            kk, vv = kv_for(gqa)
            with sdpa_kernel([backend]):
                if mask is None:
                    return F.scaled_dot_product_attention(
                        q4, kk, vv, is_causal=True, enable_gqa=gqa
                    )
                return F.scaled_dot_product_attention(q4, kk, vv, attn_mask=mask, enable_gqa=gqa)

        for gqa in (True, False):
            try:
                ref = sdpa(gqa=gqa)
                torch.cuda.synchronize()
                row[f"max_abs_diff_vs_{name}"] = float(
                    (ref.transpose(1, 2).reshape(-1, hq, d).float() - ours_out).abs().max()
                )
                row[f"{name}_kv"] = "enable_gqa" if gqa else "KV heads repeated"
                record(name, lambda gqa=gqa, sdpa=sdpa: sdpa(gqa=gqa))
                break
            except Exception as e:
                row[f"{name}_us"] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    expanded.clear()
    return _finish(row)


def _finish(row):
    fa2 = row.get("flashinfer_fa2_us")
    row["speedup_vs_fa2"] = round(fa2 / row["kvpool_us"], 3) if fa2 and row["kvpool_us"] else None
    peers = [
        row.get(f"{p}_us")
        for p in ("flashinfer_fa2", "flashinfer_fa3", "sdpa_flash", "sdpa_cudnn")
        if row.get(f"{p}_us")
    ]
    row["speedup_vs_best_peer"] = (
        round(min(peers) / row["kvpool_us"], 3) if peers and row["kvpool_us"] else None
    )
    torch.cuda.empty_cache()
    cp.get_default_memory_pool().free_all_blocks()
    return row


def _write_doc(args, prov, dense, rows):
    try:
        import flashinfer

        fi_version = flashinfer.__version__
    except Exception as e:
        fi_version = f"not run ({type(e).__name__})"
    doc = {
        "benchmark": "paged prefill attention, causal, TFLOP/s of causal FLOPs",
        "provenance": prov,
        "grid": args.grid,
        "head_dims": list(args.head_dims),
        "groups": list(args.groups),
        "flashinfer": fi_version,
        "dense_matmul_tflops": {k: round(v, 1) for k, v in dense.items()},
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return doc


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="the JSON to write")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument(
        "--kvpool-only", action="store_true", help="our kernels alone (no FlashInfer, no SDPA)"
    )
    ap.add_argument("--grid", choices=sorted(GRIDS), default="default", help="which shapes")
    ap.add_argument("--head-dims", type=_ints, default=(D,), help="e.g. 64,128,256")
    ap.add_argument(
        "--groups", type=_ints, default=(HQ // HKV,), help=f"GQA groups over {HKV} KV heads"
    )
    args = ap.parse_args(argv)
    prov = provenance.provenance("bench/routines/prefill.py")
    dense = {
        dt: matmul_tflops(torch.bfloat16 if dt == "bfloat16" else torch.float16)
        for dt in ("float16", "bfloat16")
    }
    rows = []
    for label, n, qo, prefix, dtype, hq, d in grid_rows(args.grid, args.head_dims, args.groups):
        try:
            rows.append(
                bench_shape(
                    label, n, qo, prefix, dtype, dense[dtype], args.quick, args.kvpool_only, hq, d
                )
            )
        except Exception as e:
            traceback.print_exc()
            rows.append(
                {
                    "shape": label,
                    "dtype": dtype,
                    "num_q_heads": hq,
                    "head_dim": d,
                    "error": f"{type(e).__name__}: {e}",
                }
            )
        r = rows[-1]
        print(
            f"{label:>22} {dtype:8} D{d} Hq{hq} ours {r.get('kvpool_tflops')} TF/s "
            f"({r.get('kernel')}; sm80 {r.get('kvpool_sm80_tflops')} sm90 "
            f"{r.get('kvpool_sm90_tflops')} sm90_tma {r.get('kvpool_sm90_tma_tflops')}) fa2 {r.get('flashinfer_fa2_tflops')} fa3 "
            f"{r.get('flashinfer_fa3_tflops')} sdpa flash {r.get('sdpa_flash_tflops')} cudnn "
            f"{r.get('sdpa_cudnn_tflops')} x fa2 {r.get('speedup_vs_fa2')}",
            flush=True,
        )
        # Written again after every row: a run cut short by its time limit keeps its rows.
        doc = _write_doc(args, prov, dense, rows)
    print(f"dense matmul TFLOP/s: {doc['dense_matmul_tflops']}")
