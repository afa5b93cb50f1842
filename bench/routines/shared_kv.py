"""head_dim 512 K = V attention on the GPU (Gemma 4 global-layer shape: bfloat16, 32 query heads
on 4 KV heads, 16-token blocks, shuffled): kvpool's shared_kv_decode_plan / shared_kv_extend_plan
against FlashInfer 0.5.3's paged decode (both tensor-core modes) and prefill (fa2) at head_dim
512 where they run, torch SDPA's backends on contiguous copies, and the read ceiling of the
same bytes, same run.

Decode rows (batch x context x heads): `kvpool_us`; `flashinfer_decode{,_tc}_us` (its NHD
paged cache with the K cache passed as both K and V: the same bytes, as K = V allows);
`sdpa_{cudnn,flash,efficient}_us` on k [B, Hkv, L, 512] contiguous with v = k (enable_gqa;
where a backend refuses it, k and v expanded to the query heads, `*_expanded`); `kv_bytes` =
the K rows read once (B * L * Hkv * 512 * 2), `read_ceiling_tb_s` (bench/routines/ceiling.cu
reading that many bytes), `*_frac_of_read_ceiling`.
Extend rows (batch x cached x qo_len): causal, bottom-right (the new tokens are each
sequence's last); `*_tflops` = causal FLOPs (4 x 512 per query, head and key seen) per second,
`dense_bf16_tflops` a bf16 8192^3 matmul in the same run; FlashInfer's prefill wrapper (fa2)
and SDPA with causal_lower_right. `*_max_abs_diff`: a peer's output against ours.
A peer that fails (a head_dim it does not build, a backend that refuses) records its error.
FlashInfer runs in a subprocess with a time limit (`--flashinfer-timeout`, its JIT compile
included), so a long compile costs at most that. CUDA-graph replays (bench/timing.py).
Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import traceback

import cupy as cp
import numpy as np
import torch
from kvpool import KvLayout, Pool
from kvpool.kernels import shared_kv_decode_plan, shared_kv_extend_plan
from provenance import provenance
from timing import graph_us

from routines.mla import read_ceiling
from routines.mla_extend import dense_tflops

BS, D, DTYPE = 16, 512, "bfloat16"
SCALE = 1.0 / math.sqrt(D)
# (batch, context, q heads, kv heads)
DECODE = (
    (1, 32768, 32, 4),
    (16, 4096, 32, 4),
    (64, 4096, 32, 4),
    (128, 4096, 32, 4),
    (8, 16384, 32, 4),
    (32, 4096, 8, 8),
)
# (batch, cached, qo_len, q heads, kv heads)
EXTEND = (
    (1, 0, 4096, 32, 4),
    (4, 2048, 1024, 32, 4),
    (64, 4096, 4, 32, 4),
)


def make_pool(batch, seq_len, hkv, seed):
    blocks_per_seq = -(-seq_len // BS)
    pages = batch * blocks_per_seq
    pool = Pool(KvLayout(1, hkv, D, BS, DTYPE), pages, device="cuda")
    k = torch.from_dlpack(cp.asarray(pool.k_view(0)).view(cp.int16)).view(torch.bfloat16)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    k.copy_(torch.randn(k.shape, device="cuda", generator=gen).to(torch.bfloat16))
    perm = np.random.default_rng(seed).permutation(pages).astype(np.int32)
    tables = torch.from_numpy(perm.reshape(batch, blocks_per_seq)).cuda()
    return pool, k, tables, gen


def contiguous_k(k, tables, seq_len):
    """[B, Hkv, L, D] copy of each sequence's K rows."""
    b = tables.shape[0]
    rows = k[tables.long()].reshape(b, -1, k.shape[2], D)[:, :seq_len]
    return rows.permute(0, 2, 1, 3).contiguous()


def sdpa_rows(row, q4, kc, ref_out, mask, prefix, to_out):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    group = q4.shape[1] // kc.shape[1]
    for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        key = f"{prefix}sdpa_{name}"
        for expanded in (False, True):
            try:
                k = kc.repeat_interleave(group, dim=1) if expanded else kc
                kw = dict(attn_mask=mask, scale=SCALE, enable_gqa=not expanded)
                with sdpa_kernel([backend]):
                    o = sdpa(q4, k, k, **kw)
                    row[f"{key}_us"] = round(
                        graph_us([lambda s, k=k, kw=kw: sdpa(q4, k, k, **kw)]), 2
                    )
                row[f"{key}_max_abs_diff"] = float((to_out(o).float() - ref_out).abs().max())
                if expanded:
                    row[f"{key}_expanded"] = True
                row.pop(f"{key}_error", None)
                break
            except Exception as e:
                row[f"{key}_error"] = f"{type(e).__name__}: {e}"[:300]
        torch.cuda.empty_cache()


