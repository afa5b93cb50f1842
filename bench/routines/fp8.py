"""fp8 paged decode on the GPU: kvpool's fp8 (e4m3) decode against kvpool's fp16 decode and
FlashInfer's fp8 decode (both modes), same run, on the decode routine's grid (fp16 queries,
Hq 32, Hkv 8, D 128, page 16, shuffled pages, R input rotations beyond L2, CUDA-graph replays).

The fp8 pool and FlashInfer read the very same fp8 pages (FlashInfer's NHD paged cache is our
block layout), with the same per-tensor k/v scales. The fraction of the read ceiling counts the
bytes each method reads (fp8: one byte per element). The ceiling is measured in the same run.
Writes JSON (--out) with one row per shape; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import traceback

import cupy as cp
import kvpool
import numpy as np
import torch
from kvpool.kernels import _tuning, decode_plan, workspace_elems
from provenance import provenance
from shape_grid import measure_grid
from timing import graph_us, rotations

from routines.decode import GRID, HKV, HQ, measure_ceiling, per_stream_plan

D, BS = 128, 16
K_SCALE, V_SCALE = 0.02, 0.01  # the cache holds N(0,1)/scale quantized: codes use the range


def make_pool(dtype, num_blocks, gen):
    """A one-layer pool over shuffled random K/V; returns (pool, torch view of its slab as
    FlashInfer's [num_blocks, 2, bs, Hkv, D] paged cache)."""
    lay = kvpool.KvLayout(1, HKV, D, BS, dtype)
    pool = kvpool.Pool(lay, num_blocks, device="cuda")
    nbytes = num_blocks * lay.strides()["block"]
    raw = cp.ndarray(
        (nbytes,),
        cp.uint8,
        cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(pool.base_ptr, nbytes, pool), 0),
    )
    tdt = torch.float8_e4m3fn if dtype == "float8_e4m3fn" else torch.float16
    cache = torch.from_dlpack(raw).view(tdt).view(num_blocks, 2, BS, HKV, D)
    for b0 in range(0, num_blocks, 4096):  # fill in pieces: no 2x-size temporary
        b1 = min(num_blocks, b0 + 4096)
        x = torch.randn((b1 - b0, 2, BS, HKV, D), device="cuda", generator=gen)
        if dtype == "float8_e4m3fn":  # stored = value / scale, inside e4m3's finite range
            x[:, 0] /= K_SCALE
            x[:, 1] /= V_SCALE
            x.clamp_(-448.0, 448.0)
        cache[b0:b1].copy_(x.to(tdt))
    return pool, cache


def decode_calls(qs, pool, tables, lens_t, out, seq_len, ws, scales, **knobs):
    """One call per rotation r (given the stream): our decode of qs[r] over tables[r] into
    out[r], with fp8 `scales` or None for a 16-bit pool. Each call runs a plan made once per
    stream before the timed calls (per_stream_plan), inside ``_tuning.override(**knobs)``."""

    def call(r):
        def make_plan(s):
            with _tuning.override(**knobs):
                return decode_plan(
                    pool,
                    tables[r],
                    lens_t,
                    HQ,
                    max_seq_len=seq_len,
                    scales=scales,
                    stream=s,
                    workspace=ws,
                )

        return per_stream_plan(make_plan, lambda plan: plan.run(qs[r], 0, out=out[r]))

    return [call(r) for r in range(len(qs))]


