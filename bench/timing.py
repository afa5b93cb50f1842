"""How every routine times its work, in one place.

GPU work is timed with CUDA events, after warm-up, as the median over repetitions: either as
CUDA-graph replays of a pass over several input sets (`graph_us`: no launch overhead between the
calls, which is what a serving loop's graph sees) or as eager calls between two events
(`eager_us`, `event_us`). Input sets rotate so that the bytes one pass touches exceed the L2
cache several times (`rotations`): a kernel timed on one set would read it from L2 after the
first call and report a bandwidth no request sees. Host (CPU) time per call is the median of
batches (`host_us`, `interleaved_timeit`), so that one pause of the Python process (a garbage
collection, a preemption on a busy machine) costs one batch, not the figure.

torch and CuPy are imported inside the functions that use them: the CPU-only routines import
this module on machines that have neither.
"""

from __future__ import annotations

import math
import statistics
import time
import timeit
from collections.abc import Callable, Sequence
from typing import Any

# Bytes touched per rotation cycle: at least 8x the L2 of current data-centre GPUs (60 MB on an
# H100/H200, 40 MB on an A100), so a rotated input set is never still cached.
ROTATE_BYTES = 512 << 20
MAX_ROTATIONS = 16
# Host time per call: the median of this many batches of this many eager calls.
HOST_BATCHES, HOST_BATCH_CALLS = 10, 20


def rotations(bytes_per_set: int) -> int:
    """How many input sets one timing pass cycles through: enough to touch ROTATE_BYTES."""
    return max(1, min(MAX_ROTATIONS, math.ceil(ROTATE_BYTES / bytes_per_set)))


def graph_us(calls: Sequence[Callable[[Any], None]], reps: int = 20, inner: int | None = None):
    """Capture `inner` passes over `calls` (each called with the capture stream) in one CUDA
    graph; the median per-call microseconds over `reps` replays. Every call runs once outside
    the graph first (compiles, plans, module loads)."""
    import torch

    inner = inner or max(1, math.ceil(8 / len(calls)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s, capture_error_mode="relaxed"):
        for _ in range(inner):
            for c in calls:
                c(s)
    g.replay()
    torch.cuda.synchronize()
    return _event_median(g.replay, reps, inner * len(calls))


def eager_us(calls: Sequence[Callable[[Any], None]], reps: int = 20, inner: int | None = None):
    """`graph_us` without the graph: `inner` eager passes over `calls` between two events."""
    import torch

    inner = inner or max(1, math.ceil(20 / len(calls)))
    s = torch.cuda.current_stream()
    for c in calls:
        c(s)
    torch.cuda.synchronize()

    def passes():
        for _ in range(inner):
            for c in calls:
                c(s)

    return _event_median(passes, reps, inner * len(calls))


def event_us(call: Callable[[], object], reps: int = 10, inner: int = 3, warm: int = 2) -> float:
    """Median microseconds per call: `inner` back-to-back calls between two events, after
    `warm` calls."""
    import torch

    for _ in range(warm):
        call()
    torch.cuda.synchronize()

    def calls():
        for _ in range(inner):
            call()

    return _event_median(calls, reps, inner)


def _event_median(work: Callable[[], object], reps: int, calls_per_rep: int) -> float:
    import torch

    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        work()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls_per_rep)
    return statistics.median(times)


def stream_event_s(stream: Any, fn: Callable[[], object]) -> tuple[float, float]:
    """(GPU seconds between CuPy events around `fn` on `stream`, wall seconds until the work
    it queued there completed): a copy's device time and the latency its caller sees."""
    import cupy as cp

    start, end = cp.cuda.Event(), cp.cuda.Event()
    t0 = time.perf_counter()
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    wall = time.perf_counter() - t0
    return cp.cuda.get_elapsed_time(start, end) / 1e3, wall


def stream_median_s(fn: Callable[[], object], stream: Any, reps: int) -> tuple[float, float]:
    """Medians of `stream_event_s` over `reps` calls after one warm-up call."""
    results = [stream_event_s(stream, fn) for _ in range(reps + 1)][1:]
    return statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)


