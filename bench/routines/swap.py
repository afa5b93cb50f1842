"""Swap bandwidth and latency of kvpool's host tier on a GPU, against the baselines a user
would pick instead, measured in the same run:

- ceiling: one `cudaMemcpyAsync` of one large pinned buffer (1 GiB) each way, and of one
  buffer the size of each swap;
- per-block loop: one `cudaMemcpyAsync` per block from Python, between the same pinned and
  device blocks (what a swap without kvpool's copy plan does).

kvpool's swaps run for 1..4096 blocks of two layouts (Llama-3-8B: 2 MiB blocks; a small one:
64 KiB blocks), with the request's blocks contiguous (one run) and fragmented (every block its
own run, the worst case), for each copy method ("batch": one cuMemcpyBatchAsync; "runs": one
cuMemcpyAsync per run). Bandwidth is bytes over the GPU time between CUDA events recorded on
the tier's copy stream around the swap; latency is the wall time from the call to `wait()`
returning. Medians of REPEATS after a warm-up.

    python3 bench/kvbench.py --routine swap [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import cupy as cp
import kvpool
from provenance import provenance, write_json
from timing import stream_event_s, stream_median_s

LAYOUTS = {
    "llama-3-8b (2 MiB blocks)": dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16),
    "small (64 KiB blocks)": dict(num_layers=2, num_kv_heads=8, head_dim=128, block_size=8),
}
COUNTS = [1, 4, 16, 64, 256, 1024, 4096]
REPEATS = 5


def median_of(fn, stream):
    return stream_median_s(fn, stream, REPEATS)


def ceiling(nbytes, stream):
    """One cudaMemcpyAsync each way between a pinned buffer and a device buffer."""
    host = cp.cuda.alloc_pinned_memory(nbytes)
    dev = cp.cuda.alloc(nbytes)
    rt = cp.cuda.runtime
    h2d = median_of(
        lambda: rt.memcpyAsync(dev.ptr, host.ptr, nbytes, rt.memcpyHostToDevice, stream.ptr), stream
    )
    d2h = median_of(
        lambda: rt.memcpyAsync(host.ptr, dev.ptr, nbytes, rt.memcpyDeviceToHost, stream.ptr), stream
    )
    return {"bytes": nbytes, "h2d_gbps": nbytes / h2d[0] / 1e9, "d2h_gbps": nbytes / d2h[0] / 1e9}


def make_request(tables, n, fragmented):
    """Request 0 with n blocks; fragmented: a filler block taken between each of its blocks."""
    bs = tables.pool.layout.block_size
    if not fragmented:
        tables.add(0, n * bs)
        return
    tables.add(0, bs)
    for i in range(1, n):
        tables.add(10_000 + i, bs)
        tables.append_tokens(0, bs)
    for i in range(1, n):
        tables.free(10_000 + i)


def bench_layout(name, shape, stream):
    layout = kvpool.KvLayout(**shape, dtype="float16")
    bb = layout.block_bytes
    rows = []
    max_n = max(COUNTS)
    pool = kvpool.Pool(layout, 2 * max_n + 1, device="cuda")
    tables = kvpool.BlockTables(pool, max_n + 2, max_n)
    tiers = {m: kvpool.HostTier(tables, max_n, copy_method=m) for m in ("batch", "runs")}
    for n in COUNTS:
        nbytes = n * bb
        same_size = ceiling(nbytes, stream)
        for fragmented in (False, True):
            make_request(tables, n, fragmented)
            for method, tier in tiers.items():
                copy_stream = cp.cuda.Stream.from_external(tier.copy_stream)
                outs, ins = [], []
                for _ in range(REPEATS + 1):
                    stats = {}
                    outs.append(
                        stream_event_s(copy_stream, lambda: stats.update(tier.swap_out([0])))
                    )
                    tier.wait()
                    ins.append(stream_event_s(copy_stream, lambda: tier.swap_in([0])))
                    tier.wait()
                out_gpu = statistics.median(r[0] for r in outs[1:])
                in_gpu = statistics.median(r[0] for r in ins[1:])
                rows.append(
                    {
                        "layout": name,
                        "block_bytes": bb,
                        "num_blocks": n,
                        "fragmented": fragmented,
                        "method": method,
                        "num_copies": stats["num_copies"],
                        "swap_out_gbps": nbytes / out_gpu / 1e9,
                        "swap_in_gbps": nbytes / in_gpu / 1e9,
                        "swap_out_latency_us": statistics.median(r[1] for r in outs[1:]) * 1e6,
                        "swap_in_latency_us": statistics.median(r[1] for r in ins[1:]) * 1e6,
                        "ceiling_same_size": same_size,
                    }
                )
            loop = per_block_loop(pool, tiers["runs"].pool, tables.blocks(0), bb, stream)
            rows[-1]["per_block_loop"] = loop
            rows[-2]["per_block_loop"] = loop
            tables.free(0)
        print(json.dumps(rows[-1]), flush=True)
    return rows


def per_block_loop(pool, host_pool, blocks, bb, stream):
    """One cudaMemcpyAsync per block from Python, device blocks -> host blocks 0..n and back."""
    rt = cp.cuda.runtime
    pairs = [
        (pool.base_ptr + int(b) * bb, host_pool.base_ptr + i * bb) for i, b in enumerate(blocks)
    ]

    def d2h():
        for dev, host in pairs:
            rt.memcpyAsync(host, dev, bb, rt.memcpyDeviceToHost, stream.ptr)

    def h2d():
        for dev, host in pairs:
            rt.memcpyAsync(dev, host, bb, rt.memcpyHostToDevice, stream.ptr)

    out, inn = median_of(d2h, stream), median_of(h2d, stream)
    n = len(pairs) * bb
    return {
        "d2h_gbps": n / out[0] / 1e9,
        "h2d_gbps": n / inn[0] / 1e9,
        "d2h_latency_us": out[1] * 1e6,
        "h2d_latency_us": inn[1] * 1e6,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    stream = cp.cuda.Stream(non_blocking=True)
    big = ceiling(1 << 30, stream)
    print("ceiling 1 GiB", json.dumps(big), flush=True)
    rows = []
    for name, shape in LAYOUTS.items():
        rows += bench_layout(name, shape, stream)
    for r in rows:
        r["swap_out_vs_ceiling"] = r["swap_out_gbps"] / big["d2h_gbps"]
        r["swap_in_vs_ceiling"] = r["swap_in_gbps"] / big["h2d_gbps"]
    result = {
        "provenance": provenance("bench/routines/swap.py"),
        "ceiling_1gib": big,
        "method": "GPU time between CUDA events on the copy stream; medians of "
        f"{REPEATS} after one warm-up; latency: wall time of the call until the copy completed",
        "rows": rows,
    }
    write_json(args.out, result)
    worst = [r for r in rows if r["num_blocks"] >= 64 and r["method"] == "batch"]
    for r in worst:
        print(
            f"{r['layout']:28s} n={r['num_blocks']:5d} frag={r['fragmented']!s:5s} "
            f"out {r['swap_out_vs_ceiling']:.2f} in {r['swap_in_vs_ceiling']:.2f} of the 1 GiB ceiling"
        )
