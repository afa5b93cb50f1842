"""fp8 paged prefill on the GPU: kvpool's prefill over an fp8 (e4m3) cache against the same
kernel over an fp16 cache, same run, same shapes (D 128, Hq 32, Hkv 8, page 16, shuffled pages).

The fp8 path converts K/V to fp16 while loading its shared-memory tiles (synchronous loads,
the simplest correct form), so it is expected at or below the fp16 speed: these rows say how
far, to set the bar for a cp.async + register-conversion version. TFLOP/s of causal FLOPs;
the outputs of both are compared (they differ by fp8 rounding only).

Usage: python3 bench/kvbench.py --routine fp8_prefill [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import cupy as cp
import kvpool
import numpy as np
import torch
from kvpool.kernels import prefill_plan
from provenance import provenance
from timing import event_us

from routines.prefill import BS, HKV, HQ, D, causal_flops

SHAPES = [("1 x 4k", 1, 4096, 0), ("8 x 2k", 8, 2048, 0), ("4 x 2k chunk on 6k", 4, 2048, 6144)]
K_SCALE, V_SCALE = 0.02, 0.01


def run(dtype, num_seqs, qo, prefix):
    seq_len = qo + prefix
    blocks_per_seq = -(-seq_len // BS)
    num_blocks = num_seqs * blocks_per_seq + 8
    pool = kvpool.Pool(kvpool.KvLayout(1, HKV, D, BS, dtype), num_blocks, device="cuda")
    nbytes = num_blocks * pool.layout.strides()["block"]
    raw = cp.ndarray(
        (nbytes,),
        cp.uint8,
        cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(pool.base_ptr, nbytes, pool), 0),
    )
    gen = torch.Generator(device="cuda")
    gen.manual_seed(num_seqs * 7919 + seq_len)
    x = torch.randn((num_blocks, 2, BS, HKV, D), device="cuda", generator=gen)
    scales = None
    if dtype == "float8_e4m3fn":
        x[:, 0] /= K_SCALE
        x[:, 1] /= V_SCALE
        torch.from_dlpack(raw).view(torch.float8_e4m3fn).view(x.shape).copy_(
            x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        )
        scales = kvpool.KvScales(pool)
        scales.set(0, K_SCALE, V_SCALE)
    else:
        torch.from_dlpack(raw).view(torch.float16).view(x.shape).copy_(x.half())
    rng = np.random.default_rng(num_seqs * 31 + seq_len)
    tables = torch.from_numpy(
        rng.permutation(num_blocks)[: num_seqs * blocks_per_seq]
        .astype(np.int32)
        .reshape(num_seqs, blocks_per_seq)
    ).cuda()
    lens = np.full(num_seqs, seq_len, np.int32)
    indptr = np.arange(num_seqs + 1, dtype=np.int32) * qo
    q = torch.randn(num_seqs * qo, HQ, D, device="cuda", generator=gen).half()
    out = torch.empty_like(q)
    # Made once, outside the timed calls; it owns its split workspace.
    plan = prefill_plan(pool, indptr, tables, lens, HQ, scales=scales)

    def call():
        plan.run(q, 0, out=out)

    us = event_us(call)
    return us, out.float().clone(), plan


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON to write")
    out_path = ap.parse_args(argv).out
    result = {
        "provenance": provenance("bench/routines/fp8_prefill.py"),
        "k_scale": K_SCALE,
        "v_scale": V_SCALE,
        "timing": "median of 10 CUDA-event windows of 3 calls",
        "rows": [],
    }
    for label, num_seqs, qo, prefix in SHAPES:
        row = {
            "shape": label,
            "num_seqs": num_seqs,
            "new_tokens": qo,
            "cached_prefix": prefix,
            "head_dim": D,
            "num_q_heads": HQ,
            "num_kv_heads": HKV,
            "block_size": BS,
        }
        try:
            flops = causal_flops(num_seqs, qo, prefix)
            outs = {}
            for dtype, key in (("float16", "kvpool_fp16"), ("float8_e4m3fn", "kvpool_fp8")):
                us, outs[key], plan = run(dtype, num_seqs, qo, prefix)
                row[f"{key}_us"] = round(us, 2)
                row[f"{key}_tflops"] = round(flops / (us * 1e-6) / 1e12, 1)
                torch.cuda.empty_cache()
                cp.get_default_memory_pool().free_all_blocks()
            row["fp8_speedup_vs_our_fp16"] = round(row["kvpool_fp16_us"] / row["kvpool_fp8_us"], 3)
            row["fp8_finite"] = bool(outs["kvpool_fp8"].isfinite().all())
            # Same random K/V and q (same generator seed), fp8-rounded: close, not equal.
            row["max_abs_diff_fp8_vs_fp16"] = float(
                (outs["kvpool_fp8"] - outs["kvpool_fp16"]).abs().max()
            )
        except Exception as e:
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    bad = [r["shape"] for r in result["rows"] if "error" in r or not r.get("fp8_finite")]
    print(f"fp8 prefill: {len(result['rows'])} rows, {len(bad)} failed {bad}")
    sys.exit(1 if bad else 0)
