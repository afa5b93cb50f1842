"""Per-step metrics of a scheduler run and their summary."""

from __future__ import annotations

from typing import Any

import numpy as np

FIELDS = (
    "time_s",  # modelled clock at the end of the step
    "running",
    "waiting",
    "preempted",  # preemptions during this step
    "blocks_used",
    "tokens_stored",  # tokens whose KV is held
    "slots_allocated",  # token slots reserved for them (blocks x block_size, or reservations)
    "prefill_tokens",
    "decode_tokens",
    "queried_tokens",  # tokens to prefill of the requests admitted (prefix cache queries)
    "cached_tokens",  # of which the prefix cache held the KV (no prefill needed)
    "alloc_s",  # measured: perf_counter around pool / block-table / first-fit calls
    "wall_s",  # measured: the whole step of the simulator
)


class StepMetrics:
    """Column lists, one entry per step; `arrays()` turns them into NumPy."""

    def __init__(self) -> None:
        self.columns: dict[str, list] = {f: [] for f in FIELDS}
        self._appenders = [(f, self.columns[f].append) for f in FIELDS]

    def record(self, **values: float) -> None:
        for name, append in self._appenders:
            append(values[name])

    def __len__(self) -> int:
        return len(self.columns["time_s"])

    def arrays(self) -> dict[str, np.ndarray]:
        return {f: np.asarray(v) for f, v in self.columns.items()}


def summarize(metrics: StepMetrics, token_bytes: int) -> dict[str, Any]:
    """The figures of the comparison table (means are over steps, i.e. over forward passes)."""
    a = metrics.arrays()
    steps = len(metrics)
    if steps == 0:
        raise ValueError("no steps were run")
    tokens = a["tokens_stored"].astype(np.float64)
    slots = a["slots_allocated"].astype(np.float64)
    wall = float(a["wall_s"].sum())
    alloc = float(a["alloc_s"].sum())
    out_tokens = int(a["decode_tokens"].sum())
    batch_tokens = out_tokens + int(a["prefill_tokens"].sum())
    sim_s = float(a["time_s"][-1])
    queried, cached = int(a["queried_tokens"].sum()), int(a["cached_tokens"].sum())
    return {
        "steps": steps,
        "mean_running": float(a["running"].mean()),
        "peak_running": int(a["running"].max()),
        "mean_waiting": float(a["waiting"].mean()),
        "peak_blocks_used": int(a["blocks_used"].max()),
        "kv_utilization": float(tokens.sum() / slots.sum()) if slots.sum() else 0.0,
        "mean_wasted_kv_bytes": float(((slots - tokens) * token_bytes).mean()),
        "peak_wasted_kv_bytes": float(((slots - tokens) * token_bytes).max()),
        "preemptions": int(a["preempted"].sum()),
        "output_tokens": out_tokens,
        "prefill_tokens": batch_tokens - out_tokens,
        "queried_tokens": queried,
        "cached_tokens": cached,
        "prefix_hit_rate": cached / queried if queried else 0.0,
        "tokens_per_step": batch_tokens / steps,
        "output_tokens_per_step": out_tokens / steps,
        "modelled_time_s": sim_s,
        "modelled_output_tokens_per_s": out_tokens / sim_s if sim_s > 0 else 0.0,
        "wall_s": wall,
        "alloc_s": alloc,
        "alloc_share": alloc / wall if wall > 0 else 0.0,
    }


def latency_summary(seqs: list) -> dict[str, float]:
    """Request latency and time to first token, in modelled seconds."""
    lat = np.array([s.finish_s - s.request.arrival_s for s in seqs])
    ttft = np.array([s.first_token_s - s.request.arrival_s for s in seqs])
    if len(lat) == 0:
        return {}
    return {
        "latency_mean_s": float(lat.mean()),
        "latency_p50_s": float(np.percentile(lat, 50)),
        "latency_p99_s": float(np.percentile(lat, 99)),
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
    }