def bench_decode(batch, ctx, hq, hkv):
    pool, k, tables, gen = make_pool(batch, ctx, hkv, batch * ctx + hq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, D, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = batch * ctx * hkv * D * 2
    row = dict(batch=batch, context=ctx, q_heads=hq, kv_heads=hkv, kv_bytes=kv_bytes)
    plans = {}

    def ours(s):
        if s.cuda_stream not in plans:
            plans[s.cuda_stream] = shared_kv_decode_plan(
                pool, tables, lens, hq, scale=SCALE, max_seq_len=ctx, stream=s
            )
        plans[s.cuda_stream].run(q, 0, out=out)

    row["kvpool_us"] = round(graph_us([ours]), 2)
    p = next(iter(plans.values()))
    row["kvpool_plan"] = dict(
        head_tile=p.variant.heads_per_cta,
        num_splits=p.num_splits,
        ctas=p.ctas_per_seq * p.num_splits * batch,
    )
    ref = out.float().clone()
    row["read_ceiling_tb_s"] = round(read_ceiling(max(kv_bytes, 1 << 26)), 4)
    kc = contiguous_k(k, tables, ctx)
    sdpa_rows(row, q[:, :, None], kc, ref, None, "", lambda o: o[:, :, 0])
    del kc
    torch.cuda.empty_cache()
    row.update(flashinfer_subprocess("decode", (batch, ctx, hq, hkv)))
    for key in [x for x in row if x.endswith("_us")]:
        tb = kv_bytes / (row[key] * 1e-6) / 1e12
        row[f"{key[:-3]}_frac_of_read_ceiling"] = round(tb / row["read_ceiling_tb_s"], 4)
    peers = [v for x, v in row.items() if x.endswith("_us") and x != "kvpool_us"]
    row["speedup_vs_best_peer"] = round(min(peers) / row["kvpool_us"], 3) if peers else None
    return row


def causal_flops(batch, cached, qo, hq):
    seen = sum(cached + j + 1 for j in range(qo))
    return 4 * D * hq * batch * seen


def bench_extend(batch, cached, qo, hq, hkv):
    seq_len = cached + qo
    pool, k, tables, gen = make_pool(batch, seq_len, hkv, batch * seq_len + qo)
    indptr = np.arange(batch + 1, dtype=np.int32) * qo
    lens = np.full(batch, seq_len, dtype=np.int32)
    q = torch.randn(batch * qo, hq, D, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    flops = causal_flops(batch, cached, qo, hq)
    row = dict(batch=batch, cached=cached, qo_len=qo, q_heads=hq, kv_heads=hkv, flops=flops)
    plans = {}

    def ours(s):
        if s.cuda_stream not in plans:
            plans[s.cuda_stream] = shared_kv_extend_plan(
                pool, indptr, tables, lens, hq, scale=SCALE, stream=s
            )
        plans[s.cuda_stream].run(q, 0, out=out)

    row["kvpool_us"] = round(graph_us([ours]), 2)
    p = next(iter(plans.values()))
    row["kvpool_plan"] = dict(head_tile=p.variant.heads_per_cta, num_splits=p.num_splits)
    ref = out.float().clone()
    from torch.nn.attention.bias import causal_lower_right

    kc = contiguous_k(k, tables, seq_len)
    q4 = q.reshape(batch, qo, hq, D).permute(0, 2, 1, 3).contiguous()
    mask = causal_lower_right(qo, seq_len)
    sdpa_rows(row, q4, kc, ref, mask, "", lambda o: o.permute(0, 2, 1, 3).reshape(-1, hq, D))
    del kc
    torch.cuda.empty_cache()
    row.update(flashinfer_subprocess("extend", (batch, cached, qo, hq, hkv)))
    for key in [x for x in row if x.endswith("_us")]:
        row[f"{key[:-3]}_tflops"] = round(flops / (row[key] * 1e-6) / 1e12, 1)
    peers = [v for x, v in row.items() if x.endswith("_us") and x != "kvpool_us"]
    row["speedup_vs_best_peer"] = round(min(peers) / row["kvpool_us"], 3) if peers else None
    return row


# -- FlashInfer (in a subprocess: its JIT compile is bounded by --flashinfer-timeout) -----------

FI_TIMEOUT = [90.0]
FI_DEADLINE: list[float] = []


def flashinfer_subprocess(kind, shape):
    import time

    if not FI_DEADLINE:
        FI_DEADLINE.append(time.monotonic() + FI_TIMEOUT[0])
    left = FI_DEADLINE[0] - time.monotonic()
    if left < 5:
        return {"flashinfer_error": "skipped: the FlashInfer time budget of this run is spent"}
    cmd = [sys.executable, __file__, "--flashinfer-child", kind, json.dumps(shape)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=env)
    except subprocess.TimeoutExpired:
        return {"flashinfer_error": f"timed out after {left:.0f} s (JIT compile included)"}
    lines = [x for x in res.stdout.splitlines() if x.startswith("{")]
    if not lines:
        return {"flashinfer_error": f"rc {res.returncode}: {res.stderr[-400:]}"}
    return json.loads(lines[-1])


def flashinfer_child(kind, shape):
    row = {}
    try:
        import flashinfer

        row["flashinfer_version"] = flashinfer.__version__
    except Exception as e:
        print(json.dumps({"flashinfer_error": f"import: {e!r}"[:300]}))
        return
    if kind == "decode":
        batch, ctx, hq, hkv = shape
        pool, k, tables, gen = make_pool(batch, ctx, hkv, batch * ctx + hq)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, hq, D, device="cuda", generator=gen).to(torch.bfloat16)
        ours = shared_kv_decode_plan(pool, tables, lens, hq, scale=SCALE, max_seq_len=ctx)
        ref = ours.run(q, 0).float()
        per = ctx // BS
        indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * per
        last = torch.full((batch,), (ctx - 1) % BS + 1, dtype=torch.int32, device="cuda")
        for tc in (False, True):
            key = "flashinfer_decode_tc" if tc else "flashinfer_decode"
            try:
                ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
                w.plan(
                    indptr,
                    tables.reshape(-1),
                    last,
                    hq,
                    hkv,
                    D,
                    BS,
                    sm_scale=SCALE,
                    q_data_type=torch.bfloat16,
                    kv_data_type=torch.bfloat16,
                )
                o = torch.empty_like(q)
                w.run(q, (k, k), out=o)
                row[f"{key}_us"] = round(graph_us([lambda s, w=w, o=o: w.run(q, (k, k), out=o)]), 2)
                row[f"{key}_max_abs_diff"] = float((o.float() - ref).abs().max())
            except Exception as e:
                traceback.print_exc()
                row[f"{key}_error"] = f"{type(e).__name__}: {e}"[:400]
    else:
        batch, cached, qo, hq, hkv = shape
        seq_len = cached + qo
        pool, k, tables, gen = make_pool(batch, seq_len, hkv, batch * seq_len + qo)
        ip = np.arange(batch + 1, dtype=np.int32) * qo
        lens = np.full(batch, seq_len, dtype=np.int32)
        q = torch.randn(batch * qo, hq, D, device="cuda", generator=gen).to(torch.bfloat16)
        ref = shared_kv_extend_plan(pool, ip, tables, lens, hq, scale=SCALE).run(q, 0).float()
        per = -(-seq_len // BS)
        kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * per
        last = torch.full((batch,), (seq_len - 1) % BS + 1, dtype=torch.int32, device="cuda")
        try:
            ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
            w.plan(
                torch.from_numpy(ip).cuda(),
                kv_indptr,
                tables.reshape(-1),
                last,
                hq,
                hkv,
                D,
                BS,
                causal=True,
                sm_scale=SCALE,
                q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16,
            )
            o = torch.empty_like(q)
            w.run(q, (k, k), out=o)
            row["flashinfer_fa2_us"] = round(graph_us([lambda s: w.run(q, (k, k), out=o)]), 2)
            row["flashinfer_fa2_max_abs_diff"] = float((o.float() - ref).abs().max())
        except Exception as e:
            traceback.print_exc()
            row["flashinfer_fa2_error"] = f"{type(e).__name__}: {e}"[:400]
    print(json.dumps(row), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--flashinfer-timeout", type=float, default=90.0)
    ap.add_argument("--flashinfer-child", nargs=2, metavar=("KIND", "SHAPE"))
    args = ap.parse_args(argv)
    if args.flashinfer_child:
        flashinfer_child(args.flashinfer_child[0], json.loads(args.flashinfer_child[1]))
        return 0
    if not args.out:
        ap.error("--out is required")
    FI_TIMEOUT[0] = args.flashinfer_timeout
    result = {
        "provenance": provenance("bench/routines/shared_kv.py"),
        "shape": dict(dtype=DTYPE, head_dim=D, block_size=BS, sm_scale=SCALE, k_eq_v=True),
        "timing": "median of 20 CUDA-graph replays of 8 calls (bench/timing.py graph_us)",
        "dense_bf16_tflops": None,
        "decode": [],
        "extend": [],
    }
    try:
        result["dense_bf16_tflops"] = round(dense_tflops(), 1)
    except Exception as e:
        result["dense_error"] = repr(e)[:300]
    for kind, shapes, fn in (("decode", DECODE, bench_decode), ("extend", EXTEND, bench_extend)):
        for shape in shapes:
            try:
                row = fn(*shape)
            except Exception as e:
                traceback.print_exc()
                row = {"shape": shape, "error": f"{type(e).__name__}: {e}"[:600]}
            result[kind].append(row)
            print(json.dumps(row), flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            torch.cuda.empty_cache()
            cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.dirname(here)]
    sys.exit(main())
