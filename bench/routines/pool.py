"""Python-level cost of kvpool's block pool against a pure-Python free list doing the same job.

The baseline is what a scheduler would write without kvpool: a free-list stack under a
`threading.Lock`, a per-block ref count so double frees, out-of-range and repeated ids are
rejected before anything changes, all-or-nothing batches, and a NumPy int32 array out.

Cases (each timed as a round trip, so the pool ends where it started):
  alloc_many16   alloc_many(16) + free_many(ids)          target: ours < 0.4 us per round trip, >= 10x the baseline
  single         alloc() + free(id)
  alloc_many256  alloc_many(256) + free_many(ids), per block  target: >= 10x the baseline

With `--device cuda` (GPU machine only) it also times our CUDA pool's per-block allocation
against what a user would pick instead for the same bytes: raw cudaMalloc+cudaFree, CuPy's
memory pool (`cupy.cuda.MemoryPool.malloc`, freed by dropping the pointer) and, when torch is
importable, PyTorch's caching allocator (`torch.cuda.caching_allocator_alloc` / `_delete`,
its raw interface without tensor construction): one block, and 16 blocks per round trip
(ours one alloc_many(16) + free_many, the caching allocators 16 calls each way).

Usage: python bench/kvbench.py --routine pool [--device cuda] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import kvpool
import numpy as np
from provenance import provenance, write_json
from timing import interleaved_timeit

# Llama-3-8B geometry: 2 MiB blocks. Host slabs are zeroed lazily, so 4096 blocks are cheap.
LAYOUT = kvpool.KvLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
NUM_BLOCKS = 4096
TARGET_ROUND_TRIP_16_US = 0.4
TARGET_RATIO_16 = 10.0
TARGET_PER_BLOCK_RATIO_256 = 10.0


class PyFreeListPool:
    """The baseline: a pure-Python pool with the same contract as `kvpool.Pool`."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop from the end, lowest first
        self._ref_cnt = [0] * num_blocks
        self._lock = threading.Lock()

    def alloc(self) -> int:
        with self._lock:
            if not self._free:
                raise kvpool.OutOfBlocksError(f"requested 1, free 0 of {self.num_blocks}")
            block_id = self._free.pop()
            self._ref_cnt[block_id] = 1
        return block_id

    def alloc_many(self, n: int) -> np.ndarray:
        if n < 0:
            raise kvpool.InvalidArgumentError(f"n must be >= 0, got {n}")
        with self._lock:
            free = self._free
            if n > len(free):
                raise kvpool.OutOfBlocksError(
                    f"requested {n}, free {len(free)} of {self.num_blocks}"
                )
            ids = free[len(free) - n :]
            del free[len(free) - n :]
            ref_cnt = self._ref_cnt
            for block_id in ids:
                ref_cnt[block_id] = 1
        return np.array(ids, dtype=np.int32)

    def free(self, block_id: object) -> None:
        if type(block_id) is not int or not 0 <= block_id < self.num_blocks:
            raise kvpool.InvalidBlockError(f"invalid block id {block_id!r}")
        with self._lock:
            refs = self._ref_cnt[block_id]
            if refs == 0:
                raise kvpool.DoubleFreeError(f"block {block_id} is not allocated")
            self._ref_cnt[block_id] = refs - 1
            if refs == 1:
                self._free.append(block_id)

    def free_many(self, block_ids: Iterable[object] | np.ndarray) -> None:
        given = block_ids.tolist() if isinstance(block_ids, np.ndarray) else list(block_ids)
        num_blocks = self.num_blocks
        for block_id in given:
            if type(block_id) is not int or not 0 <= block_id < num_blocks:
                raise kvpool.InvalidBlockError(f"invalid block id {block_id!r}")
        ids = cast("list[int]", given)  # every item was just checked to be an int
        if len(set(ids)) != len(ids):
            raise kvpool.InvalidBlockError("a block id is repeated in one call")
        with self._lock:
            ref_cnt = self._ref_cnt
            for block_id in ids:
                if ref_cnt[block_id] == 0:
                    raise kvpool.DoubleFreeError(f"block {block_id} is not allocated")
            free = self._free
            for block_id in ids:
                refs = ref_cnt[block_id] - 1
                ref_cnt[block_id] = refs
                if refs == 0:
                    free.append(block_id)


