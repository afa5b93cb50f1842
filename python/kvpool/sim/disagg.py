"""Disaggregated serving against colocated serving, on the same two GPUs (modelled time).

Disaggregated: one GPU prefills every prompt (FCFS batches of up to max_tokens_per_step
prompt tokens; the first output token comes from it), one link moves each request's prompt KV
to the decode GPU (FCFS, ``latency + bytes / bandwidth``, the bandwidth a measured transfer
figure), and the decode GPU serves the rest of the output through kvpool's paged scheduler
(real allocator and block tables; the arriving KV costs no compute there). Colocated: two
independent replicas of the paged scheduler, each serving every other request. Step times are
the roofline model of costmodel.py; the prefill GPU's KV memory is not a constraint (its KV
leaves as soon as it is sent).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from kvpool.scheduler.core import Scheduler
from kvpool.scheduler.paged import PagedKv
from kvpool.scheduler.request import Request
from kvpool.sim.costmodel import RooflineCost
from kvpool.sim.runner import SimulationSpec, make_pool
from kvpool.transfer.nixl_staging import StagingCost


def link_from_benchmark(result: Any, name: str) -> tuple[float, float, str]:
    """The link's (GB/s, latency us, source) measured in a benchmark result (``name`` says
    where it came from). Two kinds are read:

    - an NCCL ``transfer`` result (``bench/kvbench.py --routine transfer``: a ``summary`` of
      rows with ``num_blocks``, ``best_gb_per_s``, ``best_us``): the bandwidth at the most
      blocks, the latency the one-block (fewest blocks) time;
    - a ``transfer_nixl`` result (``bench/routines/transfer_nixl.py``: ``rows`` of ``case``,
      ``memory``, ``block``, ``blocks``, ``bytes``, ``median_us``, ``gbytes_per_s``): only its
      ``request_scattered`` rows (a request's blocks as a pool after churn holds them, about one
      descriptor per block), each replaced by the same size's ``request_staged`` row where the
      result has one and ``StagingCost`` says the transport stages it, of its ``cuda`` memory if
      it has any rows of it (the modelled link joins two GPUs), else ``host``; the bandwidth of
      the row of the most bytes, the latency the median time of the one-block row of the
      smallest block.

    ValueError (naming both kinds) for anything else."""
    try:
        if isinstance(result, dict) and result.get("routine") == "transfer_nixl":
            return _nixl_link(result, name)
        summary = result["summary"]
        largest = max(summary, key=lambda r: r["num_blocks"])
        one = min(summary, key=lambda r: r["num_blocks"])
        gbps, latency_us = float(largest["best_gb_per_s"]), float(one["best_us"])
        _check_link(gbps, latency_us)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{name}: neither an NCCL transfer result (bench/kvbench.py --routine transfer) "
            f"nor a transfer_nixl one (bench/routines/transfer_nixl.py) ({type(e).__name__}: {e})"
        ) from None
    return gbps, latency_us, name


def _nixl_link(result: dict, name: str) -> tuple[float, float, str]:
    cases = ("request_scattered", "request_staged")
    every = [dict(r) for r in result["rows"] if r["case"] in cases]
    if "memories" not in result:  # a result from before --memory: host to host, rows unnamed
        for r in every:
            r.setdefault("memory", "host")
    memories = {r["memory"] for r in every if r["case"] == "request_scattered"}
    if not memories:
        raise ValueError("no request_scattered rows")
    memory = "cuda" if "cuda" in memories else sorted(memories)[0]
    every = [r for r in every if r["memory"] == memory]
    staged = {(r["block"], r["blocks"]): r for r in every if r["case"] == "request_staged"}
    # How the transport moves each scattered request (one run per block): through its staging
    # buffers where its default costs say that pays and the result measured it, else run by run.
    rows = [
        staged.get((r["block"], r["blocks"]), r)
        if StagingCost().worth(int(r["blocks"]), int(r["bytes"]))
        else r
        for r in every
        if r["case"] == "request_scattered"
    ]
    largest = max(rows, key=lambda r: int(r["bytes"]))
    ones = [r for r in rows if int(r["blocks"]) == 1]
    if not ones:
        raise ValueError(f"no one-block request_scattered row of memory {memory!r}")
    one = min(ones, key=lambda r: int(r["bytes"]))
    gbps, latency_us = float(largest["gbytes_per_s"]), float(one["median_us"])
    _check_link(gbps, latency_us)
    source = (
        f"{name} (transfer_nixl, {memory}, {largest['case']}: {gbps:.4g} GB/s at "
        f"{largest['block']} x {largest['blocks']}, {latency_us:.4g} us for {one['block']} x 1)"
    )
    return gbps, latency_us, source


def _check_link(gbps: float, latency_us: float) -> None:
    if not (np.isfinite(gbps) and gbps > 0 and np.isfinite(latency_us) and latency_us >= 0):
        raise ValueError(f"a bandwidth of {gbps} GB/s and a latency of {latency_us} us")


def _prefill_times(spec: SimulationSpec, cost: RooflineCost) -> dict[int, float]:
    """When each request's prefill (and so its first token) ends on the prefill GPU."""
    reqs = sorted(spec.requests, key=lambda r: (r.arrival_s, r.request_id))
    cap = spec.config.max_tokens_per_step
    done: dict[int, float] = {}
    now, i = 0.0, 0
    while i < len(reqs):
        now = max(now, reqs[i].arrival_s)
        batch: list[Request] = []
        tokens = 0
        while (
            i < len(reqs)
            and reqs[i].arrival_s <= now
            and (not batch or tokens + reqs[i].prompt_tokens <= cap)
        ):
            batch.append(reqs[i])
            tokens += reqs[i].prompt_tokens
            i += 1
        now += cost(tokens, 0, 0)
        for r in batch:
            done[r.request_id] = now
    return done


