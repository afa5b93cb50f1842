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
one input set of >= 300 MB, 5x the H200's L2, so no rotation is needed (a shape whose latent
bytes fit in the L2, `--shapes 1x8192x128`, is marked `l2_resident`: its reads may hit there).

With `--fp8`, per shape also the fp8 latent group (float8_e4m3fn, one scale per layer, the same
values written through mla_append_latent with scale amax / 448): `kvpool_fp8_us` (its
`*_tb_s` / `*_frac_*` over the fp8 bytes, half the bf16's), `fp8_speedup_vs_bf16`, the
largest relative error per (sequence, head) against the float64 reference of the dequantized
cache on the first and last sequences, and FlashInfer's wrapper planned with
kv_data_type=torch.float8_e4m3fn over fp8 copies of its caches (`flashinfer_fp8_<b>_us`, or
the error it raised; it takes no scale, so its output is not compared).
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
from kvpool import KvGroup, ModelKvSpec, Pool, reference
from kvpool.kernels import MlaScales, mla_append_latent, mla_decode_plan
from provenance import provenance
from timing import graph_us

HERE = Path(__file__).resolve().parent
SHAPES = ((64, 4096, 128), (128, 4096, 128), (64, 4096, 16), (128, 8192, 16), (64, 8192, 64))
BS, DTYPE, SCALE = 64, "bfloat16", 1 / math.sqrt(192)
ROW = 2 * 576
L2_BYTES = 60 << 20  # the H200's L2 (about 60 MB)
FP8 = "float8_e4m3fn"


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


def flashinfer_mla(
    row, flashinfer, cache, tables, qo_indptr, lens, qn, qp, ref, *, causal, kv_fp8=False
):
    """FlashInfer's BatchMLAPagedAttentionWrapper (fa2 and fa3 backends) over the pages
    ``tables`` [batch, pages a sequence] names in ``cache`` [pages, BS, 576] (copied to its own
    contiguous ckv [pages, BS, 512] / kpe [pages, BS, 64] caches), planned once for the
    sequences' ``qo_indptr`` query rows (one a sequence for decode) and ``lens`` tokens, with
    ``causal`` masking; each backend's CUDA-graph time goes to ``row["flashinfer_<b>_us"]``
    and its output's largest difference from ``ref`` (ours, float) to
    ``row["flashinfer_<b>_max_abs_diff"]``, or its error to ``row["flashinfer_<b>_error"]``.
    kv_fp8: ``cache`` is our fp8 pool's torch.float8_e4m3fn view (keys ``flashinfer_fp8_<b>_*``,
    no output comparison: the wrapper takes no dequantization scale)."""
    ckv = cache[:, :, :512].contiguous()
    kpe = cache[:, :, 512:].contiguous()
    kv_type, tag = (
        (torch.float8_e4m3fn, "flashinfer_fp8") if kv_fp8 else (torch.bfloat16, "flashinfer")
    )
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
                kv_type,
            )
            fout = torch.empty(rows, heads, 512, dtype=torch.bfloat16, device="cuda")
            row[f"{tag}_{backend}_us"] = round(
                graph_us([lambda s, w=w, fout=fout: w.run(qn, qp, ckv, kpe, out=fout)]), 2
            )
            if not kv_fp8:
                row[f"{tag}_{backend}_max_abs_diff"] = float((fout.float() - ref).abs().max())
        except Exception as e:
            traceback.print_exc()
            row[f"{tag}_{backend}_error"] = f"{type(e).__name__}: {e}"[:600]


def decode_call(pool, spec, tables, lens, heads, ctx, qn, qp, out, **options):
    """A ``graph_us`` callable running kvpool's MLA decode of group 0 into ``out`` on the
    stream it is given (a plan per stream, made on its first call, with ``options``:
    ``head_tile``, ``scales``), and the plans made."""
    plans = {}

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
                **options,
            )
        plans[key].run(qn, qp, 0, out=out)

    return call, plans


