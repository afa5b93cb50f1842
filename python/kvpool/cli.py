"""The `kvpool` command line: `kvpool simulate` compares paged and contiguous KV allocation."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Sequence

from kvpool.scheduler.contiguous import RESERVE_MODES
from kvpool.scheduler.core import SchedulerConfig
from kvpool.scheduler.policies import POLICIES
from kvpool.scheduler.presets import PRESETS, get_preset, parse_bytes
from kvpool.scheduler.workload import ARRIVALS, LENGTH_MODELS, TraceError, generate, load_trace


def _rate(text: str) -> float | None:
    if text.lower() in ("inf", "offline", "none"):
        return None
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0 or 'inf', got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("simulate", help="serve a workload with paged and with contiguous KV allocation",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model and memory")
    g.add_argument("--model", default="llama-3-8b", choices=sorted(PRESETS), help="KV geometry preset")
    g.add_argument("--kv-memory", default="16GiB", help="KV cache budget, e.g. 16GiB, 500MiB")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-model-len", type=int, default=4096, help="longest sequence (contiguous reserves this)")
    g.add_argument("--device", default="host", choices=("auto", "host", "cuda"),
                   help="pool backend; cuda also measures decode attention when kvpool.kernels is present")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="sharegpt", choices=sorted(LENGTH_MODELS))
    w.add_argument("--trace", type=Path, help="JSONL or CSV trace (arrival_s, prompt_tokens, output_tokens)")
    w.add_argument("--num-requests", type=int, default=2000)
    w.add_argument("--rate", type=_rate, default=None, help="requests/s; 'inf' = all arrive at t=0")
    w.add_argument("--arrival", default="poisson", choices=ARRIVALS)
    w.add_argument("--burst-size", type=int, default=64)
    w.add_argument("--num-prefixes", type=int, default=0, help="groups of requests sharing a prompt prefix")
    w.add_argument("--prefix-tokens", type=int, default=0, help="length of the shared prefix")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("scheduler")
    s.add_argument("--policy", default="fcfs", choices=sorted(POLICIES))
    s.add_argument("--max-running-seqs", type=int, default=256)
    s.add_argument("--max-tokens-per-step", type=int, default=2048)
    s.add_argument("--watermark", type=float, default=0.01, help="fraction of blocks admission keeps free")
    s.add_argument("--reserve", default="max_model_len", choices=RESERVE_MODES,
                   help="what a contiguous request reserves")
    s.add_argument("--measure-every", type=int, default=10, help="with --device cuda: time every N-th decode step")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path("kvpool-report"), help="report directory")
    o.add_argument("--no-plot", action="store_true", help="skip the PNG")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _workload(args: argparse.Namespace) -> tuple[list, dict]:
    if args.trace is not None:
        return load_trace(args.trace, args.max_model_len), {"kind": "trace", "trace": str(args.trace)}
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    requests = generate(
        args.workload, args.num_requests, seed=args.seed, rate=args.rate, arrival=args.arrival,
        burst_size=args.burst_size, max_model_len=args.max_model_len,
        num_prefixes=args.num_prefixes, prefix_tokens=args.prefix_tokens,
    )
    info = {"kind": args.workload, "seed": args.seed, "arrival": args.arrival if args.rate else "all at t=0",
            "rate_per_s": args.rate if args.rate else math.inf, "num_prefixes": args.num_prefixes,
            "prefix_tokens": args.prefix_tokens,
            "prefix_sharing": "not exploited by the schedulers (prefixes are stored per request)"}
    return requests, info


def simulate_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvpool.report import print_table, write_json, write_png
    from kvpool.scheduler.runner import SimulationSpec, simulate

    console = Console(stderr=False)
    requests, info = _workload(args)
    config = SchedulerConfig(
        max_model_len=args.max_model_len, max_running_seqs=args.max_running_seqs,
        max_tokens_per_step=args.max_tokens_per_step, watermark=args.watermark, policy=args.policy,
    )
    spec = SimulationSpec(
        preset=get_preset(args.model), kv_memory_bytes=parse_bytes(args.kv_memory), requests=requests,
        config=config, block_size=args.block_size, device=args.device, reserve=args.reserve,
        measure_every=args.measure_every, workload_info=info,
    )
    t0 = time.perf_counter()
    if args.no_progress:
        report = simulate(spec)
    else:
        report = _simulate_with_progress(spec, console)
    report["total_wall_s"] = time.perf_counter() - t0
    report["command"] = ["kvpool", *sys.argv[1:]]
    print_table(report, console)
    json_path = write_json(report, args.out)
    console.print(f"report: {json_path}")
    if not args.no_plot:
        console.print(f"plot:   {write_png(report, args.out)}")
    return 0


def _simulate_with_progress(spec, console) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvpool.scheduler.runner import simulate

    total = len(spec.requests)
    with Progress(TextColumn("{task.description:<11}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        tasks = {name: bar.add_task(name, total=total) for name in ("paged", "contiguous")}
        last = {"t": 0.0}

        def progress(name: str, done: int, total: int) -> None:
            now = time.perf_counter()
            if done == total or now - last["t"] > 0.1:
                last["t"] = now
                bar.update(tasks[name], completed=done)

        return simulate(spec, progress)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "simulate":
            return simulate_command(args)
    except (TraceError, ValueError) as e:
        print(f"kvpool {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # kvpool errors (CUDA missing, out of memory) end the run cleanly
        import kvpool

        if isinstance(e, kvpool.KvError):
            print(f"kvpool {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        raise
    parser.error(f"unknown command {args.command}")
    return 2