def round_trip_many(pool: Any, n: int) -> Callable[[], None]:
    alloc_many, free_many = pool.alloc_many, pool.free_many

    def run() -> None:
        free_many(alloc_many(n))

    return run


def round_trip_single(pool: Any) -> Callable[[], None]:
    alloc, free = pool.alloc, pool.free

    def run() -> None:
        free(alloc())

    return run


@dataclass(frozen=True)
class Timing:
    """Per-call time in microseconds: the median of the runs (reported) and the best run
    (less sensitive to other work on the machine)."""

    median_us: float
    best_us: float

    def per(self, n: int) -> Timing:
        return Timing(self.median_us / n, self.best_us / n)


def time_pair(
    ours: Callable[[], None], baseline: Callable[[], None], repeat: int, min_time_s: float
) -> tuple[Timing, Timing]:
    """Times both callables in alternating runs, so drifting load hits both alike."""
    runs = interleaved_timeit({"ours": ours, "baseline": baseline}, repeat, min_time_s)
    ours_t, base_t = (
        Timing(statistics.median(r) * 1e6, min(r) * 1e6) for r in (runs["ours"], runs["baseline"])
    )
    return ours_t, base_t


def check_same_contract(ours: Any, baseline: Any) -> None:
    """Both pools reject what they must, so the timings compare equal jobs."""
    for pool in (ours, baseline):
        ids = pool.alloc_many(4)
        assert ids.dtype == np.int32 and len(set(ids.tolist())) == 4
        for bad, error in (
            ([int(ids[0]), int(ids[0])], kvpool.InvalidBlockError),
            ([int(ids[0]), pool.num_blocks], kvpool.InvalidBlockError),
        ):
            try:
                pool.free_many(bad)
            except error:
                pass
            else:
                raise AssertionError(f"{type(pool).__name__} accepted {bad}")
        pool.free_many(ids)
        try:
            pool.free(int(ids[0]))
        except kvpool.DoubleFreeError:
            pass
        else:
            raise AssertionError(f"{type(pool).__name__} accepted a double free")
        try:
            pool.alloc_many(pool.num_blocks + 1)
        except kvpool.OutOfBlocksError:
            pass
        else:
            raise AssertionError(f"{type(pool).__name__} over-allocated")


def case(name: str, ours: Timing, baseline: Timing, per: str, baseline_name: str) -> dict[str, Any]:
    return {
        "name": name,
        "unit": per,
        "ours_us": round(ours.median_us, 4),
        "baseline": baseline_name,
        "baseline_us": round(baseline.median_us, 4),
        "ratio": round(baseline.median_us / ours.median_us, 2),  # > 1: ours is faster
        "ours_best_us": round(ours.best_us, 4),
        "baseline_best_us": round(baseline.best_us, 4),
    }


def bench_host(repeat: int, min_time_s: float) -> list[dict[str, Any]]:
    ours = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="host")
    baseline = PyFreeListPool(NUM_BLOCKS)
    check_same_contract(ours, baseline)
    cases = []
    for n in (16, 256):
        o, b = time_pair(round_trip_many(ours, n), round_trip_many(baseline, n), repeat, min_time_s)
        cases.append(case(f"alloc_many{n}_free_many", o, b, "round trip", "python_free_list"))
        if n == 256:
            cases.append(
                case(
                    "alloc_many256_free_many_per_block",
                    o.per(n),
                    b.per(n),
                    "block",
                    "python_free_list",
                )
            )
    o, b = time_pair(round_trip_single(ours), round_trip_single(baseline), repeat, min_time_s)
    cases.append(case("alloc_free_single", o, b, "round trip", "python_free_list"))
    ours.check_invariants()
    assert ours.num_free == NUM_BLOCKS
    return cases


