"""The hybrid simulation's terminal table and summary lines (the JSON and the PNG are
report.py's: a hybrid report has the same `results` / `series` shape)."""

from __future__ import annotations

from typing import Any

COLUMNS = {
    "hybrid": "hybrid pages (kvpool)",
    "all_full": "all full attention",
    "uniform_page": "uniform page bytes (vLLM)",
}


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


ROWS = (
    ("completed requests", "completed", "{:,}"),
    ("steps", "steps", "{:,}"),
    ("mean running requests", "mean_running", "{:.1f}"),
    ("peak running requests", "peak_running", "{:,}"),
    ("KV utilization (bytes needed / held)", "kv_utilization", "{:.3f}"),
    ("prefix hit rate (tokens)", "prefix_hit_rate", "{:.3f}"),
    ("mean KV held", "mean_held_kv_bytes", _gib),
    ("preemptions", "preemptions", "{:,}"),
    ("output tokens / s (modelled)", "modelled_output_tokens_per_s", "{:,.0f}"),
    ("latency mean (modelled)", "latency_mean_s", "{:.1f} s"),
    ("TTFT mean (modelled)", "ttft_mean_s", "{:.2f} s"),
    ("simulator wall time (measured)", "wall_s", "{:.2f} s"),
    ("allocator share (measured)", "alloc_share", "{:.1%}"),
)


CACHING_ONLY = ("prefix_hit_rate",)  # rows shown only when the schemes ran with a prefix cache


def table_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    results = list(report["results"].values())
    rows = []
    for label, key, fmt in ROWS:
        if key in CACHING_ONLY and not report.get("prefix_caching"):
            continue
        cells = []
        for r in results:
            v = r.get(key)
            cells.append("-" if v is None else (fmt(v) if callable(fmt) else fmt.format(v)))
        rows.append((label, *cells))
    return rows


def summary_lines(report: dict[str, Any]) -> list[str]:
    """One sentence per baseline: what the hybrid pages serve against it."""
    lines = []
    for key, c in report.get("comparison", {}).items():
        other = COLUMNS.get(key.removeprefix("hybrid_over_"), key)
        running = c["mean_running_ratio"]
        throughput = c["modelled_throughput_ratio"]
        lines.append(
            f"hybrid pages run {'-' if running is None else f'{running:.2f}'}x the mean "
            f"running requests of {other} at the same KV memory, throughput "
            f"x{'-' if throughput is None else f'{throughput:.2f}'} (modelled)."
        )
    if report.get("prefix_caching"):
        for name, r in report["results"].items():
            how = r["scheme"].get("prefix_caching")
            if how is not None:
                lines.append(f"{COLUMNS.get(name, name)}: prefix caching {how}.")
    return lines


def print_table(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    model = report["model"]
    table = Table(
        title=f"kvpool simulate: {model['name']} ({model['describe']}), "
        f"{report['kv_memory_bytes'] / 2**30:.1f} GiB KV for each scheme"
    )
    table.add_column("")
    for name in report["results"]:
        table.add_column(COLUMNS.get(name, name), justify="right")
    for row in table_rows(report):
        table.add_row(*row)
    console.print(table)
    for line in summary_lines(report):
        console.print(line)
    shared = "; above 1 where requests share cached pages" if report.get("prefix_caching") else ""
    console.print(
        f"time: modelled ({report['timing']['model']['hardware']}); KV utilization is the "
        f"bytes the running requests' live keys and states need over the bytes held for them"
        f"{shared}."
    )
