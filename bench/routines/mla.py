"""MLA decode on the GPU (DeepSeek-V3 shape: latent 512 + rope 64, bfloat16, 64-token pages):
kvpool's paged_mla_decode against FlashInfer 0.5.3's BatchMLAPagedAttentionWrapper (fa2 and
fa3 backends) and against the read ceilings of the same bytes, same run.

Per shape (batch x context x heads), one latent layer of batch * context tokens over a pool
made from a ModelKvSpec, the pages shuffled:
- `kvpool_us` (and `kvpool_tile{16,32,64}_us`: each head tile the plan can take);
- `flashinfer_{fa2,fa3}_us`: the wrapper planned once, run on the same data as its own
  contiguous ckv [pages, 64, 512] and kpe [pages, 64, 64] caches (its layout), same pages;
- `copy_us`: a device-to-device copy of the latent bytes (cudaMemcpyAsync), `copy_read_tb_s`
  the bytes it reads per second; `read_ceiling_tb_s`: bench/routines/ceiling.cu streaming the
  same number of bytes (a read-only kernel, the decode's own kind of traffic).
`*_frac` = latent bytes / time / ceiling. All times are CUDA-graph replays (bench/timing.py);
one input set of >= 300 MB, 5x the H200's L2, so no rotation is needed.
Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import traceback
from pathlib import Path

import cupy as cp
import numpy as np
import torch
from kvpool import KvGroup, ModelKvSpec, Pool
from kvpool.kernels import mla_decode_plan
from provenance import provenance
from timing import graph_us

HERE = Path(__file__).resolve().parent
SHAPES = ((64, 4096, 128), (128, 4096, 128), (64, 4096, 16), (128, 8192, 16), (64, 8192, 64))
BS, DTYPE, SCALE = 64, "bfloat16", 1 / math.sqrt(192)
ROW = 2 * 576


def read_ceiling(nbytes):
    """TB/s of bench/routines/ceiling.cu reading `nbytes` (best of a small grid sweep)."""
    mod = cp.RawModule(code=(HERE / "ceiling.cu").read_text(), options=("-std=c++17",))
    k = mod.get_function("read_ceiling")
    buf = cp.ones(nbytes // 4, dtype=cp.uint32)
    sink = cp.zeros(1, dtype=cp.uint32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    best = 0.0
    for per_sm in (4, 8, 16):
        for threads in (512, 1024):
            args = (buf, np.uint64(nbytes // 16), sink)
            k((sms * per_sm,), (threads,), args)
            ts = []
            for _ in range(7):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record()
                k((sms * per_sm,), (threads,), args)
                b.record()
                b.synchronize()
                ts.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
            best = max(best, nbytes / statistics.median(ts) / 1e12)
    del buf
    return best


def flashinfer_mla(row, flashinfer, cache, tables, qo_indptr, lens, qn, qp, ref, *, causal):
    """FlashInfer's BatchMLAPagedAttentionWrapper (fa2 and fa3 backends) over the pages
    ``tables`` [batch, pages a sequence] names in ``cache`` [pages, BS, 576] (copied to its own
    contiguous ckv [pages, BS, 512] / kpe [pages, BS, 64] caches), planned once for the
    sequences' ``qo_indptr`` query rows (one a sequence for decode) and ``lens`` tokens, with
    ``causal`` masking; each backend's CUDA-graph time goes to ``row["flashinfer_<b>_us"]``
    and its output's largest difference from ``ref`` (ours, float) to
    ``row["flashinfer_<b>_max_abs_diff"]``, or its error to ``row["flashinfer_<b>_error"]``."""
    ckv = cache[:, :, :512].contiguous()
    kpe = cache[:, :, 512:].contiguous()
    batch, pages_per_seq = tables.shape
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages_per_seq
    kv_indices = tables.reshape(-1).contiguous()
    rows, heads = qn.shape[0], qn.shape[1]
    for backend in ("fa2", "fa3"):
        try:
            ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
            w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=backend)
            w.plan(
                qo_indptr,
                kv_indptr,
                kv_indices,
                lens,
                heads,
                512,
                64,
                BS,
                causal,
                SCALE,
                torch.bfloat16,
                torch.bfloat16,
            )
            fout = torch.empty(rows, heads, 512, dtype=torch.bfloat16, device="cuda")
            row[f"flashinfer_{backend}_us"] = round(
                graph_us([lambda s, w=w, fout=fout: w.run(qn, qp, ckv, kpe, out=fout)]), 2
            )
            row[f"flashinfer_{backend}_max_abs_diff"] = float((fout.float() - ref).abs().max())
        except Exception as e:
            traceback.print_exc()
            row[f"flashinfer_{backend}_error"] = f"{type(e).__name__}: {e}"[:600]


def bench_shape(batch, ctx, heads, flashinfer):
    pages = batch * ctx // BS
    spec = ModelKvSpec([KvGroup.mla_latent([0], 512, 64, DTYPE)])
    assert spec.block_size(0) == BS and spec.page_bytes == BS * ROW
    pool = Pool.for_spec(spec, pages, device="cuda")
    slab = cp.ndarray(
        (pages, BS, 576),
        cp.int16,
        cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(pool.base_ptr, pages * BS * ROW, pool), 0),
    )
    cache = torch.from_dlpack(slab).view(torch.bfloat16)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(batch * ctx + heads)
    cache.copy_(torch.randn(cache.shape, device="cuda", generator=gen).to(torch.bfloat16))
    rng = np.random.default_rng(batch + heads)
    perm = rng.permutation(pages).astype(np.int32)
    tables = torch.from_numpy(perm.reshape(batch, ctx // BS)).cuda()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qn = torch.randn(batch, heads, 512, device="cuda", generator=gen).to(torch.bfloat16)
    qp = torch.randn(batch, heads, 64, device="cuda", generator=gen).to(torch.bfloat16)
    kv_bytes = pages * BS * ROW
    row = dict(batch=batch, context=ctx, heads=heads, latent_bytes=kv_bytes)
    outs = {}

    def ours(tile):
        plans = {}
        out = torch.empty(batch, heads, 512, dtype=torch.bfloat16, device="cuda")
        outs[tile] = out

        def call(s):
            key = s.cuda_stream
            if key not in plans:
                plans[key] = mla_decode_plan(
                    pool,
                    spec,
                    0,
                    tables,
                    lens,
                    heads,
                    scale=SCALE,
                    max_seq_len=ctx,
                    stream=s,
                    head_tile=tile,
                )
            plans[key].run(qn, qp, 0, out=out)

        return call, plans

    for tile in (16, 32, 64, None):
        if tile is not None and tile > 16 and heads <= 16:
            continue
        call, plans = ours(tile)
        us = graph_us([call])
        p = next(iter(plans.values()))
        key = "kvpool_us" if tile is None else f"kvpool_tile{tile}_us"
        row[key] = round(us, 2)
        if tile is None:
            row["kvpool_plan"] = dict(
                head_tile=p.variant.heads_per_cta,
                num_splits=p.num_splits,
                ctas=p.ctas_per_seq * p.num_splits * batch,
            )
    ref = outs[None].float()
    for tile in (16, 32, 64):
        if tile in outs:
            row[f"tile{tile}_max_abs_diff_vs_default"] = float(
                (outs[tile].float() - ref).abs().max()
            )

    flat = torch.from_dlpack(cp.ndarray((kv_bytes,), cp.uint8, slab.data))
    dst = torch.empty_like(flat)
    row["copy_us"] = round(graph_us([lambda s: dst.copy_(flat)]), 2)
    row["copy_read_tb_s"] = round(kv_bytes / (row["copy_us"] * 1e-6) / 1e12, 4)
    row["read_ceiling_tb_s"] = round(read_ceiling(kv_bytes), 4)

    if flashinfer is not None:
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        flashinfer_mla(row, flashinfer, cache, tables, qo_indptr, lens, qn, qp, ref, causal=False)
    for key in [k for k in row if k.endswith("_us") and k != "copy_us"]:
        row[f"{key[:-3]}_tb_s"] = round(kv_bytes / (row[key] * 1e-6) / 1e12, 4)
        row[f"{key[:-3]}_frac_of_read_ceiling"] = round(
            kv_bytes / (row[key] * 1e-6) / 1e12 / row["read_ceiling_tb_s"], 4
        )
        row[f"{key[:-3]}_frac_of_copy_read"] = round(row["copy_us"] / row[key], 4)
    fis = [row[k] for k in ("flashinfer_fa2_us", "flashinfer_fa3_us") if k in row]
    row["speedup_vs_best_flashinfer"] = round(min(fis) / row["kvpool_us"], 3) if fis else None
    flops = 2 * batch * ctx * heads * (576 + 512)
    row["kvpool_tflops"] = round(flops / (row["kvpool_us"] * 1e-6) / 1e12, 1)
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
    result = {
        "provenance": provenance("bench/routines/mla.py"),
        "shape": dict(dtype=DTYPE, latent_dim=512, rope_dim=64, page_size=BS, sm_scale=SCALE),
        "timing": "median of 20 CUDA-graph replays of 8 calls (bench/timing.py graph_us)",
        "flashinfer": getattr(flashinfer, "__version__", None),
        "target": ">= 0.85 of the read ceiling on 64+ sequences x 4k+ tokens",
        "rows": [],
    }
    for shape in SHAPES:
        try:
            row = bench_shape(*shape, flashinfer)
        except Exception as e:
            traceback.print_exc()
            row = {"shape": shape, "error": f"{type(e).__name__}: {e}"[:600]}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return 0