def fp8_rows(row, cache, tables, lens, qn, qp, out_bf16, flashinfer):
    """The fp8 latent group's figures for one shape (see the module docstring), into `row`."""
    batch, heads = qn.shape[0], qn.shape[1]
    pages, ctx = cache.shape[0], int(lens[0])
    spec = ModelKvSpec([KvGroup.mla_latent([0], 512, 64, FP8)])
    pool = Pool.for_spec(spec, pages, device="cuda")
    scales = MlaScales(pool, spec, 0)
    scale = float(cache.abs().max()) / 448
    scales.set(0, scale)
    slots = torch.arange(pages * BS, dtype=torch.int64, device="cuda")  # page p: slots 64p..
    mla_append_latent(pool, spec, 0, cache.reshape(pages * BS, 576), slots, scales=scales)
    out = torch.empty(batch, heads, 512, dtype=torch.bfloat16, device="cuda")
    call, plans = decode_call(pool, spec, tables, lens, heads, ctx, qn, qp, out, scales=scales)
    row["kvpool_fp8_us"] = round(graph_us([call]), 2)
    p = next(iter(plans.values()))
    row["kvpool_fp8_plan"] = dict(head_tile=p.variant.heads_per_cta, num_splits=p.num_splits)
    row["fp8_scale"] = scale
    row["fp8_speedup_vs_bf16"] = round(row["kvpool_us"] / row["kvpool_fp8_us"], 3)
    row["fp8_vs_bf16_max_abs_diff"] = float((out.float() - out_bf16.float()).abs().max())
    codes = cp.ndarray(
        (pages, BS, 576),
        cp.uint8,
        cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(pool.base_ptr, pages * BS * 576, pool), 0),
    )
    pt, sl = tables.cpu().numpy(), lens.cpu().numpy()
    errs = []
    for i in sorted({0, batch - 1}):
        qn_i = qn[i : i + 1].view(torch.int16).cpu().numpy().view(np.uint16)
        qp_i = qp[i : i + 1].view(torch.int16).cpu().numpy().view(np.uint16)
        own = cp.asnumpy(codes[cp.asarray(pt[i])])  # the sequence's pages, in table order
        want = reference.mla_decode_reference(
            qn_i,
            qp_i,
            own,
            np.arange(len(pt[i]))[None, :],
            sl[i : i + 1],
            SCALE,
            "bfloat16",
            kv_dtype=FP8,
            kv_scale=scale,
        )
        got = out[i : i + 1].float().cpu().numpy()
        denom = np.maximum(np.abs(want).max(axis=2), 1e-30)
        errs.append(float((np.abs(got - want).max(axis=2) / denom).max()))
    row["fp8_max_rel_err_vs_float64"] = max(errs)
    if flashinfer is not None:
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        c8 = torch.from_dlpack(codes).view(torch.float8_e4m3fn)
        flashinfer_mla(
            row,
            flashinfer,
            c8,
            tables,
            qo_indptr,
            lens,
            qn,
            qp,
            None,
            causal=False,
            kv_fp8=True,
        )


def bench_shape(batch, ctx, heads, flashinfer, fp8=False):
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
    row = dict(
        batch=batch,
        context=ctx,
        heads=heads,
        latent_bytes=kv_bytes,
        l2_resident=kv_bytes <= L2_BYTES,  # fits in L2: its reads may hit there
    )
    outs = {}

    def ours(tile):
        out = torch.empty(batch, heads, 512, dtype=torch.bfloat16, device="cuda")
        outs[tile] = out
        return decode_call(pool, spec, tables, lens, heads, ctx, qn, qp, out, head_tile=tile)

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
    if fp8:
        fp8_rows(row, cache, tables, lens, qn, qp, outs[None], flashinfer)
    for key in [k for k in row if k.endswith("_us") and k != "copy_us"]:
        nbytes = kv_bytes // 2 if "fp8" in key else kv_bytes  # an fp8 row: 576 bytes
        row[f"{key[:-3]}_tb_s"] = round(nbytes / (row[key] * 1e-6) / 1e12, 4)
        row[f"{key[:-3]}_frac_of_read_ceiling"] = round(
            nbytes / (row[key] * 1e-6) / 1e12 / row["read_ceiling_tb_s"], 4
        )
        row[f"{key[:-3]}_frac_of_copy_read"] = round(
            row["copy_us"] * nbytes / kv_bytes / row[key], 4
        )
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
    ap.add_argument("--fp8", action="store_true", help="also the fp8 (e4m3) latent group")
    ap.add_argument(
        "--shapes",
        default=",".join(f"{b}x{c}x{h}" for b, c, h in SHAPES),
        help="batch x context x heads, comma-separated",
    )
    args = ap.parse_args(argv)
    out = args.out
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
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
    for shape in shapes:
        try:
            row = bench_shape(*shape, flashinfer, fp8=args.fp8)
        except Exception as e:
            traceback.print_exc()
            row = {"shape": shape, "error": f"{type(e).__name__}: {e}"[:600]}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return 0
