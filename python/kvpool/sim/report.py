"""The simulation report: a JSON file, a PNG plot and the terminal table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

JSON_NAME = "simulate.json"
PNG_NAME = "simulate.png"


def _finite(x: Any) -> Any:
    """JSON has no inf/nan: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def write_json(report: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / JSON_NAME
    path.write_text(json.dumps(_finite(report), indent=1) + "\n", encoding="utf-8")
    return path


CACHED = "paged_prefix_caching"  # the result of the prefix-caching run, when there is one


def write_png(report: dict[str, Any], out_dir: Path, dpi: int = 110) -> Path:
    """KV utilization and running requests over (modelled) time, paged against contiguous
    (and paged with prefix caching, whose hit rate over time gets a third panel)."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PNG_NAME
    cached = report["results"].get(CACHED)
    panels = 3 if cached is not None else 2
    fig, axes = plt.subplots(panels, 1, figsize=(9, 3.25 * panels), sharex=True)
    ax_util, ax_run = axes[0], axes[1]
    colors = {
        "paged": "tab:blue",
        "paged_host_tier": "tab:green",
        "contiguous": "tab:orange",
        CACHED: "tab:green",
    }
    for name, result in report["results"].items():
        s = result["series"]
        util = np.array([np.nan if u is None else u for u in s["kv_utilization"]], dtype=float)
        label = f"{name} (shared blocks once per request)" if name == CACHED else name
        ax_util.plot(s["time_s"], util, label=label, color=colors.get(name), lw=1.2)
        ax_run.plot(s["time_s"], s["running"], label=name, color=colors.get(name), lw=1.2)
    model = report["model"]
    ax_util.set_title(
        f"{model['name']}, {report['kv_memory_bytes'] / 2**30:.1f} GiB KV, "
        f"{report['workload'].get('num_requests')} requests ({report['workload'].get('kind', 'trace')})"
    )
    ax_util.set_ylabel(  # a hybrid report counts bytes (hybrid_runner.py)
        report.get("kv_utilization_label", "KV utilization\n(tokens stored / slots allocated)")
    )
    peak = max(
        (
            u
            for r in report["results"].values()
            for u in r["series"]["kv_utilization"]
            if u is not None
        ),
        default=1,
    )
    # Above 1 only for the prefix-caching curve, whose shared blocks count once per request.
    ax_util.set_ylim(0, max(1.05, 1.05 * peak))
    ax_run.set_ylabel("running requests")
    if cached is not None:
        s = cached["series"]
        rate, total = (
            np.array([np.nan if u is None else u for u in s[k]], dtype=float)
            for k in ("prefix_hit_rate", "prefix_hit_rate_cumulative")
        )
        axes[2].plot(
            s["time_s"],
            rate,
            label="over a fiftieth of the steps",
            color=colors[CACHED],
            lw=0.8,
            alpha=0.6,
        )
        axes[2].plot(
            s["time_s"],
            total,
            label=f"since the start (overall {cached['prefix_hit_rate']:.3f})",
            color="black",
            lw=1.5,
        )
        axes[2].set_ylabel("prefix cache hit rate\n(cached / prompt tokens)")
        axes[2].set_ylim(0, 1.05)
    axes[-1].set_xlabel(f"time (s, {report['timing']['clock']})")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


UTILIZATION_LABEL = "KV utilization (tokens stored / slots allocated)"
# With prefix caching a block holds its tokens once for every request that shares it, and the
# result's kv_utilization counts them once per request, so it passes 1 when many requests share
# a prefix. That figure is not a utilization, so the utilization row shows "-" for the
# caching run and this row, present only with caching, shows the figure under its own name
# (for the runs without sharing it equals the utilization).
PER_REQUEST_LABEL = "request tokens / slots allocated (shared blocks once per request)"

CACHE_ROWS = (
    (PER_REQUEST_LABEL, "kv_utilization", "{:.3f}"),
    ("prefix hit rate (tokens)", "prefix_hit_rate", "{:.3f}"),
    ("prefill tokens", "prefill_tokens", "{:,}"),
    ("TTFT mean (modelled)", "ttft_mean_s", "{:.2f} s"),
    ("TTFT p99 (modelled)", "ttft_p99_s", "{:.2f} s"),
)

ROWS = (
    ("completed requests", "completed", "{:,}"),
    ("steps", "steps", "{:,}"),
    ("mean concurrency", "mean_running", "{:.1f}"),
    ("peak concurrency", "peak_running", "{:,}"),
    (UTILIZATION_LABEL, "kv_utilization", "{:.3f}"),
    ("mean wasted KV", "mean_wasted_kv_bytes", _gib),
    ("preemptions", "preemptions", "{:,}"),
    ("tokens / step", "tokens_per_step", "{:.1f}"),
    ("output tokens / s (modelled)", "modelled_output_tokens_per_s", "{:,.0f}"),
    ("latency mean (modelled)", "latency_mean_s", "{:.1f} s"),
    ("simulator wall time (measured)", "wall_s", "{:.2f} s"),
    ("allocator share (measured)", "alloc_share", "{:.1%}"),
)


# With a host tier (--cpu-kv-memory) the table gains these rows; `key` is read from a result,
# "host_tier.<name>" from its host-tier counters (the other columns show "-").
HOST_TIER_ROWS = (
    ("preemptions by swap", "host_tier.swapped_out", "{:,}"),
    ("preemptions by recompute", "host_tier.recomputed", "{:,}"),
    ("  of which host tier full", "host_tier.recomputed_tier_full", "{:,}"),
    ("recomputed tokens", "recomputed_tokens", "{:,}"),
    ("swapped bytes (out + in)", "host_tier.swapped_bytes", _gib),
    ("modelled copy time", "host_tier.copy_s", "{:.2f} s"),
    ("TTFT mean (modelled)", "ttft_mean_s", "{:.2f} s"),
    ("TTFT p99 (modelled)", "ttft_p99_s", "{:.2f} s"),
    ("latency p99 (modelled)", "latency_p99_s", "{:.1f} s"),
)

COLUMNS = {
    "paged": "paged",
    "paged_host_tier": "paged + host tier",
    "contiguous": "contiguous",
    CACHED: "paged + prefix caching",
}


def _cell(result: dict[str, Any], key: str, fmt: Any, label: str) -> str:
    if label == UTILIZATION_LABEL and result.get("kv_utilization_note") is not None:
        return "-"  # shared blocks: the figure is PER_REQUEST_LABEL's, not a utilization
    if key.startswith("host_tier."):
        counts = result.get("host_tier")
        name = key.removeprefix("host_tier.")
        if counts is None:
            v = None
        elif name == "swapped_bytes":
            v = counts["swapped_out_bytes"] + counts["swapped_in_bytes"]
        else:
            v = counts[name]
    else:
        v = result.get(key)
    return "-" if v is None else (fmt(v) if callable(fmt) else fmt.format(v))


def table_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    """(label, one cell per result in report order). A report has a host-tier result or a
    prefix-caching one, never both (the simulator does not combine them)."""
    results = list(report["results"].values())
    paged, contiguous = report["results"]["paged"], report["results"]["contiguous"]
    rows_spec = (
        ROWS
        + (HOST_TIER_ROWS if "paged_host_tier" in report["results"] else ())
        + (CACHE_ROWS if CACHED in report["results"] else ())
    )
    rows = [(label, *(_cell(r, key, fmt, label) for r in results)) for label, key, fmt in rows_spec]
    if "measured_decode" in paged and "measured_decode" in contiguous:
        rows.append(
            (
                "decode tokens / s (measured, attention)",
                *(
                    f"{r['measured_decode']['decode_tokens_per_s']:,.0f}"
                    if "measured_decode" in r
                    else "-"
                    for r in results
                ),
            )
        )
    return rows


def table_title(report: dict[str, Any]) -> str:
    """Names every column the table compares, in column order."""
    names = " vs ".join(COLUMNS.get(name, name) for name in report["results"])
    return f"kvpool simulate: {names} (same KV memory)"


def skipped_line(report: dict[str, Any]) -> str | None:
    """For a trace workload: how many of its rows the reader left out, and why (None for a
    generated workload)."""
    w = report["workload"]
    if w.get("kind") != "trace":
        return None
    too_long, failed = w.get("skipped_too_long", 0), w.get("skipped_failed", 0)
    return (
        f"trace rows skipped: {too_long + failed:,} ({too_long:,} longer than max_model_len "
        f"{report['scheduler']['max_model_len']:,}, {failed:,} failed: no response tokens)"
    )


def print_table(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    cached = CACHED in report["results"]
    table = Table(title=table_title(report), caption=skipped_line(report))
    table.add_column("")
    for name in report["results"]:
        table.add_column(COLUMNS.get(name, name), justify="right")
    for row in table_rows(report):
        table.add_row(*row)
    console.print(table)
    c = report["comparison"]
    console.print(
        f"paged serves [bold]{ratio_text(c['mean_concurrency_ratio'])}x[/bold] the mean concurrency of "
        f"contiguous reservation at KV utilization [bold]{c['paged_kv_utilization']:.3f}[/bold]."
    )
    if "host_tier_comparison" in report:
        console.print(host_tier_line(report))
    if cached:
        console.print(prefix_caching_line(report))
    console.print(
        f"time: {report['timing']['decode_attention']}; simulated clock is modelled "
        f"({report['timing']['model']['hardware']})."
    )


def prefix_caching_line(report: dict[str, Any]) -> str:
    """One sentence: what prefix caching changed against paged without it."""
    pc = report["prefix_caching"]
    return (
        f"prefix caching: hit rate [bold]{pc['hit_rate_tokens']:.3f}[/bold] of prompt tokens, "
        f"{pc['prefill_tokens_saved']:,} prefill tokens saved ({pc['prefill_tokens_saved_fraction']:.1%}), "
        f"throughput x{ratio_text(pc['modelled_throughput_ratio'])}, "
        f"TTFT mean x{ratio_text(pc['ttft_mean_ratio'])}, "
        f"peak concurrency x{ratio_text(pc['peak_concurrency_ratio'])} against caching off."
    )


def ratio_text(x: float | None) -> str:
    """A ratio for the summary lines: two decimals from 1 up, three significant digits below
    (a TTFT that fell 500-fold reads x0.00200, not x0.00); "-" where it is undefined."""
    if x is None:
        return "-"
    if not math.isfinite(x):
        return "inf" if x > 0 else "nan"
    if abs(x) >= 1 or x == 0:
        return f"{x:,.2f}"
    return f"{x:.3g}"


def host_tier_line(report: dict[str, Any]) -> str:
    """One sentence: what the host tier changed against paged recompute-only."""
    h = report["host_tier_comparison"]
    tier = report["results"]["paged_host_tier"]["host_tier"]
    return (
        f"host tier ({tier['mode']}, {tier['host_link_bytes_per_s'] / 1e9:g} GB/s): "
        f"{h['preemptions_by_swap']:,} preemptions by swap, {h['preemptions_by_recompute']:,} by recompute "
        f"({h['recomputed_because_tier_full']:,} with the tier full); "
        f"{h['recomputed_tokens_saved']:,} recomputed tokens saved, {_gib(h['swapped_bytes'])} copied; "
        f"throughput x{ratio_text(h['modelled_throughput_ratio'])}, "
        f"TTFT mean x{ratio_text(h['ttft_mean_ratio'])}, "
        f"latency mean x{ratio_text(h['latency_mean_ratio'])} against paged without a tier."
    )