def host_us(
    call: Callable[[Any], None], batches: int = HOST_BATCHES, n: int = HOST_BATCH_CALLS
) -> float:
    """Host (CPU) time per eager call of `call` (given the current stream): the median over
    `batches` batches of `n` calls, no synchronisation inside a batch, the device drained
    between batches."""
    import torch

    s = torch.cuda.current_stream()
    call(s)
    torch.cuda.synchronize()
    per_call = []
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(n):
            call(s)
        per_call.append((time.perf_counter() - t) / n)
        torch.cuda.synchronize()
    return statistics.median(per_call) * 1e6


def interleaved_timeit(
    fns: dict[str, Callable[[], object]], repeat: int, min_time_s: float
) -> dict[str, list[float]]:
    """Seconds per call of each function in `repeat` runs of at least `min_time_s` each, the
    functions' runs interleaved so that drifting load hits them alike."""
    timers = {name: timeit.Timer(fn) for name, fn in fns.items()}
    # autorange: calls per run so that one run takes >= 0.2 s; scaled to min_time_s.
    numbers = {name: max(1, int(t.autorange()[0] * min_time_s / 0.2)) for name, t in timers.items()}
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, t in timers.items():
            runs[name].append(t.timeit(numbers[name]) / numbers[name])
    return runs


def per_call_seconds(
    call: Callable[[], object],
    warmup: int,
    n: int,
    between: Callable[[], object] | None = None,
) -> list[float]:
    """Wall seconds of each of `n` calls of `call` (time.perf_counter around each), after
    `warmup` untimed calls; `between` runs after every call, untimed (a reset the next call
    needs)."""
    times = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        call()
        dt = time.perf_counter() - t0
        if between is not None:
            between()
        if i >= warmup:
            times.append(dt)
    return times


def distribution_us(times: list[float]) -> dict[str, float]:
    """Median, mean and percentiles of per-call seconds, in microseconds."""
    us = sorted(t * 1e6 for t in times)
    return {
        "median_us": statistics.median(us),
        "mean_us": statistics.fmean(us),
        "p10_us": us[len(us) // 10],
        "p90_us": us[len(us) * 9 // 10],
        "p99_us": us[len(us) * 99 // 100],
        "max_us": us[-1],
    }


def launches_wall_us(
    launch: Callable[[], object], synchronize: Callable[[], object], reps: int
) -> float:
    """Wall microseconds per call of `reps` back-to-back launches, after one warm-up launch,
    the devices drained (`synchronize`) before and after: throughput of queued work, launch
    overhead included."""
    synchronize()
    launch()
    synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        launch()
    synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def synced_wall(fn: Callable[[], Any], synchronize: Callable[[], object]) -> tuple[float, Any]:
    """(wall seconds, result) of `fn()` with the device drained before and after."""
    synchronize()
    t0 = time.perf_counter()
    result = fn()
    synchronize()
    return time.perf_counter() - t0, result


# ---------------------------------------------------------------- FlashInfer's JIT warm-up

FLASHINFER_HKV = 8


def warm_flashinfer(areas: Sequence[str]) -> None:
    """Trigger FlashInfer's JIT builds of every configuration the given routines time
    ("decode", "fp8", "prefill", "mla"), so that they compile on the CPU (in a background process)
    while the GPU tests run; the routines then find them cached. Prints one line per
    configuration: `warm ...` or `refused ...` (the routine records the same refusal)."""
    for area in areas:
        for label, build in _FLASHINFER_WARMERS[area]():
            try:
                build()
                print("warm", area, label, flush=True)
            except Exception as e:
                print("refused", area, label, f"{type(e).__name__}: {e}"[:300], flush=True)


def _tiny_paged_cache(torch: Any, dtype: Any, bs: int, d: int):
    """A 4-page cache of 2 sequences (2 pages each) and its decode plan arguments."""
    cache = torch.randn(4, 2, bs, FLASHINFER_HKV, d, device="cuda").to(dtype)
    indptr = torch.tensor([0, 2, 4], dtype=torch.int32, device="cuda")
    idx = torch.arange(4, dtype=torch.int32, device="cuda")
    last = torch.full((2,), bs, dtype=torch.int32, device="cuda")
    return cache, indptr, idx, last


def _decode_warmers(configs=None, kv_dtype_name=None):
    import flashinfer
    import torch

    if configs is None:
        from routines.decode import flashinfer_configs

        configs = flashinfer_configs()
    for dtype, d, hq, bs in configs:
        tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
        kv_dtype = getattr(torch, kv_dtype_name) if kv_dtype_name else tdt
        for tc in (False, True):

            def build(tdt=tdt, kv_dtype=kv_dtype, d=d, hq=hq, bs=bs, tc=tc):
                cache, indptr, idx, last = _tiny_paged_cache(torch, kv_dtype, bs, d)
                q = torch.randn(2, hq, d, device="cuda").to(tdt)
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    torch.empty(16 << 20, dtype=torch.uint8, device="cuda"),
                    "NHD",
                    use_tensor_cores=tc,
                )
                w.plan(
                    indptr,
                    idx,
                    last,
                    hq,
                    FLASHINFER_HKV,
                    d,
                    bs,
                    q_data_type=tdt,
                    kv_data_type=kv_dtype,
                )
                scales = {"k_scale": 0.5, "v_scale": 0.5} if kv_dtype_name else {}
                w.run(q, cache, **scales)
                torch.cuda.synchronize()

            yield f"{dtype} {kv_dtype_name or dtype} d={d} hq={hq} bs={bs} tc={tc}", build


def _fp8_warmers():
    from routines.fp8 import BS, HQ, D

    return _decode_warmers([("float16", D, HQ, BS)], kv_dtype_name="float8_e4m3fn")


def _prefill_warmers():
    import flashinfer
    import torch
    from routines.prefill import BS, HQ, D

    for tdt in (torch.float16, torch.bfloat16):
        for backend in ("fa2", "fa3"):

            def build(tdt=tdt, backend=backend):
                cache, kv_indptr, idx, last = _tiny_paged_cache(torch, tdt, BS, D)
                q = torch.randn(8, HQ, D, device="cuda").to(tdt)
                qo_indptr = torch.tensor([0, 4, 8], dtype=torch.int32, device="cuda")
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), "NHD", backend=backend
                )
                w.plan(
                    qo_indptr,
                    kv_indptr,
                    idx,
                    last,
                    HQ,
                    FLASHINFER_HKV,
                    D,
                    BS,
                    causal=True,
                    q_data_type=tdt,
                    kv_data_type=tdt,
                )
                w.run(q, cache)
                torch.cuda.synchronize()

            yield f"{tdt} {backend}", build


