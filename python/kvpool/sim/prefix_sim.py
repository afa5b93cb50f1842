"""The figures of a simulation's prefix-caching run and its comparison with caching off.

`runner.simulate` serves the workload with paged KV (caching off) and contiguous KV; with
`SimulationSpec.prefix_caching` it also serves it with paged KV on a pool of the same number
of blocks with prefix caching on (runner.run_prefix_caching, over prefix.PrefixCachedKv), and
the report gains `results["paged_prefix_caching"]` and `prefix_caching` (here: hit rate,
prefill tokens saved, throughput, TTFT and concurrency against the paged run without caching).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.scheduler.metrics import StepMetrics


def hit_rate_series(
    metrics: StepMetrics, steps: list[int], window_steps: int | None = None
) -> list[float | None]:
    """The prefix hit rate (cached / queried tokens of the requests admitted) over the
    `window_steps` steps up to each of `steps` (default: a fiftieth of the run; the whole
    run so far with window_steps=-1); None where nothing was admitted in the window."""
    a = metrics.arrays()
    n = len(metrics)
    window = n if window_steps == -1 else (window_steps or max(1, n // 50))
    queried = np.concatenate([[0], np.cumsum(a["queried_tokens"])])
    cached = np.concatenate([[0], np.cumsum(a["cached_tokens"])])
    out: list[float | None] = []
    for i in steps:
        lo, hi = max(0, i + 1 - window), i + 1
        q = queried[hi] - queried[lo]
        out.append(round(float((cached[hi] - cached[lo]) / q), 5) if q else None)
    return out


def compare_caching(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """Prefix caching on against off, same KV memory and workload; ratios are on / off."""

    def ratio(key: str) -> float:
        return on[key] / off[key] if off[key] else float("inf")

    return {
        "hit_rate_tokens": on["prefix_hit_rate"],
        "pool_hit_rate_tokens": on["prefix_cache_stats"]["hit_rate"],
        "cached_tokens": on["cached_tokens"],
        "prefill_tokens_on": on["prefill_tokens"],
        "prefill_tokens_off": off["prefill_tokens"],
        "prefill_tokens_saved": off["prefill_tokens"] - on["prefill_tokens"],
        "prefill_tokens_saved_fraction": 1 - ratio("prefill_tokens")
        if off["prefill_tokens"]
        else 0.0,
        "modelled_throughput_ratio": ratio("modelled_output_tokens_per_s"),
        "ttft_mean_ratio": ratio("ttft_mean_s"),
        "ttft_p99_ratio": ratio("ttft_p99_s"),
        "latency_mean_ratio": ratio("latency_mean_s"),
        "peak_concurrency_ratio": ratio("peak_running"),
        "mean_concurrency_ratio": ratio("mean_running"),
        "preemptions_on": on["preemptions"],
        "preemptions_off": off["preemptions"],
    }
