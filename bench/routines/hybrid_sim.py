"""Hybrid KV memory in the scheduler: each hybrid preset's KV held three ways in the same bytes.

For every hybrid preset (python/kvpool/sim/hybrid_presets.py) and context length, one
workload of requests of exactly that length (prompt = context - --output-tokens, all at
t=0) is served with kvpool's hybrid pages, with every attention layer as full attention in
a uniform pool (recurrent states in a static reserve of one slot per running request), and
with vLLM's uniform page bytes (python/kvpool/sim/hybrid_schemes.py), each on the real
allocator and tables at --kv-memory. The number of requests is 4x what the hybrid pages
hold at once (at most --max-running-seqs), at most --max-requests, so that the steady state
dominates the means. Step times are modelled (python/kvpool/sim/hybrid_cost.py).

Targets recorded: gpt-oss (20b, 120b) at 8k-32k contexts >= 1.8x the mean running requests
of all full attention; Gemma 3 27B >= 3x at 32k; Qwen3-Next's prefix-cache hit rate on a
shared-prompt workload within 5 % of the same workload's on a pure full-attention model of its
attention shape (uniform page bytes: near 0 below one block). The prefix-cache runs
(`prefix_caching` in the JSON) are python/kvpool/sim/hybrid_prefix.py's comparison on its two
workloads (8 system prompts of 1,024 and of 512 tokens, the latter below one 544-token block
of vLLM's), and the 1,024-token workload once more through `kvpool simulate`'s three schemes
with prefix caching (hybrid pages, all full attention, uniform page bytes).

    python bench/kvbench.py --routine hybrid_sim [--kv-memory 40GiB] [--out DIR]
    python bench/routines/hybrid_sim.py --table RESULT.json          # the README's tables
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from kvpool.scheduler import Request, SchedulerConfig
from kvpool.sim import hybrid_prefix, parse_bytes
from kvpool.sim.hybrid_presets import HYBRID_PRESETS, HybridModel
from kvpool.sim.hybrid_runner import SCHEMES, HybridSimulationSpec, simulate_hybrid
from kvpool.sim.report import _finite, write_png

GPT_OSS = ("gpt-oss-20b", "gpt-oss-120b")
TARGET_GPT_OSS = 1.8
TARGET_GEMMA_32K = 3.0
PREFIX_MODEL = "qwen3-next-80b-a3b"
PREFIX_TARGET = "qwen3-next shared-prompt hit rate within 5 % of full attention"
# The shared-prompt workload of the prefix-cache target (the prefix_sim routine's): ShareGPT-like
# requests at 20/s, each starting with one of 8 system prompts (hybrid_prefix.WORKLOADS: of
# 1,024 and of 512 tokens); the scheme table serves the 1,024-token one.
SHARED_PROMPT = {"rate": 20.0, "num_prefixes": 8, "max_model_len": 4096}
SCHEME_WORKLOAD = "shared 1024-token prompts"


def prefix_caching_runs(args: argparse.Namespace) -> dict[str, Any]:
    """Qwen3-Next's shared-prompt workloads with prefix caching: hybrid_prefix's comparison
    (hybrid pages, uniform page bytes, a pure full-attention model) on each, and the three
    schemes of `kvpool simulate --prefix-caching` on SCHEME_WORKLOAD."""
    model = HYBRID_PRESETS[PREFIX_MODEL]
    kv_memory = parse_bytes(args.kv_memory)
    runs = {}
    for name, extra in hybrid_prefix.WORKLOADS.items():
        workload = {
            **SHARED_PROMPT,
            "num_requests": args.prefix_requests,
            "max_running_seqs": args.max_running_seqs,
            **extra,
        }
        t0 = time.perf_counter()
        runs[name] = hybrid_prefix.compare(model, kv_memory, workload)
        print(
            f"{PREFIX_MODEL} {name}: {runs[name]['hit_rates']} ({time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
        )
    w = {**workload, **hybrid_prefix.WORKLOADS[SCHEME_WORKLOAD]}
    config = SchedulerConfig(
        max_model_len=w["max_model_len"], max_running_seqs=args.max_running_seqs
    )
    requests, info = hybrid_prefix.shared_prompt_workload(
        w["num_requests"], w["num_prefixes"], w["prefix_tokens"], w["rate"], config.max_model_len
    )
    spec = HybridSimulationSpec(
        model, kv_memory, requests, config, "bfloat16", info, SCHEMES, prefix_caching=True
    )
    t0 = time.perf_counter()
    schemes = simulate_hybrid(spec)
    schemes["total_wall_s"] = time.perf_counter() - t0
    for result in schemes["results"].values():
        result.pop("series")
    print(
        f"{PREFIX_MODEL} {SCHEME_WORKLOAD}, the simulate schemes: "
        f"({schemes['total_wall_s']:.0f} s)",
        file=sys.stderr,
    )
    return {"model": PREFIX_MODEL, "runs": runs, "schemes": {SCHEME_WORKLOAD: schemes}}


def num_requests(model: HybridModel, context: int, args: argparse.Namespace) -> int:
    per_request = model.needed_bytes(context, context) or 1
    fits = parse_bytes(args.kv_memory) // per_request
    return int(max(16, min(args.max_requests, 4 * min(args.max_running_seqs, fits))))


def run(model: HybridModel, context: int, args: argparse.Namespace) -> dict[str, Any]:
    n = num_requests(model, context, args)
    output = min(args.output_tokens, context // 2)
    requests = [Request(i, 0.0, context - output, output) for i in range(n)]
    config = SchedulerConfig(
        max_model_len=context,
        max_running_seqs=args.max_running_seqs,
        max_tokens_per_step=args.max_tokens_per_step,
    )
    info = {"kind": "fixed lengths", "context_tokens": context, "arrival": "all at t=0"}
    spec = HybridSimulationSpec(
        model, parse_bytes(args.kv_memory), requests, config, "bfloat16", info, SCHEMES
    )
    t0 = time.perf_counter()
    report = simulate_hybrid(spec)
    report["total_wall_s"] = time.perf_counter() - t0
    return report


def targets(runs: dict[str, dict[str, Any]], prefix: dict[str, Any] | None) -> dict[str, Any]:
    """Each target: the figures it is judged on and whether it is met."""

    def ratio(name: str, context: str) -> float:
        return runs[name][context]["comparison"]["hybrid_over_all_full"]["mean_running_ratio"]

    out: dict[str, Any] = {}
    gpt = {
        f"{name} {context}": ratio(name, context)
        for name in GPT_OSS
        if name in runs
        for context in runs[name]
        if 8192 <= int(context) <= 32768
    }
    if gpt:
        out[f"gpt-oss 8k-32k mean running >= {TARGET_GPT_OSS}x all full"] = {
            "ratios": gpt,
            "met": min(gpt.values()) >= TARGET_GPT_OSS,
        }
    if "gemma-3-27b" in runs and "32768" in runs["gemma-3-27b"]:
        r = ratio("gemma-3-27b", "32768")
        out[f"gemma-3-27b 32k mean running >= {TARGET_GEMMA_32K}x all full"] = {
            "ratio": r,
            "met": r >= TARGET_GEMMA_32K,
        }
    if prefix is None:
        out[PREFIX_TARGET] = {"met": None, "why": "not run: --no-prefix-caching"}
        return out
    by_workload = {
        name: {
            "hit_rates": run["hit_rates"],
            "hybrid_relative_to_full_attention": run["hybrid_relative_to_full_attention"],
        }
        for name, run in prefix["runs"].items()
    }
    out[PREFIX_TARGET] = {
        "workloads": by_workload,
        "met": all(run["target_within_5_percent_met"] for run in prefix["runs"].values()),
    }
    return out


LABELS = {"hybrid": "hybrid pages", "all_full": "all full", "uniform_page": "uniform page"}


def readme_table(data: dict[str, Any]) -> str:
    """The README's preset-vs-baselines table, from a result JSON of this routine."""
    lines = [
        "| model | context | mean running: hybrid pages / all full / uniform page | "
        "hybrid over all full | hybrid over uniform page | KV utilization: hybrid / all full "
        "/ uniform page |",
        "|---|---|---|---|---|---|",
    ]
    for name, by_context in data["runs"].items():
        for context, report in by_context.items():
            res, cmp = report["results"], report["comparison"]
            running = " / ".join(f"{res[s]['mean_running']:.1f}" for s in SCHEMES)
            util = " / ".join(f"{res[s]['kv_utilization']:.3f}" for s in SCHEMES)
            full = cmp["hybrid_over_all_full"]["mean_running_ratio"]
            page = cmp["hybrid_over_uniform_page"]["mean_running_ratio"]
            lines.append(
                f"| {name} | {int(context) // 1024}k | {running} | {full:.2f}x | {page:.2f}x "
                f"| {util} |"
            )
    return "\n".join(lines)