def _transfer_times(
    spec: SimulationSpec,
    prefill_done: dict[int, float],
    token_bytes: int,
    gb_per_s: float,
    latency_s: float,
) -> dict[int, float]:
    """When each request's KV has arrived on the decode GPU (one link, FCFS)."""
    by_id = {r.request_id: r for r in spec.requests}
    link_free = 0.0
    ready: dict[int, float] = {}
    for rid, t in sorted(prefill_done.items(), key=lambda kv: (kv[1], kv[0])):
        start = max(t, link_free)
        link_free = start + latency_s + by_id[rid].prompt_tokens * token_bytes / (gb_per_s * 1e9)
        ready[rid] = link_free
    return ready


def _serve(spec: SimulationSpec, requests: list, cost: Any) -> Scheduler:
    pool, _, _ = make_pool(spec, "host")
    sched = Scheduler(
        PagedKv(pool, spec.config.max_running_seqs, spec.config.max_model_len),
        requests,
        spec.config,
        step_cost=cost,
    )
    sched.run()
    return sched


def _summary(ttft: np.ndarray, finish: np.ndarray, tpot: np.ndarray, output_tokens: int) -> dict:
    makespan = float(finish.max()) if len(finish) else 0.0
    return {
        "output_tokens_per_s": output_tokens / makespan if makespan else 0.0,
        "makespan_s": makespan,
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tpot_mean_s": float(tpot.mean()) if len(tpot) else 0.0,
        "tpot_p99_s": float(np.percentile(tpot, 99)) if len(tpot) else 0.0,
    }


def simulate_disaggregated(
    spec: SimulationSpec, transfer_gb_per_s: float, transfer_latency_s: float
) -> dict[str, Any]:
    preset = spec.preset
    layout = preset.layout(spec.block_size)
    token_bytes = preset.token_bytes(layout.elem_bytes)
    cost = RooflineCost(preset, dtype_bytes=layout.elem_bytes)
    total_output = sum(r.output_tokens for r in spec.requests)
    arrival = {r.request_id: r.arrival_s for r in spec.requests}

    prefill_done = _prefill_times(spec, cost)
    ready = _transfer_times(spec, prefill_done, token_bytes, transfer_gb_per_s, transfer_latency_s)
    # The decode GPU continues each request after its first token; the arriving prompt KV is
    # inserted by the scheduler's prefill path at no compute cost.
    rest = [
        dataclasses.replace(r, arrival_s=ready[r.request_id], output_tokens=r.output_tokens - 1)
        for r in spec.requests
        if r.output_tokens > 1
    ]
    decode = _serve(spec, rest, lambda prefill, seqs, kv: cost(0, seqs, kv))
    first = np.array([prefill_done[r.request_id] for r in spec.requests])
    ttft = first - np.array([r.arrival_s for r in spec.requests])
    finish = {s.request_id: s.finish_s for s in decode.seqs}
    finishes = np.array(
        [finish.get(r.request_id, prefill_done[r.request_id]) for r in spec.requests]
    )
    tpot = np.array(
        [
            (finish[r.request_id] - prefill_done[r.request_id]) / (r.output_tokens - 1)
            for r in spec.requests
            if r.output_tokens > 1
        ]
    )
    disagg = _summary(ttft, finishes, tpot, total_output)
    disagg["transfer_wait_mean_s"] = float(np.mean([ready[k] - prefill_done[k] for k in ready]))

    replicas = [_serve(spec, spec.requests[i::2], cost) for i in (0, 1)]
    seqs = [s for sched in replicas for s in sched.seqs]
    c_ttft = np.array([s.first_token_s - arrival[s.request_id] for s in seqs])
    c_finish = np.array([s.finish_s for s in seqs])
    c_tpot = np.array(
        [
            (s.finish_s - s.first_token_s) / (s.request.output_tokens - 1)
            for s in seqs
            if s.request.output_tokens > 1
        ]
    )
    colocated = _summary(c_ttft, c_finish, c_tpot, total_output)
    return {
        "clock": "modelled (roofline), two GPUs in both setups",
        "transfer": {
            "gb_per_s": transfer_gb_per_s,
            "latency_s": transfer_latency_s,
            "token_bytes": token_bytes,
        },
        "disaggregated": disagg,
        "colocated_two_replicas": colocated,
        "ratios_disaggregated_over_colocated": {
            k: (disagg[k] / colocated[k] if colocated[k] else float("inf"))
            for k in (
                "output_tokens_per_s",
                "ttft_mean_s",
                "ttft_p99_s",
                "tpot_mean_s",
                "tpot_p99_s",
            )
        },
    }
