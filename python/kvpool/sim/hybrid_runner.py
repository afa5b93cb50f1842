"""One hybrid simulation: the same workload served with a hybrid model's KV held three ways in
the same bytes (hybrid_schemes.py): kvpool's hybrid pages (`hybrid`), every attention layer
as full attention in a uniform pool (`all_full`), and vLLM's uniform page bytes
(`uniform_page`). The same loop (kvpool.scheduler.core) runs each, on the real allocator and
tables (HybridKv over kvpool.HybridTables, PagedKv over kvpool.BlockTables), with the same
modelled step time (hybrid_cost.py).

KV utilization here is in bytes: what the running requests' live tokens and states need
(the keys their next queries see, their states) over what the scheme holds for them (the
pages in use, and for `all_full` with states the slots of the running requests). Token
slots, the uniform report's measure, are not one number across groups whose pages hold
different tokens.

With `prefix_caching` every scheme serves the workload with a prefix cache in the same
bytes: the hybrid pages and the uniform page bytes on `HybridTables` over a caching pool
(hybrid_prefix.py's `HybridPrefixCachedKv`: states checkpointed where prompts branch, at
16-token chunks for the hybrid pages and at whole attention blocks for the uniform page
bytes, as vLLM stores them), all full attention on `BlockTables` over a caching pool
(scheduler/prefix.py's `PrefixCachedKv`). A model with recurrent states has no prefix cache
in the all-full scheme: its states sit in a static reserve of live slots, with no
checkpoint to resume a prefix from, so that scheme runs with caching off and hits nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import kvpool
from kvpool.scheduler.core import Scheduler, SchedulerConfig
from kvpool.scheduler.hybrid import HybridKv
from kvpool.scheduler.metrics import latency_summary, summarize
from kvpool.scheduler.paged import PagedKv
from kvpool.scheduler.prefix import PrefixCachedKv
from kvpool.scheduler.request import Request
from kvpool.sim.hybrid_cost import HybridStepCost
from kvpool.sim.hybrid_prefix import CHUNK, HybridPrefixCachedKv
from kvpool.sim.hybrid_presets import HybridModel
from kvpool.sim.hybrid_schemes import (
    all_full_scheme,
    elem_bytes,
    hybrid_spec,
    page_pool,
    proxy_spec,
    scheme_groups,
    uniform_page_plan,
    uniform_page_spec,
)
from kvpool.sim.runner import _check_served, _version, proxy_layout
from kvpool.sim.workload import describe

SCHEMES = ("hybrid", "all_full", "uniform_page")
Progress = Callable[[str, int, int], None]


@dataclass
class HybridSimulationSpec:
    model: HybridModel
    kv_memory_bytes: int
    requests: list[Request]
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_dtype: str = "bfloat16"
    workload_info: dict[str, Any] = field(default_factory=dict)
    schemes: tuple[str, ...] = SCHEMES
    prefix_caching: bool = False  # every scheme with a prefix cache (the module docstring)


@dataclass
class SchemeRun:
    """One scheme's backend, ready to serve, and how its held bytes are counted."""

    backend: Any
    held_bytes: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (blocks used, running) -> bytes
    info: dict[str, Any]


def _paged_scheme(spec: HybridSimulationSpec, name: str) -> SchemeRun:
    real = (hybrid_spec if name == "hybrid" else uniform_page_spec)(spec.model, spec.kv_dtype)
    num_pages = spec.kv_memory_bytes // real.page_bytes
    if num_pages < 1:
        raise ValueError(
            f"{name}: a KV budget of {spec.kv_memory_bytes} bytes holds no page of "
            f"{real.page_bytes} bytes"
        )
    proxy, scale = proxy_spec(scheme_groups(spec.model, name, spec.kv_dtype), real, spec.kv_dtype)
    # vLLM stores states, and so hits, only at whole (inflated) attention blocks.
    plan = uniform_page_plan(spec.model, spec.kv_dtype) if name == "uniform_page" else None
    backend: HybridKv
    if spec.prefix_caching:
        pool = kvpool.Pool.for_spec(proxy, num_pages, device="host", enable_prefix_caching=True)
        multiple = plan.block_size if plan is not None else CHUNK
        backend = HybridPrefixCachedKv(pool, proxy, checkpoint_multiple=multiple)
    else:
        backend = HybridKv(page_pool(proxy, num_pages), proxy)
    backend.name = name
    page_bytes = real.page_bytes
    info: dict[str, Any] = {
        "page_bytes": page_bytes,
        "num_pages": num_pages,
        "groups": [
            {
                "kind": g.kind,
                "num_layers": len(g.layers),
                "block_size": real.block_size(i),
                "pages_per_slot": real.pages_per_slot(i),
            }
            for i, g in enumerate(real.groups)
        ],
        "pool_slab": f"proxy spec (allocator only): the real page bytes / {scale}",
    }
    if isinstance(backend, HybridPrefixCachedKv):
        info["prefix_caching"] = f"on: hits in {CHUNK}-token chunks" + (
            f", states checkpointed where prompts branch, at multiples of {backend.multiple} tokens"
            if backend.state_groups
            else ""
        )
    if plan is not None:
        info.update(
            group_size=plan.group_size,
            attention_block_size=plan.block_size,
            padding_layers=plan.num_padding_layers,
        )
    return SchemeRun(backend, lambda blocks, running: blocks * float(page_bytes), info)


