"""Preemption by swap against recompute, in the scheduler simulation.

One workload that preempts (ShareGPT-like lengths with long outputs, all at t=0, a small GPU
KV budget) is served by the paged scheduler without a host tier (every preemption recomputed)
and with a host tier, per (link bandwidth, preemption mode, tier size) case. The baseline runs
in the same `simulate()` call as the tier, on the same requests and GPU KV memory, so each
row's ratios are tier over no tier. The link cases: the H200's measured 55 GB/s (pinned 1 GiB
copy), 25 and 10 GB/s (slower PCIe links), 5 and 2 GB/s (where recompute is cheaper per token
for Llama-3-8B); modes auto and swap; and a tier too small for the victims.

Times are modelled (costmodel.RooflineCost, copies from preemption.HostLink), not measured.

    python bench/kvbench.py --routine swap_sim [--num-requests 2000] [--kv-memory 4GiB] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from kvpool.scheduler import SchedulerConfig
from kvpool.scheduler.preemption import HostLink
from kvpool.scheduler.swap import HostTierSpec
from kvpool.sim import generate, get_preset, parse_bytes
from kvpool.sim.report import _finite
from kvpool.sim.runner import SimulationSpec, simulate
from provenance import provenance, write_json

# (host link GB/s, mode, host tier size)
CASES = (
    (55.0, "auto", "64GiB"),
    (55.0, "swap", "64GiB"),
    (25.0, "auto", "64GiB"),
    (10.0, "auto", "64GiB"),
    (5.0, "auto", "64GiB"),
    (5.0, "swap", "64GiB"),
    (2.0, "auto", "64GiB"),
    (2.0, "swap", "64GiB"),
    (55.0, "auto", "256MiB"),
)


def row(gbps: float, mode: str, tier_size: str, report: dict[str, Any]) -> dict[str, Any]:
    h = report["host_tier_comparison"]
    tier, no_tier = report["results"]["paged_host_tier"], report["results"]["paged"]
    return {
        "host_link_gbps": gbps,
        "mode": mode,
        "cpu_kv_memory": tier_size,
        "preemptions_no_tier": no_tier["preemptions"],
        "preemptions_tier": tier["preemptions"],
        "by_swap": h["preemptions_by_swap"],
        "by_recompute": h["preemptions_by_recompute"],
        "tier_full": h["recomputed_because_tier_full"],
        "recomputed_tokens_no_tier": no_tier["recomputed_tokens"],
        "recomputed_tokens_tier": tier["recomputed_tokens"],
        "swapped_gib": h["swapped_bytes"] / 2**30,
        "copy_s": h["modelled_copy_s"],
        "output_tokens_per_s_no_tier": no_tier["modelled_output_tokens_per_s"],
        "output_tokens_per_s_tier": tier["modelled_output_tokens_per_s"],
        "throughput_ratio": h["modelled_throughput_ratio"],
        "ttft_mean_ratio": h["ttft_mean_ratio"],
        "ttft_p99_ratio": h["ttft_p99_ratio"],
        "latency_mean_ratio": h["latency_mean_ratio"],
        "latency_p99_ratio": h["latency_p99_ratio"],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--kv-memory", default="4GiB")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-running-seqs", type=int, default=256)
    ap.add_argument("--workload", default="sharegpt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    args = ap.parse_args(argv)
    prov = provenance("bench/routines/swap_sim.py")
    requests = generate(
        args.workload, args.num_requests, seed=args.seed, max_model_len=args.max_model_len
    )
    config = SchedulerConfig(
        max_model_len=args.max_model_len, max_running_seqs=args.max_running_seqs
    )
    rows, reports = [], []
    for gbps, mode, tier_size in CASES:
        spec = SimulationSpec(
            preset=get_preset(args.model),
            kv_memory_bytes=parse_bytes(args.kv_memory),
            requests=requests,
            config=config,
            device="host",
            workload_info={"kind": args.workload, "seed": args.seed, "arrival": "all at t=0"},
            host_tier=HostTierSpec(parse_bytes(tier_size), mode, HostLink(gbps * 1e9)),
        )
        t0 = time.perf_counter()
        report = simulate(spec)
        report["total_wall_s"] = time.perf_counter() - t0
        for result in report["results"].values():
            result.pop("series")
        rows.append(row(gbps, mode, tier_size, report))
        reports.append(report)
        r = rows[-1]
        print(
            f"{gbps:5.1f} GB/s {mode:9} {tier_size:>6}: swap {r['by_swap']:5} recompute {r['by_recompute']:5} "
            f"(full {r['tier_full']:4}) recomputed tokens {r['recomputed_tokens_tier']:8,} vs "
            f"{r['recomputed_tokens_no_tier']:8,}  throughput x{r['throughput_ratio']:.3f} "
            f"TTFT mean x{r['ttft_mean_ratio']:.3f} latency mean x{r['latency_mean_ratio']:.3f} "
            f"({report['total_wall_s']:.1f} s)",
            flush=True,
        )
    out = args.out
    write_json(
        out,
        _finite(
            {
                "provenance": prov,
                "args": vars(args) | {"out": str(out)},
                "rows": rows,
                "reports": reports,
            }
        ),
    )
    print(f"wrote {out}")