PREFIX_ROWS = (
    ("prefix hit rate (tokens)", "prefix_hit_rate", "{:.3f}"),
    ("prefill tokens", "prefill_tokens", "{:,}"),
    ("mean running requests", "mean_running", "{:.1f}"),
    ("output tokens / s (modelled)", "modelled_output_tokens_per_s", "{:,.0f}"),
    ("TTFT mean (modelled)", "ttft_mean_s", "{:.2f} s"),
)


def prefix_scheme_table(data: dict[str, Any]) -> str:
    """The README's table of `kvpool simulate --prefix-caching`'s three schemes on Qwen3-Next."""
    report = data["prefix_caching"]["schemes"][SCHEME_WORKLOAD]
    res = report["results"]
    lines = [
        "| " + SCHEME_WORKLOAD + " | " + " | ".join(LABELS[s] for s in SCHEMES) + " |",
        "|---|" + "---|" * len(SCHEMES),
    ]
    for label, key, fmt in PREFIX_ROWS:
        lines.append(f"| {label} | " + " | ".join(fmt.format(res[s][key]) for s in SCHEMES) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(HYBRID_PRESETS))
    ap.add_argument("--contexts", default="8192,16384,32768")
    ap.add_argument("--kv-memory", default="40GiB")
    ap.add_argument("--output-tokens", type=int, default=1024)
    ap.add_argument("--max-running-seqs", type=int, default=256)
    ap.add_argument("--max-tokens-per-step", type=int, default=8192)
    ap.add_argument("--max-requests", type=int, default=1000)
    ap.add_argument("--plot-context", type=int, default=32768, help="one PNG per model at it")
    ap.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the Qwen3-Next shared-prompt workloads with prefix caching (the hit-rate "
        "target; about two minutes)",
    )
    ap.add_argument("--prefix-requests", type=int, default=2000, help="requests per workload")
    ap.add_argument("--table", type=Path, help="print the README table of this result and exit")
    ap.add_argument("--out", type=Path, help="the JSON to write; the plots go beside it")
    args = ap.parse_args(argv)
    if args.table is not None:
        data = json.loads(args.table.read_text())
        print(readme_table(data))
        print()
        print(hybrid_prefix.readme_table(data["prefix_caching"]))
        print()
        print(prefix_scheme_table(data))
        return
    if args.out is None:
        ap.error("--out is required (or --table)")
    from provenance import provenance, write_json

    prov = provenance("bench/routines/hybrid_sim.py")
    out_dir = args.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {}
    for name in args.models.split(","):
        model = HYBRID_PRESETS[name]
        runs[name] = {}
        for context in (int(c) for c in args.contexts.split(",")):
            report = run(model, context, args)
            if context == args.plot_context:
                png = write_png(report, out_dir / name, dpi=72)
                shutil.move(png, out_dir / f"hybrid_sim_{name}.png")
                (out_dir / name).rmdir()
            for result in report["results"].values():
                result.pop("series")
            runs[name][str(context)] = report
            cmp = report["comparison"]
            print(
                f"{name} {context}: hybrid over all full "
                f"{cmp['hybrid_over_all_full']['mean_running_ratio']:.2f}x, over uniform page "
                f"{cmp['hybrid_over_uniform_page']['mean_running_ratio']:.2f}x "
                f"({report['total_wall_s']:.1f} s)",
                file=sys.stderr,
            )
    config = {k: v for k, v in vars(args).items() if k not in ("out", "table")}
    prefix = prefix_caching_runs(args) if args.prefix_caching else None
    data = {
        "provenance": prov,
        "config": config,
        "targets": targets(runs, prefix),
        "runs": runs,
        "prefix_caching": prefix,
    }
    write_json(args.out, _finite(data))
    print(json.dumps({"path": str(args.out), "targets": data["targets"]}, indent=1))
    print(readme_table(data))
    if prefix is not None:
        print(hybrid_prefix.readme_table(prefix))
        print(prefix_scheme_table(data))


if __name__ == "__main__":
    main()
