"""MLA extend on the GPU (DeepSeek-V3 shape: latent 512 + rope 64, bfloat16, 64-token pages,
causal): kvpool's mla_extend_plan against FlashInfer 0.5.3's BatchMLAPagedAttentionWrapper
(fa2 and fa3 backends, causal=True: the same bottom-right alignment), same pages, same run.

Per shape (batch x cached context x qo_len x heads): every sequence holds `context` cached
tokens plus its `qo_len` new ones (seq_len = context + qo_len), one latent layer over a pool
made from a ModelKvSpec, the pages shuffled. qo_len 4 is a speculative-verify step, 512 a
chunk of a chunked prefill.
- `kvpool_us` (the plan's default row tile) and `kvpool_tile{16,32,64}_us` (each forced),
  `flashinfer_{fa2,fa3}_us`: CUDA-graph replays (bench/timing.py graph_us); the
  wrapper planned once on its own contiguous ckv [pages, 64, 512] / kpe [pages, 64, 64] caches
  holding the same pages;
- `*_tflops`: causal FLOPs (per query and head, 2 x (576 + 512) per key it sees) per second;
  `dense_bf16_tflops`: a bf16 8192^3 torch.matmul in the same run;
- `*_frac_of_read_ceiling`: the latent bytes of every sequence (read at least once) / time /
  `read_ceiling_tb_s` (bench/routines/ceiling.cu streaming that many bytes; at most 8 GiB);
- `*_max_abs_diff`: FlashInfer's output against ours.
Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import traceback

import cupy as cp
import numpy as np
import torch
from kvpool import KvGroup, ModelKvSpec, Pool
from kvpool.kernels import mla_extend_plan
from provenance import provenance
from timing import graph_us

from routines.mla import flashinfer_mla, read_ceiling

# (batch, cached context, qo_len, heads)
SHAPES = (
    (64, 4096, 4, 16),
    (64, 4096, 4, 128),
    (4, 4096, 512, 16),
    (2, 4096, 512, 128),
)
BS, DTYPE, SCALE = 64, "bfloat16", 1 / math.sqrt(192)
ROW = 2 * 576


def dense_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = graph_us([lambda s: torch.matmul(a, b)], reps=10, inner=4)
    return 2 * 8192**3 / (us * 1e-6) / 1e12


def bench_shape(batch, ctx, qo_len, heads, flashinfer, ceiling):
    seq_len = ctx + qo_len
    per_seq = -(-seq_len // BS)
    pages = batch * per_seq
    spec = ModelKvSpec([KvGroup.mla_latent([0], 512, 64, DTYPE)])
    pool = Pool.for_spec(spec, pages, device="cuda")
    slab = cp.ndarray(
        (pages, BS, 576),
        cp.int16,
        cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(pool.base_ptr, pages * BS * ROW, pool), 0),
    )
    cache = torch.from_dlpack(slab).view(torch.bfloat16)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(batch * seq_len + heads)
    cache.copy_(torch.randn(cache.shape, device="cuda", generator=gen).to(torch.bfloat16))
    rng = np.random.default_rng(batch + heads + qo_len)
    perm = rng.permutation(pages).astype(np.int32)
    tables = torch.from_numpy(perm.reshape(batch, per_seq)).cuda()
    lens_host = np.full(batch, seq_len, np.int32)
    indptr_host = np.arange(batch + 1, dtype=np.int32) * qo_len
    total_q = batch * qo_len
    qn = torch.randn(total_q, heads, 512, device="cuda", generator=gen).to(torch.bfloat16)
    qp = torch.randn(total_q, heads, 64, device="cuda", generator=gen).to(torch.bfloat16)
    kv_bytes = batch * seq_len * ROW
    # Keys seen: query j of a sequence sees ctx + j + 1.
    keys = batch * sum(ctx + j + 1 for j in range(qo_len))
    flops = 2 * keys * heads * (576 + 512)
    row = dict(
        batch=batch,
        context=ctx,
        qo_len=qo_len,
        seq_len=seq_len,
        heads=heads,
        latent_bytes=kv_bytes,
        causal_flops=flops,
    )
    outs = {}

    def ours(tile):
        plans = {}
        out = outs[tile] = torch.empty(total_q, heads, 512, dtype=torch.bfloat16, device="cuda")

        def call(s):
            key = s.cuda_stream
            if key not in plans:
                plans[key] = mla_extend_plan(
                    pool,
                    spec,
                    0,
                    indptr_host,
                    tables,
                    lens_host,
                    heads,
                    scale=SCALE,
                    stream=s,
                    head_tile=tile,
                )
            plans[key].run(qn, qp, 0, out=out)

        return call, plans

    for tile in (16, 32, 64, None):
        call, plans = ours(tile)
        us = round(graph_us([call]), 2)
        p = next(iter(plans.values()))
        row["kvpool_us" if tile is None else f"kvpool_tile{tile}_us"] = us
        if tile is None:
            row["kvpool_plan"] = dict(
                head_tile=p.variant.heads_per_cta,
                num_splits=p.num_splits,
                ctas=p.ctas_per_seq * p.num_splits * batch,
            )
        plans.clear()
    ref = outs[None].float()
    for tile in (16, 32, 64):
        row[f"tile{tile}_max_abs_diff_vs_default"] = float((outs[tile].float() - ref).abs().max())
    if flashinfer is not None:
        qo_indptr = torch.from_numpy(indptr_host).cuda()
        lens = torch.from_numpy(lens_host).cuda()
        flashinfer_mla(row, flashinfer, cache, tables, qo_indptr, lens, qn, qp, ref, causal=True)
    for key in [k for k in row if k.endswith("_us")]:
        sec = row[key] * 1e-6
        row[f"{key[:-3]}_tflops"] = round(flops / sec / 1e12, 1)
        row[f"{key[:-3]}_tb_s"] = round(kv_bytes / sec / 1e12, 4)
        row[f"{key[:-3]}_frac_of_read_ceiling"] = round(kv_bytes / sec / 1e12 / ceiling, 4)
    fis = [row[k] for k in ("flashinfer_fa2_us", "flashinfer_fa3_us") if k in row]
    row["speedup_vs_best_flashinfer"] = round(min(fis) / row["kvpool_us"], 3) if fis else None
    torch.cuda.empty_cache()
    cp.get_default_memory_pool().free_all_blocks()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    out = ap.parse_args(argv).out
    try:
        import flashinfer
        import flashinfer.mla
    except Exception as e:
        print("flashinfer import failed:", repr(e), flush=True)
        flashinfer = None
    biggest = max(b * (c + q) * ROW for b, c, q, _ in SHAPES)
    ceiling = read_ceiling(min(max(biggest, 1 << 30), 8 << 30))
    result = {
        "provenance": provenance("bench/routines/mla_extend.py"),
        "shape": dict(dtype=DTYPE, latent_dim=512, rope_dim=64, page_size=BS, sm_scale=SCALE),
        "timing": "median of 20 CUDA-graph replays of 8 calls (bench/timing.py graph_us)",
        "flashinfer": getattr(flashinfer, "__version__", None),
        "read_ceiling_tb_s": round(ceiling, 4),
        "dense_bf16_tflops": round(dense_tflops(), 1),
        "rows": [],
    }
    for shape in SHAPES:
        try:
            row = bench_shape(*shape, flashinfer, ceiling)
        except Exception as e:
            traceback.print_exc()
            row = {"shape": shape, "error": f"{type(e).__name__}: {e}"[:600]}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return 0