def _all_full_scheme(spec: HybridSimulationSpec) -> SchemeRun:
    config = spec.config
    scheme = all_full_scheme(spec.model, spec.kv_dtype, config.max_running_seqs)
    num_blocks = scheme.num_blocks(spec.kv_memory_bytes)
    if num_blocks < 1:
        raise ValueError(
            f"all_full: a KV budget of {spec.kv_memory_bytes} bytes leaves no block of "
            f"{scheme.block_bytes} bytes beside {scheme.state_slots} state slots of "
            f"{scheme.state_bytes} bytes"
        )
    # A static reserve of live state slots has no checkpoint to resume a prefix from.
    caching = spec.prefix_caching and scheme.state_slots == 0
    pool = kvpool.Pool(
        proxy_layout(scheme.block_size), num_blocks, device="host", enable_prefix_caching=caching
    )
    kv_class = PrefixCachedKv if caching else PagedKv
    backend = kv_class(pool, config.max_running_seqs, config.max_model_len)
    backend.name = "all_full"
    info = {
        "block_bytes": scheme.block_bytes,
        "block_size": scheme.block_size,
        "num_blocks": num_blocks,
        "token_bytes": scheme.token_bytes,
        "state_slots": scheme.state_slots,
        "state_reserve_bytes": scheme.reserve_bytes,
        "pool_slab": "proxy layout (allocator only)",
    }
    if spec.prefix_caching:
        info["prefix_caching"] = (
            f"on: hits in whole {scheme.block_size}-token blocks"
            if caching
            else "off: the recurrent states sit in a static reserve of live slots, with no "
            "checkpoint to resume a prefix from"
        )

    def held(blocks: np.ndarray, running: np.ndarray) -> np.ndarray:
        return blocks * float(scheme.block_bytes) + running * float(scheme.state_bytes)

    return SchemeRun(backend, held, info)


def make_scheme(spec: HybridSimulationSpec, name: str) -> SchemeRun:
    if name == "all_full":
        return _all_full_scheme(spec)
    if name in ("hybrid", "uniform_page"):
        return _paged_scheme(spec, name)
    raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {name!r}")


def _series(
    metrics, held: np.ndarray, needed: np.ndarray, max_points: int = 1500
) -> dict[str, list]:
    a = metrics.arrays()
    n = len(metrics)
    idx = np.unique(np.linspace(0, n - 1, min(max_points, n)).astype(np.int64))
    util = np.divide(needed, held, out=np.full(n, np.nan), where=held > 0)
    return {
        "step": idx.tolist(),
        "time_s": a["time_s"][idx].round(6).tolist(),
        "running": a["running"][idx].tolist(),
        "waiting": a["waiting"][idx].tolist(),
        "kv_utilization": util[idx].round(5).tolist(),
        "blocks_used": a["blocks_used"][idx].tolist(),
    }


