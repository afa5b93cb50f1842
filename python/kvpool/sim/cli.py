"""The `kvpool` command line: `kvpool simulate` compares paged and contiguous KV allocation.

Every option is checked before anything is generated or allocated; a bad one ends the command
with exit status 2 and one line naming the option and what it accepts. Status 1 is for
failures that are not the options' fault (a missing package, no CUDA, a report that cannot be
written after all).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import kvpool
from kvpool.scheduler.contiguous import RESERVE_MODES
from kvpool.scheduler.core import SchedulerConfig
from kvpool.scheduler.policies import POLICIES
from kvpool.sim import cli_host_tier, cli_hybrid
from kvpool.sim.disagg import link_from_benchmark, simulate_disaggregated
from kvpool.sim.hybrid_config import ConfigError
from kvpool.sim.hybrid_presets import HYBRID_PRESETS, HybridModel
from kvpool.sim.presets import PRESETS, get_preset, parse_bytes
from kvpool.sim.report import print_table, write_json, write_png
from kvpool.sim.runner import SimulationSpec, simulate
from kvpool.sim.sharing import MULTITURN, shares_prefixes
from kvpool.sim.traces import TRACE_FORMATS
from kvpool.sim.workload import ARRIVALS, LENGTH_MODELS
from kvpool.sim.workload_options import synthetic_workload, trace_workload

# The slowest rate and the longest think time: with at most MAX_REQUESTS requests the mean
# last arrival is at most workload.MAX_ARRIVAL_S, where a float still resolves microseconds
# (at 1e-300 requests/s, arrivals near 1e302 s made every latency 0.0 s).
MIN_RATE = 1e-3
MAX_THINK_TIME_S = 86_400.0


def _rate(text: str) -> float:
    """Requests/s >= MIN_RATE; 'inf' (or 'offline', 'none') is math.inf: every request at t=0."""
    if text.strip().lower().lstrip("+") in ("inf", "infinity", "offline", "none"):
        return math.inf
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"rate must be a number of requests/s (> 0) or 'inf', got {text!r}"
        ) from None
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"rate must be > 0 requests/s or 'inf', got {text!r}")
    if math.isinf(value):  # a number too large for a float, e.g. 1e400
        raise argparse.ArgumentTypeError(
            f"rate {text!r} is beyond any float; write 'inf' for every request at t=0"
        )
    if value < MIN_RATE:
        raise argparse.ArgumentTypeError(
            f"rate must be >= {MIN_RATE:g} requests/s (or 'inf'), got {text!r}"
        )
    return value


INT32_MAX = 2**31 - 1  # token counts and block ids are int32 in the block tables and kernels


def _int_in(minimum: int, maximum: int = INT32_MAX):
    """An argparse type: an integer in [minimum, maximum] (argparse names the option)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer in [{minimum}, {maximum}], got {text!r}"
            ) from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be in [{minimum}, {maximum}], got {value}")
        return value

    return parse


def _fraction(text: str) -> float:
    """A float in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}")
    return value


def _think_time(text: str) -> float:
    """Seconds in [0, MAX_THINK_TIME_S]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_THINK_TIME_S:  # also rejects nan
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds in [0, {MAX_THINK_TIME_S:g}], got {text!r}"
        )
    return value