def shape_inputs(batch, seq_len):
    """The inputs of one grid shape, seeded by the shape: (lens, K+V elements per rotation,
    rotations, num_blocks, torch generator, block tables and queries per rotation, lens on the
    device). Rotations over disjoint blocks keep the caches out of L2 between timed calls."""
    rng = np.random.default_rng(batch * 31 + seq_len)
    lens = np.full(batch, seq_len, np.int32)
    elems = int(lens.sum()) * HKV * D * 2
    rot = rotations(elems * 2)
    blocks_per_seq = -(-seq_len // BS)
    num_blocks = rot * batch * blocks_per_seq
    gen = torch.Generator(device="cuda")
    gen.manual_seed(batch * 7919 + seq_len)
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = [
        torch.from_numpy(
            perm[r * batch * blocks_per_seq : (r + 1) * batch * blocks_per_seq].reshape(
                batch, blocks_per_seq
            )
        ).cuda()
        for r in range(rot)
    ]
    lens_t = torch.from_numpy(lens).cuda()
    qs = [torch.randn((batch, HQ, D), device="cuda", generator=gen).half() for _ in range(rot)]
    return lens, elems, rot, num_blocks, gen, tables, lens_t, qs


def bench_shape(batch, seq_len, ceiling):
    lens, elems, rot, num_blocks, gen, tables, lens_t, qs = shape_inputs(batch, seq_len)
    row = {
        "shape": f"{batch}x{seq_len}",
        "batch": batch,
        "seq_len": seq_len,
        "head_dim": D,
        "num_q_heads": HQ,
        "num_kv_heads": HKV,
        "block_size": BS,
        "rotations": rot,
        "kv_bytes_fp16": elems * 2,
        "kv_bytes_fp8": elems,
    }
    ws = cp.empty(workspace_elems(batch, HQ, D, 128), cp.float32)
    outs = {}
    for dtype, key in (("float16", "kvpool_fp16"), ("float8_e4m3fn", "kvpool_fp8")):
        pool, cache = make_pool(dtype, num_blocks, gen)
        scales = None
        if dtype != "float16":
            scales = kvpool.KvScales(pool)
            scales.set(0, K_SCALE, V_SCALE)
        out = [torch.empty_like(q) for q in qs]

        row[f"{key}_us"] = graph_us(
            decode_calls(qs, pool, tables, lens_t, out, seq_len, ws, scales)
        )
        torch.cuda.synchronize()
        outs[key] = out[0].float().clone()
        if dtype != "float16":
            bench_flashinfer(row, rot, batch, lens, tables, qs, cache, outs[key])
        del pool, cache
        torch.cuda.empty_cache()
        cp.get_default_memory_pool().free_all_blocks()
    for key, nbytes in (
        ("kvpool_fp16", elems * 2),
        ("kvpool_fp8", elems),
        ("flashinfer_fp8", elems),
        ("flashinfer_tc_fp8", elems),
    ):
        us = row.get(f"{key}_us")
        row[f"{key}_frac"] = round(nbytes / (us * 1e-6) / 1e12 / ceiling, 4) if us else None
    row["fp8_speedup_vs_our_fp16"] = round(row["kvpool_fp16_us"] / row["kvpool_fp8_us"], 3)
    fis = [row[k] for k in ("flashinfer_fp8_us", "flashinfer_tc_fp8_us") if row.get(k)]
    row["fp8_speedup_vs_best_flashinfer_fp8"] = (
        round(min(fis) / row["kvpool_fp8_us"], 3) if fis else None
    )
    return row


def bench_flashinfer(row, rot, batch, lens, tables, qs, cache, ours_out0):
    try:
        import flashinfer
    except ImportError as e:
        row["flashinfer_error"] = f"{type(e).__name__}: {e}"[:300]
        return
    nblk = -(-lens.astype(np.int64) // BS)
    indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(nblk)]).astype(np.int32)).cuda()
    last = torch.from_numpy((lens - (nblk - 1) * BS).astype(np.int32)).cuda()
    for name, tc in (("flashinfer_fp8", False), ("flashinfer_tc_fp8", True)):
        try:
            wrappers = []
            for r in range(rot):
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    torch.empty(128 << 20, dtype=torch.uint8, device="cuda"),
                    "NHD",
                    use_tensor_cores=tc,
                )
                indices = torch.cat([tables[r][i, : nblk[i]] for i in range(batch)])
                w.plan(
                    indptr,
                    indices,
                    last,
                    HQ,
                    HKV,
                    D,
                    BS,
                    q_data_type=torch.float16,
                    kv_data_type=torch.float8_e4m3fn,
                )
                wrappers.append(w)
            fouts = [torch.empty_like(q) for q in qs]

            def fi(r, wrappers=wrappers, fouts=fouts):
                def call(s):
                    wrappers[r].run(qs[r], cache, out=fouts[r], k_scale=K_SCALE, v_scale=V_SCALE)

                return call

            row[f"{name}_us"] = graph_us([fi(r) for r in range(rot)])
            torch.cuda.synchronize()
            wrappers[0].run(qs[0], cache, out=fouts[0], k_scale=K_SCALE, v_scale=V_SCALE)
            row[f"max_abs_diff_vs_{name}"] = float((fouts[0].float() - ours_out0).abs().max())
            row[f"{name}_finite"] = bool(fouts[0].isfinite().all() and ours_out0.isfinite().all())
        except Exception as e:
            row[f"{name}_us"] = None
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            traceback.print_exc()


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON to write")
    out_path = ap.parse_args(argv).out
    ceiling, sweep, torch_sum = measure_ceiling()
    print(f"ceiling {ceiling:.3f} TB/s", flush=True)
    result = {
        "provenance": provenance("bench/routines/fp8.py"),
        "ceiling_tb_s": round(ceiling, 4),
        "torch_sum_tb_s": round(torch_sum, 4),
        "k_scale": K_SCALE,
        "v_scale": V_SCALE,
        "timing": "median of 20 CUDA-graph replays of >= 8 calls rotating over R input sets",
        "torch": torch.__version__,
        "cupy": cp.__version__,
        "rows": [],
    }
    for row in measure_grid(
        GRID, lambda batch, seq_len: bench_shape(batch, seq_len, ceiling), result, out_path
    ):
        print(json.dumps(row), flush=True)
    print(
        f"{'shape':>10} {'fp16 us':>8} {'fp8 us':>8} {'x fp16':>7} {'frac':>6} "
        f"{'FI us':>8} {'FI tc us':>8} {'x FI':>6}"
    )
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['shape']:>10} error {r['error']}")
            continue
        print(
            f"{r['shape']:>10} {r['kvpool_fp16_us']:8.1f} {r['kvpool_fp8_us']:8.1f} "
            f"{r['fp8_speedup_vs_our_fp16']:7.2f} {r['kvpool_fp8_frac'] or 0:6.2f} "
            f"{r.get('flashinfer_fp8_us') or 0:8.1f} {r.get('flashinfer_tc_fp8_us') or 0:8.1f} "
            f"{r.get('fp8_speedup_vs_best_flashinfer_fp8') or 0:6.2f}"
        )