def run_scheme(
    spec: HybridSimulationSpec, name: str, progress: Progress | None = None
) -> dict[str, Any]:
    """Serve `spec`'s workload with scheme `name`; its figures (JSON-ready)."""
    scheme = make_scheme(spec, name)
    cost = HybridStepCost(spec.model, elem_bytes(spec.kv_dtype))
    sched = Scheduler(scheme.backend, spec.requests, spec.config, step_cost=cost)
    cost.bind(sched)
    cb = (lambda done, total: progress(name, done, total)) if progress else None
    t0 = time.perf_counter()
    sched.run(cb)
    elapsed = time.perf_counter() - t0
    _check_served(sched)
    a = sched.metrics.arrays()
    held = scheme.held_bytes(a["blocks_used"].astype(np.float64), a["running"].astype(np.float64))
    needed = np.asarray(cost.needed_bytes, dtype=np.float64)
    out = summarize(sched.metrics, 0)
    for key in ("mean_wasted_kv_bytes", "peak_wasted_kv_bytes"):
        del out[key]  # token slots x token bytes: not defined across groups (module docstring)
    out["kv_utilization"] = float(needed.sum() / held.sum()) if held.sum() else 0.0
    if spec.prefix_caching:
        # A shared page holds its tokens once for every request that reads them.
        out["kv_utilization_note"] = "bytes needed / held; above 1 when pages are shared"
        stats = getattr(scheme.backend, "stats_at_end", None)
        if stats:
            out["prefix_cache_stats"] = stats
        for key in ("checkpoints_stored", "checkpoints_lost"):
            if hasattr(scheme.backend, key):
                out[key] = getattr(scheme.backend, key)
    out["mean_held_kv_bytes"] = float(held.mean())
    out["peak_held_kv_bytes"] = float(held.max())
    out["mean_needed_kv_bytes"] = float(needed.mean())
    out["p50_running"] = float(np.median(a["running"]))
    out["completed"] = sched.num_finished
    out["run_wall_s"] = elapsed
    out.update(latency_summary(sched.seqs))
    out["recomputed_tokens"] = sched.recomputed_tokens
    out["scheme"] = scheme.info
    out["series"] = _series(sched.metrics, held, needed)
    return out


def _ratios(ours: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    def ratio(key: str) -> float | None:
        return ours[key] / other[key] if other[key] else None

    return {
        "mean_running_ratio": ratio("mean_running"),
        "peak_running_ratio": ratio("peak_running"),
        "p50_running_ratio": ratio("p50_running"),
        "modelled_throughput_ratio": ratio("modelled_output_tokens_per_s"),
        "latency_mean_ratio": ratio("latency_mean_s"),
        "prefix_hit_rate": {"hybrid": ours["prefix_hit_rate"], "other": other["prefix_hit_rate"]},
        "kv_utilization": {"hybrid": ours["kv_utilization"], "other": other["kv_utilization"]},
    }


def simulate_hybrid(spec: HybridSimulationSpec, progress: Progress | None = None) -> dict[str, Any]:
    """Every scheme of `spec` on its workload; the report (JSON-ready)."""
    results = {name: run_scheme(spec, name, progress) for name in spec.schemes}
    model = spec.model
    e = elem_bytes(spec.kv_dtype)
    report: dict[str, Any] = {
        "kvpool_version": _version(),
        "model": {
            "name": model.name,
            "num_layers": model.num_layers,
            "groups": [asdict(g) | {"layers": list(g.layers)} for g in model.groups],
            "describe": model.describe(),
            "num_q_heads": model.num_q_heads,
            "num_params": model.num_params,
            "active_params": model.active_params,
            "source": model.source,
            "page_bytes": model.page_bytes(e),
            "state_bytes_per_request": model.state_bytes(),
            "all_full_token_bytes": model.all_full_token_bytes(e),
            "dtype": spec.kv_dtype,
        },
        "kv_memory_bytes": spec.kv_memory_bytes,
        "prefix_caching": spec.prefix_caching,
        "device": "host",
        "scheduler": asdict(spec.config),
        "workload": {**spec.workload_info, **describe(spec.requests)},
        "timing": {
            "clock": "modelled",
            "model": HybridStepCost(model, e).describe(),
            "measured": ["wall_s", "alloc_s", "alloc_share", "run_wall_s"],
        },
        "results": results,
        "kv_utilization_label": "KV utilization\n(bytes needed / held)",
    }
    if "hybrid" in results:
        report["comparison"] = {
            f"hybrid_over_{name}": _ratios(results["hybrid"], r)
            for name, r in results.items()
            if name != "hybrid"
        }
    return report