def _out_dir(text: str) -> Path:
    """A directory name; '' (which Path makes '.') would write into the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name a directory, got {text!r}")
    return Path(text)


def _model(text: str) -> str:
    """A preset name, case and '_' / '-' insensitive (Llama-3-8B, llama_3_8b)."""
    hybrid = cli_hybrid.preset_name(text)
    if hybrid is not None:
        return hybrid
    try:
        return get_preset(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


KV_DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def _kv_dtype(text: str) -> str:
    """A KV cache dtype by any name the layout accepts (fp8 -> float8_e4m3fn)."""
    try:
        name = kvpool.KvLayout(1, 1, 64, 16, text).dtype
    except kvpool.KvError:
        name = None
    if name not in KV_DTYPES:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(KV_DTYPES)} (fp8 = float8_e4m3fn), got {text!r}"
        )
    return name


class _Parser(argparse.ArgumentParser):
    """Reports a bad option in one line (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones (options whose default is described in their help)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


# Generator options: their defaults are None so that an explicitly given one can be detected
# (and rejected with --trace, which ignores them). The effective defaults:
MAX_REQUESTS = 10_000_000  # a synthetic workload is generated in memory up front

GENERATOR_DEFAULTS = {
    "workload": "sharegpt",
    "num_requests": 2000,
    "seed": 0,
    "rate": None,
    "arrival": "poisson",
    "burst_size": 64,
    "num_prefixes": 0,
    "prefix_tokens": 0,
    "turns": 4,
    "think_time": None,
}
MAX_TURNS = 1000


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvpool", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {kvpool.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "simulate",
        help="serve a workload with paged and with contiguous KV allocation",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("model and memory")
    g.add_argument(
        "--model",
        default="llama-3-8b",
        type=_model,
        metavar="MODEL",
        help=f"KV geometry preset, one of {', '.join(sorted(PRESETS))}, or a hybrid one, "
        f"{', '.join(HYBRID_PRESETS)} (case and _/- insensitive); a hybrid model is served "
        "with kvpool's hybrid pages, all layers as full attention and vLLM's uniform page "
        "bytes at the same KV memory",
    )
    cli_hybrid.add_arguments(g)
    g.add_argument(
        "--kv-memory",
        default="16GiB",
        help="KV cache budget: KiB/MiB/GiB/TiB are powers of 1024, K/KB/M/MB/G/GB/T/TB "
        "powers of 1000 (16G = 16e9 bytes, 16GiB = 16 * 2^30); a plain number is bytes",
    )
    g.add_argument("--block-size", type=_int_in(1), default=16, help="tokens per KV block")
    (
        g.add_argument(
            "--kv-dtype",
            default="float16",
            type=_kv_dtype,
            metavar="DTYPE",
            help="KV cache element type: float16, bfloat16, fp8 (float8_e4m3fn) or "
            "float8_e5m2; fp8 holds twice the tokens in the same --kv-memory",
        ),
    )
    g.add_argument(
        "--max-model-len",
        type=_int_in(2),
        default=4096,
        help="longest sequence (contiguous reserves this); at most the tokens --kv-memory holds",
    )
    g.add_argument(
        "--device",
        default="host",
        choices=("auto", "host", "cuda"),
        help="pool backend (auto: cuda when a GPU is available); with cuda, decode attention "
        "is also measured when CuPy is installed and the kernels run on the GPU",
    )
    w = p.add_argument_group(
        "workload", "a synthetic workload, or --trace (which excludes the other options here)"
    )
    w.add_argument(
        "--workload",
        default=None,
        choices=[*sorted(LENGTH_MODELS), MULTITURN],
        help="length model, or multiturn: conversations whose turns' prompts hold the earlier "
        "turns and answers (ShareGPT lengths per message) (default: sharegpt)",
    )
    w.add_argument(
        "--trace",
        type=Path,
        help="trace file: ours (JSONL or CSV: arrival_s, prompt_tokens, output_tokens, optional "
        "prefix_group + prefix_tokens or conversation_id), or an Azure LLM inference, "
        "BurstGPT, Mooncake or ShareGPT trace (see --trace-format)",
    )
    w.add_argument(
        "--trace-format",
        default=None,
        choices=TRACE_FORMATS,
        help="the --trace file's format (default: auto, from its name and header)",
    )
    w.add_argument(
        "--num-requests",
        type=_int_in(1, MAX_REQUESTS),
        default=None,
        help="requests to generate (default: 2000)",
    )
    w.add_argument(
        "--rate",
        type=_rate,
        default=None,
        help=f"requests/s, >= {MIN_RATE:g}; 'inf' = all arrive at t=0 (default: inf)",
    )
    w.add_argument(
        "--arrival",
        default=None,
        choices=ARRIVALS,
        help="arrival process with --rate (default: poisson)",
    )
    w.add_argument(
        "--burst-size",
        type=_int_in(1),
        default=None,
        help="requests per burst with --arrival burst, >= 1 (default: 64)",
    )
    w.add_argument(
        "--num-prefixes",
        type=_int_in(0),
        default=None,
        help="groups of requests sharing a prompt prefix (default: 0, none)",
    )
    w.add_argument(
        "--prefix-tokens",
        type=_int_in(0),
        default=None,
        help="length of the shared prefix; needs --num-prefixes (default: 0)",
    )
    w.add_argument(
        "--turns",
        type=_int_in(1, MAX_TURNS),
        default=None,
        help="turns per conversation with --workload multiturn (default: 4)",
    )
    w.add_argument(
        "--think-time",
        type=_think_time,
        default=None,
        help="mean seconds between a conversation's turns (exponential; turns arrive on "
        "schedule, open loop) with --workload multiturn, or the gap between the turns "
        "of a ShareGPT --trace (default: 10)",
    )
    w.add_argument(
        "--seed", type=_int_in(0, 2**63 - 1), default=None, help="generator seed (default: 0)"
    )
    s = p.add_argument_group("scheduler")
    s.add_argument(
        "--policy",
        default="fcfs",
        choices=sorted(POLICIES),
        help="which waiting request is admitted next and which running one is preempted "
        "when blocks run out: fcfs (earliest arrival admitted, latest preempted), priority "
        "(lowest priority value admitted, highest preempted), lru (least recently scheduled "
        "first, both ways), lfu (fewest steps run first, both ways)",
    )
    s.add_argument(
        "--max-running-seqs",
        type=_int_in(1),
        default=256,
        help="most requests in one batch (running at once); also the rows of the block table",
    )
    s.add_argument(
        "--max-tokens-per-step",
        type=_int_in(1),
        default=2048,
        help="prefill + decode tokens per step, >= --max-running-seqs",
    )
    s.add_argument(
        "--watermark",
        type=_fraction,
        default=0.01,
        help="fraction of blocks admission keeps free, in [0, 1)",
    )
    s.add_argument(
        "--reserve",
        default="max_model_len",
        choices=RESERVE_MODES,
        help="what a contiguous request reserves: max_model_len tokens, its prompt + "
        "output rounded up to a power of two (pow2), or exactly its prompt + output "
        "(request, the best case for contiguous)",
    )
    s.add_argument(
        "--measure-every",
        type=_int_in(1),
        default=10,
        help="with --device cuda: time every N-th decode step",
    )
    s.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also serve the workload with prefix caching (cached prompt blocks are shared and "
        "not prefilled) and compare it with caching off at the same KV memory; not with "
        "--cpu-kv-memory (default: on when requests share prompt tokens and there is no "
        "host tier)",
    )
    d = p.add_argument_group(
        "disaggregated serving", "prefill and decode on two GPUs, KV moved between them"
    )
    d.add_argument(
        "--disaggregated",
        action="store_true",
        help="compare one prefill GPU + one decode GPU (KV transfer modelled) with two "
        "colocated replicas, instead of paged vs contiguous",
    )
    d.add_argument(
        "--transfer-gbps",
        type=cli_host_tier.finite_in(cli_host_tier.MIN_GBPS, cli_host_tier.MAX_GBPS),
        default=None,
        help="KV transfer bandwidth in GB/s (default: 330, or the measured figure of --transfer-json)",
    )
    d.add_argument(
        "--transfer-latency-us",
        type=cli_host_tier.finite_in(0, cli_host_tier.MAX_LATENCY_US, inclusive=False),
        default=None,
        help="fixed cost per transfer in us (default: 70, or the measured one-block time of --transfer-json)",
    )
    d.add_argument(
        "--transfer-json",
        type=Path,
        default=None,
        help="a `bench/kvbench.py --routine transfer` (NCCL) result: its best bandwidth at the largest size and "
        "its best one-block time become the defaults of the two options above; or a `transfer_nixl` result: "
        "the bandwidth of its scattered-request row of the most bytes (its staged row where the transport "
        "would stage that request) and the median time of its one-block row (cuda rows if it has them, else host)",
    )
    cli_host_tier.add_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--out", type=_out_dir, default=Path("kvpool-report"), help="report directory")
    o.add_argument("--no-plot", action="store_true", help="skip the PNG")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_options(args: argparse.Namespace) -> str | None:
    """Why the given options do not go together (options that would be silently ignored), or None."""
    given = [d for d in GENERATOR_DEFAULTS if getattr(args, d) is not None and d != "think_time"]
    if args.trace_format is not None and args.trace is None:
        return "--trace-format needs --trace"
    if args.prefix_caching and args.disaggregated:
        return "--prefix-caching is not modelled with --disaggregated"
    if args.prefix_caching and args.cpu_kv_memory is not None:
        return (
            "--prefix-caching is not modelled with --cpu-kv-memory (the host tier swaps a sequence's "
            "own blocks, a prefix cache shares them); drop one, or add --no-prefix-caching"
        )
    transfer = [
        f
        for f in ("transfer_gbps", "transfer_latency_us", "transfer_json")
        if getattr(args, f) is not None
    ]
    if transfer and not args.disaggregated:
        return f"{', '.join(_flag(f) for f in transfer)} need --disaggregated"
    host_tier_problem = cli_host_tier.check_options(args)
    if host_tier_problem is not None:
        return host_tier_problem
    if args.disaggregated and args.device != "host":
        return "--disaggregated models its step times; it runs with --device host"
    if args.trace is not None:
        if given:
            return (
                f"{', '.join(_flag(d) for d in given)} cannot be used with --trace "
                "(the trace gives the requests, their lengths and arrival times)"
            )
        return None
    finite_rate = args.rate is not None and math.isfinite(args.rate)
    for d in ("arrival", "burst_size"):
        if getattr(args, d) is not None and not finite_rate:
            return f"{_flag(d)} needs a finite --rate (without one, every request arrives at t=0)"
    if args.burst_size is not None and args.arrival != "burst":
        return "--burst-size needs --arrival burst"
    if args.prefix_tokens is not None and not args.num_prefixes:
        return "--prefix-tokens needs --num-prefixes >= 1 (without prefix groups there is no shared prefix)"
    if args.num_prefixes and not args.prefix_tokens:
        return (
            "--num-prefixes needs --prefix-tokens >= 1 (the length of the prefix each group "
            "shares; without it nothing is shared)"
        )
    if (args.turns is not None or args.think_time is not None) and args.workload != MULTITURN:
        flag = "--turns" if args.turns is not None else "--think-time"
        return f"{flag} needs --workload {MULTITURN} (or, --think-time, a ShareGPT --trace)"
    return None


def check_values(args: argparse.Namespace) -> str | None:
    """Why an option's value does not fit the model and the others (after _fill_defaults), or
    None. Runs before anything is generated or allocated, so a refusal costs nothing."""
    if args.device == "cuda" and not kvpool.cuda_available():
        return "--device cuda: no CUDA driver or device here; use --device host (or auto)"
    try:
        model = cli_hybrid.model(args)
    except ConfigError as e:
        return f"--model-config: {e}"
    if isinstance(model, HybridModel):
        return cli_hybrid.check_values(args, model)
    try:
        layout = model.layout(args.block_size, args.kv_dtype)
    except (ValueError, kvpool.KvError) as e:
        return f"--block-size {args.block_size} does not fit {args.model}: {e}"
    block_bytes = layout.block_bytes
    allowed = (
        f"--kv-memory must hold 1 to {kvpool.MAX_NUM_BLOCKS} blocks of {block_bytes} bytes "
        f"({args.model}, --block-size {args.block_size}), i.e. {block_bytes} to "
        f"{kvpool.MAX_NUM_BLOCKS * block_bytes} bytes"
    )
    try:
        kv_memory = parse_bytes(args.kv_memory)
    except ValueError as e:
        return f"{allowed}; {e}"
    num_blocks = kv_memory // block_bytes
    if not 1 <= num_blocks <= kvpool.MAX_NUM_BLOCKS:
        return f"{allowed}; got {kv_memory}"
    max_len = min(num_blocks * args.block_size, INT32_MAX)
    if args.max_model_len > max_len:
        return (
            f"--max-model-len must be in [2, {max_len}] (one sequence of it must fit in the "
            f"{num_blocks} blocks of --kv-memory {args.kv_memory}), got {args.max_model_len}"
        )
    if args.max_tokens_per_step < args.max_running_seqs:
        return (
            f"--max-tokens-per-step must be >= --max-running-seqs ({args.max_running_seqs}): "
            f"every running sequence decodes one token per step; got {args.max_tokens_per_step}"
        )
    row_blocks = -(-args.max_model_len // args.block_size)
    max_seqs = INT32_MAX // row_blocks
    if args.max_running_seqs > max_seqs:
        return (
            f"--max-running-seqs must be in [1, {max_seqs}] (the block table, one row of "
            f"{row_blocks} blocks per sequence, is limited to {INT32_MAX} entries); "
            f"got {args.max_running_seqs}"
        )
    host_tier_problem = cli_host_tier.check_values(args, block_bytes)
    if host_tier_problem is not None:
        return host_tier_problem
    if args.trace is None and args.prefix_tokens > args.max_model_len - 2:
        return (
            f"--prefix-tokens must be in [0, {args.max_model_len - 2}] (--max-model-len "
            f"{args.max_model_len} minus one prompt and one output token); got {args.prefix_tokens}"
        )
    return None


def _fill_defaults(args: argparse.Namespace) -> None:
    for dest, default in GENERATOR_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if args.rate is not None and math.isinf(args.rate):
        args.rate = None  # offline: everything at t=0


def _workload(args: argparse.Namespace) -> tuple[list, dict]:
    """The requests (with token ids) and what the report says about them."""
    if args.trace is not None:
        requests, info = trace_workload(args)
    else:
        requests, info = synthetic_workload(args)
    shared = shares_prefixes(requests)
    if args.disaggregated:
        args.prefix_caching, why = False, "not modelled with --disaggregated"
    elif args.cpu_kv_memory is not None:
        args.prefix_caching, why = False, "not modelled with --cpu-kv-memory"
    elif args.prefix_caching is None:
        args.prefix_caching = shared
        why = (
            "the workload shares prompt tokens" if shared else "no two requests share prompt tokens"
        )
    else:
        why = "--prefix-caching" if args.prefix_caching else "--no-prefix-caching"
    info["prefix_sharing"] = shared
    info["prefix_caching"] = f"{'on' if args.prefix_caching else 'off'} ({why})"
    return requests, info


class SetupError(Exception):
    """Something outside the options (a missing package) stops the run."""


def check_out(out: Path) -> str | None:
    """Why the report directory cannot be created or written, or None."""
    if out.exists():
        if not out.is_dir():
            return f"--out {out} exists and is not a directory"
        if not os.access(out, os.W_OK | os.X_OK):
            return f"--out {out} is not writable"
        return None
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"--out {out}: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--out {out}: cannot create it, {parent} is not writable"
    return None


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

    console = Console(stderr=False)
    requests, info = _workload(args)
    config = SchedulerConfig(
        max_model_len=args.max_model_len,
        max_running_seqs=args.max_running_seqs,
        max_tokens_per_step=args.max_tokens_per_step,
        watermark=args.watermark,
        policy=args.policy,
    )
    model = cli_hybrid.model(args)
    if isinstance(model, HybridModel):
        full_command = ["kvpool", *(sys.argv[1:] if command is None else command)]
        return cli_hybrid.run(args, model, requests, info, console, full_command)
    spec = SimulationSpec(
        preset=model,
        kv_memory_bytes=parse_bytes(args.kv_memory),
        requests=requests,
        config=config,
        block_size=args.block_size,
        device=args.device,
        reserve=args.reserve,
        measure_every=args.measure_every,
        kv_dtype=args.kv_dtype,
        workload_info=info,
        host_tier=cli_host_tier.spec(args),
        prefix_caching=args.prefix_caching,
    )
    if args.disaggregated:
        return _disaggregated(args, spec, console)
    t0 = time.perf_counter()
    report = simulate(spec) if args.no_progress else _simulate_with_progress(spec, console)
    report["total_wall_s"] = time.perf_counter() - t0
    report["command"] = ["kvpool", *(sys.argv[1:] if command is None else command)]
    print_table(report, console)
    json_path = write_json(report, args.out)
    console.print(f"report: {json_path}")
    if not args.no_plot:
        console.print(f"plot:   {write_png(report, args.out)}")
    return 0


def _transfer_figures(args: argparse.Namespace) -> tuple[float, float, str]:
    """(GB/s, latency s, where they come from): the options, else the measured JSON, else defaults."""
    gbps, latency_us, source = 330.0, 70.0, "defaults"
    if args.transfer_json is not None:
        import json

        try:
            result = json.loads(args.transfer_json.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--transfer-json {args.transfer_json}: {e}") from None
        try:  # its message starts with the path
            gbps, latency_us, source = link_from_benchmark(result, str(args.transfer_json))
        except ValueError as e:
            raise ValueError(f"--transfer-json {e}") from None
    gbps = args.transfer_gbps or gbps
    latency_us = args.transfer_latency_us or latency_us
    return gbps, latency_us * 1e-6, source


def _disaggregated(args: argparse.Namespace, spec: Any, console: Any) -> int:
    import json

    from rich.table import Table

    gbps, latency_s, source = _transfer_figures(args)
    report = simulate_disaggregated(spec, gbps, latency_s)
    report["transfer"]["source"] = source
    report["command"] = ["kvpool", *sys.argv[1:]]
    table = Table(
        title=f"disaggregated (1 prefill + 1 decode GPU, KV at {gbps:g} GB/s) vs 2 colocated replicas, modelled"
    )
    for col in ("", "disaggregated", "colocated x2", "ratio"):
        table.add_column(col, justify="right")
    ratios = report["ratios_disaggregated_over_colocated"]
    for key in ratios:
        table.add_row(
            key,
            f"{report['disaggregated'][key]:.4g}",
            f"{report['colocated_two_replicas'][key]:.4g}",
            f"{ratios[key]:.3f}",
        )
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "disaggregated.json"
    path.write_text(json.dumps(report, indent=1))
    console.print(f"report: {path}")
    return 0


def _simulate_with_progress(spec, console) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = len(spec.requests)
    with Progress(
        TextColumn("{task.description:<11}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        names = (
            ("paged",)
            + (("paged_host_tier",) if spec.host_tier else ())
            + ("contiguous",)
            + (("paged_prefix_caching",) if spec.prefix_caching else ())
        )
        tasks = {name: bar.add_task(name, total=total) for name in names}
        last = {"t": 0.0}

        def progress(name: str, done: int, total: int) -> None:
            now = time.perf_counter()
            if done == total or now - last["t"] > 0.1:
                last["t"] = now
                bar.update(tasks[name], completed=done)

        return simulate(spec, progress)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0), or a bad option already reported in one line (2)
        return e.code if isinstance(e.code, int) else 2
    problem = check_options(args)
    if problem is None:
        _fill_defaults(args)
        problem = check_values(args) or check_out(args.out)
    if problem is not None:
        print(f"kvpool {args.command}: error: {problem}", file=sys.stderr)
        return 2
    command = None if argv is None else [str(a) for a in argv]
    try:
        return simulate_command(args, command)
    except ValueError as e:  # a trace file's contents (TraceError) or a value met mid-run
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
