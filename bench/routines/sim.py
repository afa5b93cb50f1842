"""The scheduler benchmark: paged vs contiguous KV at equal memory, for each contiguous reservation.

ShareGPT-like workload (10,000 requests, all arriving at t=0), Llama-3-8B KV geometry,
max_model_len 4096, 16 GiB of KV for both. The contiguous scheduler runs once per reservation
mode (python/kvpool/scheduler/contiguous.py): max_model_len tokens per request, the request's
length rounded up to a power of two ("pow2"), and exactly the request's length ("request",
the best case for contiguous: it needs every output length in advance). Targets recorded per
mode: paged mean concurrency >= 3x contiguous, KV utilization >= 0.96, each simulate() under
30 s, allocator under 5%.

    python bench/kvbench.py --routine sim [--num-requests 10000] [--device host] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from kvpool.scheduler import SchedulerConfig
from kvpool.scheduler.contiguous import RESERVE_MODES
from kvpool.sim import generate, get_preset, parse_bytes
from kvpool.sim.report import _finite
from kvpool.sim.runner import SimulationSpec, simulate
from provenance import provenance, write_json


def run(args: argparse.Namespace, reserve: str) -> dict[str, Any]:
    requests = generate(
        args.workload, args.num_requests, seed=args.seed, max_model_len=args.max_model_len
    )
    spec = SimulationSpec(
        preset=get_preset(args.model),
        kv_memory_bytes=parse_bytes(args.kv_memory),
        requests=requests,
        config=SchedulerConfig(max_model_len=args.max_model_len),
        device=args.device,
        reserve=reserve,
        workload_info={"kind": args.workload, "seed": args.seed, "arrival": "all at t=0"},
    )
    t0 = time.perf_counter()
    report = simulate(spec)
    total = time.perf_counter() - t0
    for result in report["results"].values():
        result.pop("series")
    paged, comparison = report["results"]["paged"], report["comparison"]
    report["total_wall_s"] = total
    report["targets"] = {
        "mean_concurrency_ratio >= 3": comparison["mean_concurrency_ratio"] >= 3,
        "paged_kv_utilization >= 0.96": paged["kv_utilization"] >= 0.96,
        "total_wall_s < 30": total < 30,
        "paged_alloc_share < 0.05": paged["alloc_share"] < 0.05,
    }
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--kv-memory", default="16GiB")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--workload", default="sharegpt")
    ap.add_argument("--device", default="host")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--reserve",
        default=",".join(RESERVE_MODES),
        help="comma-separated contiguous reservation modes to run",
    )
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    args = ap.parse_args(argv)
    prov = provenance("bench/routines/sim.py")
    runs = {reserve: run(args, reserve) for reserve in args.reserve.split(",")}
    out = args.out
    write_json(out, _finite({"provenance": prov, "runs_by_reserve": runs}))
    summary = {
        reserve: {
            "mean_concurrency_ratio": round(r["comparison"]["mean_concurrency_ratio"], 2),
            "paged_kv_utilization": round(r["results"]["paged"]["kv_utilization"], 4),
            "contiguous_kv_utilization": round(r["results"]["contiguous"]["kv_utilization"], 4),
            "paged_alloc_share": round(r["results"]["paged"]["alloc_share"], 4),
            "total_wall_s": round(r["total_wall_s"], 2),
            **r["targets"],
        }
        for reserve, r in runs.items()
    }
    print(json.dumps({"path": str(out), **summary}, indent=1))