def _mla_warmers():
    """BatchMLAPagedAttentionWrapper, bfloat16, latent 512 + rope 64, 64-token pages, both
    backends, causal and not (routines mla and mla_extend), on 2 sequences of 2 pages; and
    decode over float8_e4m3fn caches (routine mla --fp8)."""
    import flashinfer.mla
    import torch

    for backend in ("fa2", "fa3"):
        for causal, qo_len, kv in (
            (False, 1, torch.bfloat16),
            (True, 4, torch.bfloat16),
            (False, 1, torch.float8_e4m3fn),
        ):

            def build(backend=backend, causal=causal, qo_len=qo_len, kv=kv):
                ckv = torch.randn(4, 64, 512, device="cuda").to(kv)
                kpe = torch.randn(4, 64, 64, device="cuda").to(kv)
                qn = torch.randn(2 * qo_len, 16, 512, device="cuda").to(torch.bfloat16)
                qp = torch.randn(2 * qo_len, 16, 64, device="cuda").to(torch.bfloat16)
                i32 = dict(dtype=torch.int32, device="cuda")
                w = flashinfer.mla.BatchMLAPagedAttentionWrapper(
                    torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), backend=backend
                )
                w.plan(
                    torch.arange(3, **i32) * qo_len,
                    torch.arange(3, **i32) * 2,
                    torch.arange(4, **i32),
                    torch.full((2,), 128, **i32),
                    16,
                    512,
                    64,
                    64,
                    causal,
                    0.07,
                    torch.bfloat16,
                    kv,
                )
                w.run(qn, qp, ckv, kpe)
                torch.cuda.synchronize()

            yield f"mla {backend} causal={causal} kv={kv}", build


_FLASHINFER_WARMERS = {
    "decode": _decode_warmers,
    "fp8": _fp8_warmers,
    "prefill": _prefill_warmers,
    "mla": _mla_warmers,
}
