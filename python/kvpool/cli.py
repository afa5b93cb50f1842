"""The `kvpool` command line: `kvpool simulate` compares paged and contiguous KV allocation."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import kvpool
from kvpool.scheduler.contiguous import RESERVE_MODES
from kvpool.scheduler.core import SchedulerConfig
from kvpool.scheduler.policies import POLICIES
from kvpool.scheduler.presets import PRESETS, get_preset, parse_bytes
from kvpool.scheduler.workload import ARRIVALS, LENGTH_MODELS, generate, load_trace


def _rate(text: str) -> float:
    """Requests/s > 0; 'inf' (or 'offline', 'none') is math.inf: every request at t=0."""
    if text.strip().lower() in ("inf", "offline", "none"):
        return math.inf
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"rate must be a number of requests/s (> 0) or 'inf', got {text!r}"
        ) from None
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"rate must be > 0 requests/s or 'inf', got {text!r}")
    return value


def _burst_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"burst size must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"burst size must be >= 1, got {value}")
    return value


def _model(text: str) -> str:
    """A preset name, case and '_' / '-' insensitive (Llama-3-8B, llama_3_8b)."""
    try:
        return get_preset(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones (options whose default is described in their help)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


# Generator options: their defaults are None so that an explicitly given one can be detected
# (and rejected with --trace, which ignores them). The effective defaults:
GENERATOR_DEFAULTS = {"workload": "sharegpt", "num_requests": 2000, "seed": 0, "rate": None,
                      "arrival": "poisson", "burst_size": 64, "num_prefixes": 0, "prefix_tokens": 0}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("simulate", help="serve a workload with paged and with contiguous KV allocation",
                       formatter_class=_HelpFormatter)
    g = p.add_argument_group("model and memory")
    g.add_argument("--model", default="llama-3-8b", type=_model, metavar="MODEL",
                   help=f"KV geometry preset, one of {', '.join(sorted(PRESETS))} (case and _/- insensitive)")
    g.add_argument("--kv-memory", default="16GiB",
                   help="KV cache budget: KiB/MiB/GiB/TiB are powers of 1024, K/KB/M/MB/G/GB/T/TB "
                        "powers of 1000 (16G = 16e9 bytes, 16GiB = 16 * 2^30); a plain number is bytes")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-model-len", type=int, default=4096, help="longest sequence (contiguous reserves this)")
    g.add_argument("--device", default="host", choices=("auto", "host", "cuda"),
                   help="pool backend (auto: cuda when a GPU is available); with cuda, decode attention "
                        "is also measured when CuPy is installed and the kernels run on the GPU")
    w = p.add_argument_group("workload", "a synthetic workload, or --trace (which excludes the other options here)")
    w.add_argument("--workload", default=None, choices=sorted(LENGTH_MODELS), help="length model (default: sharegpt)")
    w.add_argument("--trace", type=Path, help="JSONL or CSV trace (arrival_s, prompt_tokens, output_tokens)")
    w.add_argument("--num-requests", type=int, default=None, help="requests to generate (default: 2000)")
    w.add_argument("--rate", type=_rate, default=None,
                   help="requests/s; 'inf' = all arrive at t=0 (default: inf)")
    w.add_argument("--arrival", default=None, choices=ARRIVALS, help="arrival process with --rate (default: poisson)")
    w.add_argument("--burst-size", type=_burst_size, default=None,
                   help="requests per burst with --arrival burst, >= 1 (default: 64)")
    w.add_argument("--num-prefixes", type=int, default=None,
                   help="groups of requests sharing a prompt prefix (default: 0, none)")
    w.add_argument("--prefix-tokens", type=int, default=None,
                   help="length of the shared prefix; needs --num-prefixes (default: 0)")
    w.add_argument("--seed", type=int, default=None, help="generator seed (default: 0)")
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


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_options(args: argparse.Namespace) -> str | None:
    """Why the given options do not go together (options that would be silently ignored), or None."""
    given = [d for d in GENERATOR_DEFAULTS if getattr(args, d) is not None]
    if args.trace is not None:
        if given:
            return (f"{', '.join(_flag(d) for d in given)} cannot be used with --trace "
                    "(the trace gives the requests, their lengths and arrival times)")
        return None
    finite_rate = args.rate is not None and math.isfinite(args.rate)
    for d in ("arrival", "burst_size"):
        if getattr(args, d) is not None and not finite_rate:
            return f"{_flag(d)} needs a finite --rate (without one, every request arrives at t=0)"
    if args.burst_size is not None and args.arrival != "burst":
        return "--burst-size needs --arrival burst"
    if args.prefix_tokens is not None and not args.num_prefixes:
        return "--prefix-tokens needs --num-prefixes >= 1 (without prefix groups there is no shared prefix)"
    return None


def _fill_defaults(args: argparse.Namespace) -> None:
    for dest, default in GENERATOR_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if args.rate is not None and math.isinf(args.rate):
        args.rate = None  # offline: everything at t=0


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
    if args.rate and args.arrival == "burst":
        info["burst_size"] = args.burst_size
    return requests, info


class SetupError(Exception):
    """Something outside the simulation (a missing package, an unusable --out) stops the run."""


def _check_out(out: Path) -> None:
    """Fail before the simulation when the report directory cannot be created or written."""
    if out.exists():
        if not out.is_dir():
            raise SetupError(f"--out {out} exists and is not a directory")
        if not os.access(out, os.W_OK | os.X_OK):
            raise SetupError(f"--out {out} is not writable")
        return
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise SetupError(f"--out {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SetupError(f"--out {out}: cannot create it, {parent} is not writable")


def _check_imports(plot: bool) -> None:
    names = ["rich"] + (["matplotlib"] if plot else [])
    for name in names:
        try:
            __import__(name)
        except ImportError as e:
            raise SetupError(f"{name} is missing ({e}); install kvpool[sim]") from None


def simulate_command(args: argparse.Namespace, command: Sequence[str] | None = None) -> int:
    """Run `kvpool simulate`; `command` (the arguments after `kvpool`) is recorded in the report."""
    _check_imports(not args.no_plot)
    from rich.console import Console

    from kvpool.report import print_table, write_json, write_png
    from kvpool.scheduler.runner import SimulationSpec, simulate

    console = Console(stderr=False)
    requests, info = _workload(args)
    _check_out(args.out)
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
    report["command"] = ["kvpool", *(sys.argv[1:] if command is None else command)]
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
    problem = check_options(args)
    if problem is not None:  # exits with status 2, like every other argument error
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        subparsers.choices[args.command].error(problem)
    _fill_defaults(args)
    command = None if argv is None else [str(a) for a in argv]
    try:
        return simulate_command(args, command)
    except ValueError as e:  # bad values, including TraceError (a ValueError)
        print(f"kvpool {args.command}: error: {e}", file=sys.stderr)
        return 2
    except SetupError as e:
        print(f"kvpool {args.command}: error: {e}", file=sys.stderr)
        return 1
    except kvpool.KvError as e:  # kvpool errors (CUDA missing, out of memory) end the run cleanly
        print(f"kvpool {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # writing the report failed after all
        print(f"kvpool {args.command}: error: cannot write the report: {e}", file=sys.stderr)
        return 1