def bench_cuda(repeat: int, min_time_s: float) -> list[dict[str, Any]]:
    import cupy

    ours = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="cuda")
    block_bytes = LAYOUT.block_bytes
    runtime = cupy.cuda.runtime
    mempool = cupy.cuda.MemoryPool()

    def raw_malloc_free() -> None:
        runtime.free(runtime.malloc(block_bytes))

    def cupy_pool_malloc_free() -> None:
        mempool.malloc(block_bytes)  # returned to the pool when the pointer is dropped

    def cupy_pool_16() -> None:
        ptrs = [mempool.malloc(block_bytes) for _ in range(16)]
        del ptrs

    baselines: list[tuple[str, str, Callable[[], None], int]] = [
        ("cuda_alloc_free_single", "cudaMalloc+cudaFree", raw_malloc_free, 1),
        ("cuda_alloc_free_single_vs_cupy_pool", "cupy.cuda.MemoryPool", cupy_pool_malloc_free, 1),
        ("cuda_alloc_many16_vs_cupy_pool", "cupy.cuda.MemoryPool x16", cupy_pool_16, 16),
    ]
    try:
        import torch

        torch_ok = torch.cuda.is_available()
    except ImportError:
        torch_ok = False
    if torch_ok:
        alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete

        def torch_single() -> None:
            delete(alloc(block_bytes))

        def torch_16() -> None:
            ptrs = [alloc(block_bytes) for _ in range(16)]
            for p in ptrs:
                delete(p)

        baselines += [
            ("cuda_alloc_free_single_vs_torch_caching", "torch caching allocator", torch_single, 1),
            ("cuda_alloc_many16_vs_torch_caching", "torch caching allocator x16", torch_16, 16),
        ]
    cases = []
    for name, baseline_name, baseline, n in baselines:
        mine = round_trip_single(ours) if n == 1 else round_trip_many(ours, n)
        o, b = time_pair(mine, baseline, repeat, min_time_s)
        cases.append(case(name, o, b, "round trip", baseline_name))
        if n > 1:
            cases.append(case(f"{name}_per_block", o.per(n), b.per(n), "block", baseline_name))
    ours.check_invariants()
    assert ours.num_free == NUM_BLOCKS
    return cases


def targets(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_name = {c["name"]: c for c in cases}
    rt16 = by_name["alloc_many16_free_many"]["ours_us"]
    ratio16 = by_name["alloc_many16_free_many"]["ratio"]
    per_block = by_name["alloc_many256_free_many_per_block"]["ratio"]
    return [
        {
            "target": f"alloc_many(16)+free_many round trip < {TARGET_ROUND_TRIP_16_US} us",
            "value_us": rt16,
            "limit_us": TARGET_ROUND_TRIP_16_US,
            "pass": rt16 < TARGET_ROUND_TRIP_16_US,
        },
        {
            "target": f">= {TARGET_RATIO_16:g}x the baseline for the 16-block round trip",
            "value_ratio": ratio16,
            "limit_ratio": TARGET_RATIO_16,
            "pass": ratio16 >= TARGET_RATIO_16,
        },
        {
            "target": ">= 10x the baseline per block at n=256",
            "value_ratio": per_block,
            "limit_ratio": TARGET_PER_BLOCK_RATIO_256,
            "pass": per_block >= TARGET_PER_BLOCK_RATIO_256,
        },
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    parser.add_argument(
        "--device", choices=("host", "cuda"), default="host", help="cuda: also time the CUDA pool"
    )
    parser.add_argument(
        "--repeat", type=int, default=7, help="runs per case; the median is reported"
    )
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per run")
    args = parser.parse_args(argv)

    # Before the run: the load average is then other work's.
    prov = provenance("bench/routines/pool.py")
    cases = bench_host(args.repeat, args.min_time)
    result: dict[str, Any] = {
        "provenance": prov,
        "method": (
            f"timeit, ours and baseline in alternating runs, median (and best) of {args.repeat} runs of "
            f">= {args.min_time} s each; ratio = baseline_us / ours_us on the medians"
        ),
        "layout": repr(LAYOUT),
        "num_blocks": NUM_BLOCKS,
        "cases": cases,
        "targets": targets(cases),
    }
    if args.device == "cuda":
        result["cases"] += bench_cuda(args.repeat, args.min_time)

    for c in result["cases"]:
        print(
            f"{c['name']:<40} ours {c['ours_us']:>9.4f} us   {c['baseline']:<22} {c['baseline_us']:>9.4f} us"
            f"   x{c['ratio']:.2f}"
        )
    for t in result["targets"]:
        print(f"{'PASS' if t['pass'] else 'FAIL'}  {t['target']}")
    out = args.out
    write_json(out, result, indent=2)
    print(f"wrote {out}")
    return 0
