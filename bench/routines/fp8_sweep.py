"""Tuning sweep of kvpool's fp8 (e4m3) decode on the GPU, to pick its defaults.

Each candidate is an fp8 decode tuning (warps per CTA, cp.async stages per warp, CTAs per SM
the split-KV plan fills: _build.Fp8DecodeTuning, set through kvpool.kernels._tuning.override on
the plans the candidate's calls make); "default" is the library's behaviour, no override. On
the fp8 routine's grid (fp16 queries, Hq 32, Hkv 8, D 128, page 16, shuffled pages, input
rotations beyond L2, CUDA-graph replays) every candidate is
  - checked first: output poisoned with NaN, then compared per (sequence, head) with the float64
    reference on the dequantized cache (relative L2 error < 1e-2, no NaN); a mutated output (heads
    rolled by one) must fail the same check;
  - timed, with our fp16 decode (library default) on the same shape in the same run as baseline.
The read ceiling is measured in the same run; "frac" counts fp8 bytes. Writes JSON (--out),
prints one table (microseconds, speedup over our fp16, fraction of the ceiling) and the best
candidate per shape.

Then the fp8 prefill on the fp8_prefill routine's shapes: our fp16 prefill, the fp8 prefill with
synchronous loads (default) and with _tuning's fp8_prefill_async (cp.async into fp8 staging
tiles). The two fp8 forms do the same arithmetic on the same fp16 tiles, so their outputs must be
bit-identical (the synchronous form is the one the GPU tests check against float64).
Meant to finish in well under two minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback

import cupy as cp
import kvpool
import torch
from kvpool.kernels import _build, _tuning, workspace_elems
from provenance import provenance
from shape_grid import measure_grid
from timing import graph_us

from routines.decode import GRID, HKV, HQ, measure_ceiling
from routines.fp8 import BS, K_SCALE, V_SCALE, D, decode_calls, make_pool, shape_inputs
from routines.fp8_prefill import SHAPES as PREFILL_SHAPES
from routines.fp8_prefill import run as run_prefill
from routines.prefill import causal_flops

BOUND = 1e-2
PREFILL_START_LIMIT_S = 85  # seconds into the run after which the prefill part is skipped
# (name, "warps=W,stages=S,fill=F"; empty: the library's defaults): DP 128 x head tile 4
# modules at 141 registers (<= 3 CTAs of 4 warps per SM by registers). Shared memory per CTA:
# 5376 B per warp and stage.
CANDIDATES = [
    ("default", ""),  # Fp8DecodeTuning's: 6 warps x 3 stages, fill 1
    ("w4s0f0", "warps=4,stages=0,fill=0"),  # the first defaults: 4 warps x 4 stages, fill 1
    ("w4s4f2", "warps=4,stages=4,fill=2"),
    ("w4s3f1", "warps=4,stages=3,fill=1"),  # 64.5 KB: 3 CTAs/SM, 12 warps
    ("w4s3f2", "warps=4,stages=3,fill=2"),
    ("w4s3f3", "warps=4,stages=3,fill=3"),
    ("w4s2f3", "warps=4,stages=2,fill=3"),  # 43 KB (3 CTAs/SM by registers)
    ("w6s3f1", "warps=6,stages=3,fill=1"),  # 96.8 KB: 2 CTAs/SM, 12 warps
    ("w6s3f2", "warps=6,stages=3,fill=2"),
    ("w8s3f1", "warps=8,stages=3,fill=1"),  # 129 KB: 1 CTA/SM, 8 warps
    ("w8s4f1", "warps=8,stages=4,fill=1"),  # 172 KB: 1 CTA/SM, 8 warps, 3 tiles ahead
]


def tuning_knobs(value: str) -> dict:
    """The _tuning.override knobs of a candidate: "warps=W,stages=S,fill=F" (fields left out
    take Fp8DecodeTuning's defaults) as an fp8_decode tuning; empty: none (the defaults)."""
    if not value:
        return {}
    fields = {}
    for item in value.split(","):
        name, _, number = item.partition("=")
        fields[name.strip()] = int(number)
    return {"fp8_decode": _build.Fp8DecodeTuning(**fields)}


def reference(q, cache, table, lens):
    """float64 decode on the dequantized cache: [B, HQ, D] (rows of one sequence at a time)."""
    group = HQ // HKV
    out = torch.empty(q.shape, dtype=torch.float64, device="cuda")
    for b in range(q.shape[0]):
        n = int(lens[b])
        blocks = table[b, : -(-n // BS)].long()
        # Gather as bytes (index kernels for float8 are not a given), then dequantize.
        kv = cache.view(torch.uint8)[blocks].view(cache.dtype).float().double()
        k = kv[:, 0].reshape(-1, HKV, D)[:n] * K_SCALE
        v = kv[:, 1].reshape(-1, HKV, D)[:n] * V_SCALE
        k = k.repeat_interleave(group, dim=1)  # [n, HQ, D]
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].to(torch.float64), k) / math.sqrt(D)
        p = torch.softmax(s, dim=1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


def row_rel_err(out, ref):
    """max over (sequence, head) of ||out - ref|| / ||ref||; inf when out has a NaN."""
    o = out.to(torch.float64)
    if not bool(o.isfinite().all()):
        return math.inf
    err = (o - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    return float(err.max())


def sweep_shape(batch, seq_len, ceiling):
    lens, elems, rot, num_blocks, gen, tables, lens_t, qs = shape_inputs(batch, seq_len)
    row = {
        "shape": f"{batch}x{seq_len}",
        "batch": batch,
        "seq_len": seq_len,
        "rotations": rot,
        "kv_bytes_fp8": elems,
        "candidates": {},
    }
    ws = cp.empty(workspace_elems(batch, HQ, D, 128), cp.float32)
    for dtype in ("float16", "float8_e4m3fn"):
        pool, cache = make_pool(dtype, num_blocks, gen)
        scales = None
        if dtype != "float16":
            scales = kvpool.KvScales(pool)
            scales.set(0, K_SCALE, V_SCALE)
            ref = reference(qs[0], cache, tables[0], lens)
        out = [torch.empty_like(q) for q in qs]

        if dtype == "float16":
            row["fp16_us"] = graph_us(
                decode_calls(qs, pool, tables, lens_t, out, seq_len, ws, None)
            )
        else:
            for name, value in CANDIDATES:
                res = {"env": value}
                try:
                    # Fresh calls: their plans, made inside the override, take the tuning.
                    calls = decode_calls(
                        qs, pool, tables, lens_t, out, seq_len, ws, scales, **tuning_knobs(value)
                    )
                    out[0].fill_(float("nan"))
                    calls[0](torch.cuda.current_stream())
                    torch.cuda.synchronize()
                    res["rel_err"] = row_rel_err(out[0], ref)
                    res["mutant_rel_err"] = row_rel_err(out[0].roll(1, dims=1), ref)
                    res["ok"] = res["rel_err"] < BOUND and res["mutant_rel_err"] >= BOUND
                    res["us"] = graph_us(calls)
                    res["x_fp16"] = round(row["fp16_us"] / res["us"], 3)
                    res["frac"] = round(elems / (res["us"] * 1e-6) / 1e12 / ceiling, 4)
                except Exception as e:
                    traceback.print_exc()
                    res["ok"] = False
                    res["error"] = f"{type(e).__name__}: {e}"[:300]
                row["candidates"][name] = res
        del pool, cache
        torch.cuda.empty_cache()
        cp.get_default_memory_pool().free_all_blocks()
    return row


def sweep_prefill():
    """fp16 / fp8 sync / fp8 async prefill rows (same seeds: same q, same K/V values)."""
    rows = []
    for label, num_seqs, qo, prefix in PREFILL_SHAPES:
        row = {"shape": label, "num_seqs": num_seqs, "new_tokens": qo, "cached_prefix": prefix}
        try:
            flops = causal_flops(num_seqs, qo, prefix)
            outs = {}
            for key, dtype, async_ in (
                ("fp16", "float16", False),
                ("fp8_sync", "float8_e4m3fn", False),
                ("fp8_async", "float8_e4m3fn", True),
            ):
                with _tuning.override(fp8_prefill_async=async_):  # run_prefill makes its plan
                    us, outs[key], _ = run_prefill(dtype, num_seqs, qo, prefix)
                row[f"{key}_us"] = round(us, 2)
                row[f"{key}_tflops"] = round(flops / (us * 1e-6) / 1e12, 1)
                torch.cuda.empty_cache()
                cp.get_default_memory_pool().free_all_blocks()
            row["finite"] = bool(outs["fp8_sync"].isfinite().all())
            row["async_equals_sync"] = bool(torch.equal(outs["fp8_async"], outs["fp8_sync"]))
            row["ok"] = row["finite"] and row["async_equals_sync"]
        except Exception as e:
            traceback.print_exc()
            row["ok"] = False
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None):
    t0 = time.time()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON to write")
    out_path = ap.parse_args(argv).out
    ceiling, _, _ = measure_ceiling()
    print(f"ceiling {ceiling:.3f} TB/s", flush=True)
    result = {
        "provenance": provenance("bench/routines/fp8_sweep.py"),
        "ceiling_tb_s": round(ceiling, 4),
        "bound": BOUND,
        "candidates": dict(CANDIDATES),
        "timing": "median of 20 CUDA-graph replays of >= 8 calls rotating over R input sets",
        "rows": [],
    }
    for row in measure_grid(
        GRID, lambda batch, seq_len: sweep_shape(batch, seq_len, ceiling), result, out_path
    ):
        print(f"{row['shape']} done at {time.time() - t0:.0f} s", flush=True)
    names = [n for n, _ in CANDIDATES]
    print("fp8 decode us (x our fp16 / fraction of ceiling); FAIL: wrong result")
    print(f"{'shape':>9} {'fp16':>6} " + " ".join(f"{n:>17}" for n in names))
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['shape']:>9} error {r['error']}")
            continue
        cells = []
        for n in names:
            c = r["candidates"][n]
            cells.append(
                f"{c['us']:6.1f} {c['x_fp16']:4.2f}/{c['frac']:.2f}"
                if c.get("ok")
                else f"{'FAIL':>17}"
            )
        print(f"{r['shape']:>9} {r['fp16_us']:6.1f} " + " ".join(f"{x:>17}" for x in cells))

    def best(r):
        timed = [(c["us"], n) for n, c in r["candidates"].items() if c.get("ok")]
        return min(timed)[1] if timed else "-"

    print(
        "best per shape:",
        ", ".join(f"{r['shape']}={best(r)}" for r in result["rows"] if "error" not in r),
    )
    fails = [
        (r["shape"], n)
        for r in result["rows"]
        for n, c in r.get("candidates", {}).items()
        if not c.get("ok")
    ]
    print(f"decode sweep done at {time.time() - t0:.0f} s", flush=True)
    # The prefill part compiles a few larger modules: skip it rather than lose the run's end.
    result["prefill"] = sweep_prefill() if time.time() - t0 < PREFILL_START_LIMIT_S else []
    if not result["prefill"]:
        print(f"fp8 prefill skipped: past {PREFILL_START_LIMIT_S} s")
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print("fp8 prefill us (TFLOP/s): fp16, fp8 sync, fp8 async (fp8_prefill_async)")
    for r in result["prefill"]:
        if "error" in r:
            print(f"{r['shape']:>20} error {r['error']}")
            continue
        print(
            f"{r['shape']:>20} "
            + " ".join(
                f"{r[k + '_us']:8.1f} ({r[k + '_tflops']:5.1f})"
                for k in ("fp16", "fp8_sync", "fp8_async")
            )
            + f"  async/sync {r['fp8_sync_us'] / r['fp8_async_us']:.2f}x"
            + f"  bit-identical {r['async_equals_sync']}"
        )
    fails += [("prefill " + r["shape"], "async") for r in result["prefill"] if not r["ok"]]
    print(f"{len(fails)} failed candidate runs {fails}; total {time.time() - t0:.0f} s")
