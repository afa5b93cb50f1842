"""`kvpool simulate` for hybrid models: `--model` naming a hybrid preset or `--model-config`
a config.json whose layers are not all full attention run the three KV schemes of
hybrid_runner.py instead of paged vs contiguous; with prefix caching (`--prefix-caching`, or
by default when requests share prompt tokens) each scheme serves the workload with a prefix
cache and the table adds its hit rate."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from kvpool.scheduler.core import SchedulerConfig
from kvpool.scheduler.hybrid import prefill_peak_pages
from kvpool.sim.hybrid_config import ConfigError, model_from_file
from kvpool.sim.hybrid_prefix import admission_pages
from kvpool.sim.hybrid_presets import HYBRID_PRESETS, HybridModel
from kvpool.sim.hybrid_report import print_table
from kvpool.sim.hybrid_runner import SCHEMES, HybridSimulationSpec, simulate_hybrid
from kvpool.sim.hybrid_schemes import (
    DTYPE_BYTES,
    all_full_scheme,
    hybrid_spec,
    uniform_page_spec,
)
from kvpool.sim.presets import ModelPreset, get_preset, parse_bytes
from kvpool.sim.report import write_json, write_png


def preset_name(text: str) -> str | None:
    """The hybrid preset `text` names (case and '_' / '-' insensitive), or None."""
    key = text.lower().replace("_", "-")
    return key if key in HYBRID_PRESETS else None


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--model-config",
        type=Path,
        default=None,
        metavar="PATH",
        help="a Hugging Face config.json file (read from disk, nothing downloaded) instead of "
        "--model: Llama-like models, or hybrid ones (layer_types, sliding_window, "
        "attention_chunk_size, full_attention_interval, kv_lora_rank)",
    )


def model(args: argparse.Namespace) -> ModelPreset | HybridModel:
    """The model the options name (a config file's, a hybrid preset, or a uniform preset)."""
    if args.model_config is not None:
        return model_from_file(args.model_config)
    name = preset_name(args.model)
    return HYBRID_PRESETS[name] if name else get_preset(args.model)


# Options the hybrid runs do not model, and the value that leaves them out.
UNSUPPORTED = {
    "cpu_kv_memory": None,
    "disaggregated": False,
}


def check_values(args: argparse.Namespace, hybrid: HybridModel) -> str | None:
    """Why the options do not fit a hybrid run, or None (after _fill_defaults)."""
    for dest, off in UNSUPPORTED.items():
        if getattr(args, dest) != off:
            flag = "--" + dest.replace("_", "-")
            return f"{flag} is not modelled with a hybrid model ({hybrid.name})"
    if args.device == "cuda":
        return f"a hybrid model ({hybrid.name}) runs with --device host (its time is modelled)"
    if args.kv_dtype not in DTYPE_BYTES:
        return f"--kv-dtype must be one of {', '.join(DTYPE_BYTES)}"
    try:
        kv_memory = parse_bytes(args.kv_memory)
    except ValueError as e:
        return f"--kv-memory: {e}"
    if args.max_tokens_per_step < args.max_running_seqs:
        return (
            f"--max-tokens-per-step must be >= --max-running-seqs ({args.max_running_seqs}): "
            f"every running sequence decodes one token per step; got {args.max_tokens_per_step}"
        )
    return capacity_problem(hybrid, kv_memory, args.max_model_len, args)


def capacity_problem(
    hybrid: HybridModel, kv_memory: int, max_model_len: int, args: argparse.Namespace
) -> str | None:
    """Why some scheme cannot hold one sequence of max_model_len in `kv_memory`, or None."""
    chunk = args.max_tokens_per_step
    for name, make in (("hybrid pages", hybrid_spec), ("uniform page bytes", uniform_page_spec)):
        spec = make(hybrid, args.kv_dtype)
        pages = kv_memory // spec.page_bytes
        needed = prefill_peak_pages(spec, max_model_len, chunk)
        if pages < needed:
            return (
                f"--kv-memory {args.kv_memory} holds {pages} pages of {spec.page_bytes} bytes "
                f"({name}), fewer than the {needed} one sequence of --max-model-len "
                f"{max_model_len} needs; give more --kv-memory or a lower --max-model-len"
            )
        # With caching (asked for, or on by default when the workload shares prefixes) the
        # whole prompt, a checkpoint and a hit's copies are taken at admission.
        cached = admission_pages(spec, max_model_len)
        if args.prefix_caching is not False and pages < cached:
            return (
                f"--kv-memory {args.kv_memory} holds {pages} pages of {spec.page_bytes} bytes "
                f"({name}), fewer than the {cached} one sequence of --max-model-len "
                f"{max_model_len} needs at admission with prefix caching; give more "
                "--kv-memory, a lower --max-model-len or --no-prefix-caching"
            )
    try:
        full = all_full_scheme(hybrid, args.kv_dtype, args.max_running_seqs)
    except ValueError:
        return None  # no attention layer: the all-full run is left out
    blocks = full.num_blocks(kv_memory)
    needed = -(-max_model_len // full.block_size)
    if blocks < needed:
        return (
            f"--kv-memory {args.kv_memory} leaves {blocks} blocks of {full.block_bytes} bytes "
            f"for all full attention (beside {full.state_slots} state slots), fewer than the "
            f"{needed} one sequence of --max-model-len {max_model_len} needs"
        )
    return None


def run(
    args: argparse.Namespace,
    hybrid: HybridModel,
    requests: list,
    info: dict[str, Any],
    console: Any,
    command: list[str],
) -> int:
    """Serve the workload with every scheme; print the table, write the JSON and the PNG."""
    config = SchedulerConfig(
        max_model_len=args.max_model_len,
        max_running_seqs=args.max_running_seqs,
        max_tokens_per_step=args.max_tokens_per_step,
        watermark=args.watermark,
        policy=args.policy,
    )
    schemes = SCHEMES if hybrid.token_groups() else ("hybrid",)
    spec = HybridSimulationSpec(
        hybrid,
        parse_bytes(args.kv_memory),
        requests,
        config,
        args.kv_dtype,
        info,
        schemes,
        prefix_caching=args.prefix_caching,
    )
    t0 = time.perf_counter()
    report = simulate_hybrid(spec) if args.no_progress else _with_progress(spec, console)
    report["total_wall_s"] = time.perf_counter() - t0
    report["command"] = command
    print_table(report, console)
    console.print(f"report: {write_json(report, args.out)}")
    if not args.no_plot:
        console.print(f"plot:   {write_png(report, args.out)}")
    return 0


def _with_progress(spec: HybridSimulationSpec, console: Any) -> dict[str, Any]:
    """simulate_hybrid with one progress bar per scheme."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = len(spec.requests)
    columns = (TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as bar:
        tasks = {name: bar.add_task(name, total=total) for name in spec.schemes}
        last = {"t": 0.0}

        def progress(name: str, done: int, total: int) -> None:
            now = time.perf_counter()
            if done == total or now - last["t"] > 0.1:
                last["t"] = now
                bar.update(tasks[name], completed=done)

        return simulate_hybrid(spec, progress)


__all__ = ["ConfigError", "add_arguments", "check_values", "model", "preset_name", "run"]
