"""The scheduler benchmark of issue 5: paged vs contiguous KV at equal memory.

ShareGPT-like workload (10,000 requests, all arriving at t=0), Llama-3-8B KV geometry,
max_model_len 4096, 16 GiB of KV for both. Records the figures and the targets (paged mean
concurrency >= 3x contiguous, KV utilization >= 0.96, the run under 30 s, allocator under 5%)
to bench/results/simulate_<workload>_<model>.json with the commit, machine and date.

    python bench/sim_bench.py [--num-requests 10000] [--device host]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

from kvpool.report import _finite
from kvpool.scheduler import SchedulerConfig, generate, get_preset, parse_bytes
from kvpool.scheduler.runner import SimulationSpec, simulate
from provenance import git_commit

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--kv-memory", default="16GiB")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--workload", default="sharegpt")
    ap.add_argument("--device", default="host")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    requests = generate(args.workload, args.num_requests, seed=args.seed, max_model_len=args.max_model_len)
    spec = SimulationSpec(
        preset=get_preset(args.model), kv_memory_bytes=parse_bytes(args.kv_memory), requests=requests,
        config=SchedulerConfig(max_model_len=args.max_model_len), device=args.device,
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
    report["environment"] = {
        "commit": git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "extension": str(Path(__import__("kvpool._core").__file__).name),
        "extension_bytes": Path(__import__("kvpool._core", fromlist=["_core"]).__file__).stat().st_size,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"simulate_{args.workload}_{args.model}_{args.device}.json"
    path.write_text(json.dumps(_finite(report), indent=1) + "\n")
    print(json.dumps({"path": str(path), "total_wall_s": round(total, 2), **report["targets"],
                      "mean_concurrency_ratio": round(comparison["mean_concurrency_ratio"], 2),
                      "paged_kv_utilization": round(paged["kv_utilization"], 4),
                      "paged_alloc_share": round(paged["alloc_share"], 4),
                      "paged_wall_s": round(paged["run_wall_s"], 2),
                      "contiguous_wall_s": round(report["results"]["contiguous"]["run_wall_s"], 2)}, indent=1))


if __name__ == "__main__":
    main()
