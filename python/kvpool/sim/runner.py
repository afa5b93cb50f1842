"""One simulation: the same workload through the paged and the contiguous scheduler, and, with
a host tier (SimulationSpec.host_tier), through the paged scheduler preempting into it, or, with
SimulationSpec.prefix_caching, through the paged scheduler with prefix caching (its figures: prefix_sim.py).
The two extra runs are not combined: swapping does not model blocks shared by a prefix cache."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import kvpool
from kvpool.scheduler.contiguous import ContiguousKv
from kvpool.scheduler.core import Scheduler, SchedulerConfig
from kvpool.scheduler.metrics import latency_summary, summarize
from kvpool.scheduler.paged import PagedKv
from kvpool.scheduler.prefix import PrefixCachedKv
from kvpool.scheduler.request import Request
from kvpool.scheduler.swap import HostTierSpec, HostTierSwapper
from kvpool.sim.costmodel import RooflineCost
from kvpool.sim.measured import make_probe
from kvpool.sim.prefix_sim import compare_caching, hit_rate_series
from kvpool.sim.presets import ModelPreset, num_blocks_for
from kvpool.sim.workload import describe

# On the host the simulation needs the allocator, not the bytes: the pool is built over a
# "proxy" layout (1 layer, 1 KV head, float16) with the model's block_size, so 16 GiB of
# modelled KV does not cost 16 GiB of RAM (and minutes of zeroing). Bytes are accounted with
# the model's layout.


def proxy_layout(block_size: int) -> kvpool.KvLayout:
    """The smallest 1-layer, 1-head layout with `block_size` tokens per block. A block is
    4 * block_size * head_dim bytes and must be a multiple of 256, so head_dim is
    64 / gcd(block_size, 64): every block size the model's layout accepts works here too
    (256 bytes per block at block_size 16, 768 at block_size 3)."""
    return kvpool.KvLayout(1, 1, 64 // math.gcd(block_size, 64), block_size)


Progress = Callable[[str, int, int], None]


@dataclass
class SimulationSpec:
    preset: ModelPreset
    kv_memory_bytes: int
    requests: list[Request]
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    block_size: int = 16
    device: str = "auto"  # auto | host | cuda
    reserve: str = "max_model_len"
    measure_every: int = 10
    kv_dtype: str = "float16"  # the cache's element type (fp8 halves the bytes per token)
    workload_info: dict[str, Any] = field(default_factory=dict)
    host_tier: HostTierSpec | None = None  # also run paged with preemption into a host tier
    prefix_caching: bool = False  # also run paged with prefix caching (prefix_sim.py)


def resolve_device(device: str) -> str:
    if device not in ("auto", "host", "cuda"):
        raise ValueError(f"device must be auto, host or cuda, got {device!r}")
    if device == "auto":
        return "cuda" if kvpool.cuda_available() else "host"
    return device


def make_pool(
    spec: SimulationSpec, device: str, prefix_caching: bool = False
) -> tuple[kvpool.Pool, int, str]:
    layout = spec.preset.layout(spec.block_size, spec.kv_dtype)
    num_blocks = num_blocks_for(spec.kv_memory_bytes, layout)
    if num_blocks < 1:
        raise ValueError(
            f"a KV budget of {spec.kv_memory_bytes} bytes holds no block of {layout.block_bytes} bytes"
        )
    if device == "cuda":
        return (
            kvpool.Pool(layout, num_blocks, device="cuda", enable_prefix_caching=prefix_caching),
            num_blocks,
            "model layout on the GPU",
        )
    return (
        kvpool.Pool(
            proxy_layout(spec.block_size),
            num_blocks,
            device="host",
            enable_prefix_caching=prefix_caching,
        ),
        num_blocks,
        "proxy layout (allocator only)",
    )


def _series(metrics, max_points: int = 1500) -> dict[str, list]:
    a = metrics.arrays()
    idx = np.unique(
        np.linspace(0, len(metrics) - 1, min(max_points, len(metrics))).astype(np.int64)
    )
    util = np.divide(
        a["tokens_stored"],
        a["slots_allocated"],
        out=np.full(len(metrics), np.nan),
        where=a["slots_allocated"] > 0,
    )  # nothing allocated: undefined (null in JSON)
    return {
        "step": idx.tolist(),
        "time_s": a["time_s"][idx].round(6).tolist(),
        "running": a["running"][idx].tolist(),
        "waiting": a["waiting"][idx].tolist(),
        "kv_utilization": util[idx].round(5).tolist(),
        "blocks_used": a["blocks_used"][idx].tolist(),
    }


def _check_served(sched: Scheduler) -> None:
    for seq in sched.seqs:
        if seq.num_finishes != 1 or seq.generated != seq.request.output_tokens:
            raise AssertionError(f"request {seq.request_id} was not served exactly once")
    sched.backend.check_drained()
    if sched.swapper is not None:
        sched.swapper.check_drained()


def _version() -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        return version("kvpool")
    except PackageNotFoundError:
        return None


def run_one(sched: Scheduler, token_bytes: int, progress: Progress | None) -> dict[str, Any]:
    name = sched.backend.name
    cb = (lambda done, total: progress(name, done, total)) if progress else None
    t0 = time.perf_counter()
    sched.run(cb)
    elapsed = time.perf_counter() - t0
    _check_served(sched)
    out = summarize(sched.metrics, token_bytes)
    out["completed"] = sched.num_finished
    out["run_wall_s"] = elapsed
    out.update(latency_summary(sched.seqs))
    out["series"] = _series(sched.metrics)
    probe = getattr(sched.backend, "probe", None)
    if probe is not None:
        out["measured_decode"] = probe.summary()
    out["recomputed_tokens"] = sched.recomputed_tokens
    if sched.swapper is not None:
        out["host_tier"] = sched.swapper.summary()
    if isinstance(sched.backend, ContiguousKv):
        out["blocked_by_fragmentation"] = sched.backend.blocked_by_fragmentation
    return out


def simulate(spec: SimulationSpec, progress: Progress | None = None) -> dict[str, Any]:
    """Run both schedulers (and the extra run the spec asks for); the report's figures as a
    dict (JSON-ready)."""
    if spec.host_tier is not None and spec.prefix_caching:
        raise ValueError(
            "a host tier and prefix caching are not modelled together: the host tier "
            "swaps a sequence's own blocks, a prefix cache shares them between sequences"
        )
    device = resolve_device(spec.device)
    preset = spec.preset
    layout = preset.layout(spec.block_size, spec.kv_dtype)
    token_bytes = preset.token_bytes(layout.elem_bytes)
    pool, num_blocks, slab = make_pool(spec, device)
    cost = RooflineCost(preset, kv_dtype_bytes=layout.elem_bytes)
    probe, timing = make_probe(pool, preset.num_q_heads, spec.measure_every)

    paged = PagedKv(pool, spec.config.max_running_seqs, spec.config.max_model_len)
    paged.probe = probe
    paged_sched = Scheduler(paged, spec.requests, spec.config, step_cost=cost)
    paged_result = run_one(paged_sched, token_bytes, progress)
    tier_result = None
    if spec.host_tier is not None:
        tier_result = run_host_tier(spec, pool, cost, layout.block_bytes, token_bytes, progress)

    capacity = num_blocks * layout.block_bytes  # the same bytes as the paged pool
    contiguous = ContiguousKv(capacity, token_bytes, spec.config.max_model_len, spec.reserve)
    contiguous_probe = None
    if probe is not None and spec.reserve == "max_model_len":
        contiguous_probe = make_probe(pool, preset.num_q_heads, spec.measure_every)[0]
        contiguous.probe = contiguous_probe
        contiguous.block_bytes, contiguous.block_size = layout.block_bytes, layout.block_size
    contiguous_sched = Scheduler(contiguous, spec.requests, spec.config, step_cost=cost)
    contiguous_result = run_one(contiguous_sched, token_bytes, progress)

    errors = [
        f"{name}: {p.error}"
        for name, p in (("paged", probe), ("contiguous", contiguous_probe))
        if p is not None and p.error is not None
    ]
    if errors:  # the kernel failed mid-run: the measured figures are partial, not comparable
        timing = (
            f"measuring stopped after a kernel failure ({'; '.join(errors)}); "
            "step time is modelled, measured_decode covers the steps before the failure"
        )

    report = {
        "kvpool_version": _version(),
        "model": {
            **asdict(preset),
            "token_bytes": token_bytes,
            "block_size": layout.block_size,
            "block_bytes": layout.block_bytes,
            "dtype": layout.dtype,
        },
        "kv_memory_bytes": capacity,
        "num_blocks": num_blocks,
        "device": device,
        "pool_slab": slab,
        "scheduler": asdict(spec.config),
        "contiguous_reserve": spec.reserve,
        "workload": {**spec.workload_info, **describe(spec.requests)},
        "timing": {
            "clock": "modelled",
            "model": cost.describe(),
            "decode_attention": timing,
            "measured": ["wall_s", "alloc_s", "alloc_share", "run_wall_s"]
            + (["measured_decode"] if probe is not None else []),
        },
        "results": {"paged": paged_result, "contiguous": contiguous_result},
        "comparison": compare(paged_result, contiguous_result, measured_ok=not errors),
    }
    if tier_result is not None:
        report["results"] = {
            "paged": paged_result,
            "paged_host_tier": tier_result,
            "contiguous": contiguous_result,
        }
        report["host_tier_comparison"] = compare_host_tier(tier_result, paged_result)
    if spec.prefix_caching:
        run_prefix_caching(spec, device, report, token_bytes, cost, progress)
    return report


def run_host_tier(
    spec: SimulationSpec,
    pool: kvpool.Pool,
    cost: RooflineCost,
    block_bytes: int,
    token_bytes: int,
    progress: Progress | None,
) -> dict[str, Any]:
    """The paged scheduler again on the same (drained) pool, preempting into a host tier of
    `spec.host_tier.memory_bytes` (in the model's blocks)."""
    tier = spec.host_tier
    assert tier is not None
    backend = PagedKv(pool, spec.config.max_running_seqs, spec.config.max_model_len)
    backend.name = "paged_host_tier"
    swapper = HostTierSwapper(
        backend,
        tier.memory_bytes // block_bytes,
        mode=tier.mode,
        link=tier.link,
        prefill_s_per_token=cost.prefill_seconds(1),
        block_bytes=block_bytes,
    )
    sched = Scheduler(backend, spec.requests, spec.config, step_cost=cost, swapper=swapper)
    return run_one(sched, token_bytes, progress)


def run_prefix_caching(
    spec: SimulationSpec,
    device: str,
    report: dict[str, Any],
    token_bytes: int,
    cost: RooflineCost,
    progress: Progress | None,
) -> None:
    """Serve spec's workload with prefix caching; add its result and the comparison to `report`."""
    pool, num_blocks, _ = make_pool(spec, device, prefix_caching=True)
    if num_blocks != report["num_blocks"]:
        raise AssertionError(
            f"the prefix-caching pool has {num_blocks} blocks, the others {report['num_blocks']}"
        )
    backend = PrefixCachedKv(pool, spec.config.max_running_seqs, spec.config.max_model_len)
    if device == "cuda":
        backend.probe = make_probe(pool, spec.preset.num_q_heads, spec.measure_every)[0]
    sched = Scheduler(backend, spec.requests, spec.config, step_cost=cost)
    result = run_one(sched, token_bytes, progress)
    steps = result["series"]["step"]
    result["series"]["prefix_hit_rate"] = hit_rate_series(sched.metrics, steps)
    result["series"]["prefix_hit_rate_cumulative"] = hit_rate_series(
        sched.metrics, steps, window_steps=-1
    )
    result["prefix_cache_stats"] = backend.stats_at_end
    # A shared block holds its tokens once for several requests: utilization (tokens the
    # requests hold / slots allocated) can pass 1, and "wasted" slots are not defined.
    result["mean_wasted_kv_bytes"] = result["peak_wasted_kv_bytes"] = None
    result["kv_utilization_note"] = (
        "tokens held by the requests / slots allocated; above 1 when blocks are shared"
    )
    report["results"]["paged_prefix_caching"] = result
    report["prefix_caching"] = compare_caching(result, report["results"]["paged"])


def compare_host_tier(tier: dict[str, Any], no_tier: dict[str, Any]) -> dict[str, Any]:
    """Paged with a host tier against paged without one (every preemption recomputed)."""

    def ratio(key: str) -> float | None:
        return tier[key] / no_tier[key] if no_tier[key] else None

    counts = tier["host_tier"]
    return {
        "preemptions": {"host_tier": tier["preemptions"], "no_tier": no_tier["preemptions"]},
        "preemptions_by_swap": counts["swapped_out"],
        "preemptions_by_recompute": counts["recomputed"],
        "recomputed_because_tier_full": counts["recomputed_tier_full"],
        "recomputed_tokens": {
            "host_tier": tier["recomputed_tokens"],
            "no_tier": no_tier["recomputed_tokens"],
        },
        "recomputed_tokens_saved": no_tier["recomputed_tokens"] - tier["recomputed_tokens"],
        "swapped_bytes": counts["swapped_out_bytes"] + counts["swapped_in_bytes"],
        "modelled_copy_s": counts["copy_s"],
        "modelled_throughput_ratio": ratio("modelled_output_tokens_per_s"),
        "ttft_mean_ratio": ratio("ttft_mean_s"),
        "ttft_p99_ratio": ratio("ttft_p99_s"),
        "latency_mean_ratio": ratio("latency_mean_s"),
        "latency_p99_ratio": ratio("latency_p99_s"),
    }


def compare(
    paged: dict[str, Any], contiguous: dict[str, Any], measured_ok: bool = True
) -> dict[str, Any]:
    def ratio(key: str) -> float:
        return paged[key] / contiguous[key] if contiguous[key] else float("inf")

    out = {
        "mean_concurrency_ratio": ratio("mean_running"),
        "peak_concurrency_ratio": ratio("peak_running"),
        "modelled_throughput_ratio": ratio("modelled_output_tokens_per_s"),
        "paged_kv_utilization": paged["kv_utilization"],
        "contiguous_kv_utilization": contiguous["kv_utilization"],
    }
    if measured_ok and "measured_decode" in paged and "measured_decode" in contiguous:
        out["measured_decode_tokens_per_s"] = {
            "paged": paged["measured_decode"]["decode_tokens_per_s"],
            "contiguous": contiguous["measured_decode"]["decode_tokens_per_s"],
        }
    return out
