"""Per-decode-step host cost of kvpool's block tables against rebuilding the table in NumPy.

The job, every step, for 256 running requests that each grow by one token (block_size 16,
so one request in 16 takes a new block each step; prompt lengths are random, so that is
~16 new blocks every step rather than 256 every 16th step):
  - grow each request by one token, taking a block from a free list when its last one fills;
  - produce the slot mapping of the new tokens (block_id * block_size + offset), int64;
  - produce block_table int32 [256, max_blocks_per_seq] (-1 padded) and seq_lens int32;
  - on a GPU, make both visible to kernels on the device.

Paths:
  ours      `BlockTables.append_tokens_many(ids, 1)` + `sync()`. On CUDA, sync stages the
            dirty rows in pinned memory and queues `cuMemcpyHtoDAsync` on the pool's stream.
            On the host, sync returns NumPy copies (there is nothing to upload).
  incremental  the fair baseline, what a careful scheduler writes without kvpool: one
            persistent NumPy table, written only where a request took a new block, seq_lens
            += 1, slots in NumPy, a Python free list. On CUDA the table and seq_lens are copied
            into one of two pinned staging buffers (after the upload that last read it has
            finished) and uploaded asynchronously on a CuPy stream (`ndarray.set`); on the host
            the arrays themselves are returned (ours returns copies).
  rebuild   per-request Python block lists and a Python free list; NumPy builds the slot
            mapping and rebuilds the whole table and seq_lens every step; on CUDA,
            `cupy.asarray` uploads both every step (synchronously, from pageable memory).

Host time per step is measured with time.perf_counter around each step (median over --steps
after --warmup). On CUDA the total wall time of all steps plus a final cudaDeviceSynchronize
is reported too. Targets: ours < 20 us per step, and >= 5x faster than the rebuild; the
ratio to the incremental baseline is reported beside it.

Usage: python bench/kvbench.py --routine tables [--device host|cuda] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvpool
import numpy as np
from provenance import provenance, write_json
from timing import distribution_us, per_call_seconds

NUM_REQUESTS = 256
BLOCK_SIZE = 16
# 512-byte blocks: the KV bytes play no part in this benchmark, only the block ids do.
LAYOUT = kvpool.KvLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=BLOCK_SIZE)
MAX_PROMPT = 512
TARGET_OURS_US = 20.0
TARGET_RATIO = 5.0


def capacity(steps: int) -> tuple[int, int]:
    """(max_blocks_per_seq, num_blocks) enough for every request to run all steps."""
    max_blocks = -(-(MAX_PROMPT + steps) // BLOCK_SIZE)
    return max_blocks, NUM_REQUESTS * max_blocks


def prompt_lengths(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, MAX_PROMPT + 1, NUM_REQUESTS).tolist()


# --- the two paths ------------------------------------------------------------------------------


class Ours:
    def __init__(self, device: str, steps: int, seed: int) -> None:
        max_blocks, num_blocks = capacity(steps)
        self.pool = kvpool.Pool(LAYOUT, num_blocks, device=device)
        self.tables = kvpool.BlockTables(self.pool, NUM_REQUESTS, max_blocks)
        for rid, n in enumerate(prompt_lengths(seed)):
            self.tables.add(rid, n)
        self.ids = np.arange(NUM_REQUESTS, dtype=np.int64)

    def step(self) -> tuple[Any, Any, Any]:
        slots, _copies = self.tables.append_tokens_many(self.ids, 1)
        table, seq_lens = self.tables.sync()
        return slots, table, seq_lens

    def append_only(self) -> None:
        self.tables.append_tokens_many(self.ids, 1)

    def sync_only(self) -> None:
        self.tables.sync()


class Rebuild:
    """What a scheduler writes without kvpool: Python lists per request, a Python free list,
    and a NumPy rebuild of the whole table every step."""

    def __init__(self, upload: Callable[[np.ndarray], Any] | None, steps: int, seed: int) -> None:
        self.max_blocks, num_blocks = capacity(steps)
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack, lowest id first
        self.blocks: list[list[int]] = []
        self.lens = np.array(prompt_lengths(seed), dtype=np.int64)
        for n in self.lens.tolist():
            self.blocks.append([self.free.pop() for _ in range(-(-n // BLOCK_SIZE))])
        self.last_block = np.array([b[-1] for b in self.blocks], dtype=np.int64)
        self.num_blocks = np.array([len(b) for b in self.blocks], dtype=np.int64)
        self.columns = np.arange(self.max_blocks)
        self.upload = upload

    def step(self) -> tuple[Any, Any, Any]:
        offsets = self.lens % BLOCK_SIZE
        for i in np.flatnonzero(offsets == 0).tolist():  # the last block is full: take one
            if not self.free:
                raise kvpool.OutOfBlocksError("the free list is empty")
            block = self.free.pop()
            self.blocks[i].append(block)
            self.last_block[i] = block
            self.num_blocks[i] += 1
        slots = self.last_block * BLOCK_SIZE + offsets
        self.lens += 1
        table = np.full((NUM_REQUESTS, self.max_blocks), -1, dtype=np.int32)
        table[self.columns < self.num_blocks[:, None]] = np.fromiter(
            (b for blocks in self.blocks for b in blocks),
            dtype=np.int32,
            count=int(self.num_blocks.sum()),
        )
        seq_lens = self.lens.astype(np.int32)
        if self.upload is not None:
            return slots, self.upload(table), self.upload(seq_lens)
        return slots, table, seq_lens


class Incremental:
    """A persistent table written only where it changed; pinned double-buffered async upload."""

    def __init__(self, cp: Any, steps: int, seed: int) -> None:
        max_blocks, num_blocks = capacity(steps)
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack, lowest id first
        self.table = np.full((NUM_REQUESTS, max_blocks), -1, dtype=np.int32)
        lens = prompt_lengths(seed)
        self.num_blocks = np.array([-(-n // BLOCK_SIZE) for n in lens], dtype=np.int64)
        for i, nb in enumerate(self.num_blocks.tolist()):
            self.table[i, :nb] = [self.free.pop() for _ in range(nb)]
        self.lens = np.array(lens, dtype=np.int64)
        self.seq_lens = self.lens.astype(np.int32)
        self.rows = np.arange(NUM_REQUESTS)
        self.cp = cp
        self.steps = 0
        if cp is not None:
            import cupyx

            self.stream = cp.cuda.Stream(non_blocking=True)
            self.staging = [
                (
                    cupyx.empty_pinned(self.table.shape, np.int32),
                    cupyx.empty_pinned(self.seq_lens.shape, np.int32),
                )
                for _ in range(2)
            ]
            self.uploaded: list[Any] = [
                None,
                None,
            ]  # the event of each staging buffer's last upload
            self.dev_table = cp.empty(self.table.shape, dtype=cp.int32)
            self.dev_seq_lens = cp.empty(self.seq_lens.shape, dtype=cp.int32)

    def step(self) -> tuple[Any, Any, Any]:
        offsets = self.lens % BLOCK_SIZE
        full = np.flatnonzero(offsets == 0)  # these requests' last block is full: take one
        if len(full):
            if len(self.free) < len(full):
                raise kvpool.OutOfBlocksError("the free list is empty")
            self.table[full, self.num_blocks[full]] = [self.free.pop() for _ in range(len(full))]
            self.num_blocks[full] += 1
        slots = self.table[self.rows, self.num_blocks - 1].astype(np.int64) * BLOCK_SIZE + offsets
        self.lens += 1
        self.seq_lens += 1
        if self.cp is None:
            return slots, self.table, self.seq_lens
        k = self.steps % 2
        self.steps += 1
        if self.uploaded[k] is not None:
            self.uploaded[k].synchronize()  # never rewrite a buffer whose copy is in flight
        table, seq_lens = self.staging[k]
        np.copyto(table, self.table)
        np.copyto(seq_lens, self.seq_lens)
        self.dev_table.set(table, stream=self.stream)
        self.dev_seq_lens.set(seq_lens, stream=self.stream)
        self.uploaded[k] = self.stream.record()
        return slots, self.dev_table, self.dev_seq_lens


def check_same_job(ours: Ours, rebuild: Rebuild | Incremental, steps: int = 40) -> None:
    """Both paths produce the same shapes, lengths and block counts (the block ids differ:
    two allocators), and every slot lies at its token's offset in that request's last block."""
    for _ in range(steps):
        slots_a, _, _ = ours.step()
        slots_b, _, _ = rebuild.step()
        assert np.array_equal(slots_a % BLOCK_SIZE, slots_b % BLOCK_SIZE)
        ids = ours.tables.request_ids()
        table = ours.tables.block_table(ids)
        last = table[np.arange(NUM_REQUESTS), rebuild.num_blocks - 1]
        assert np.array_equal(slots_a // BLOCK_SIZE, last)
    ids = ours.tables.request_ids()
    assert np.array_equal(ours.tables.seq_lens(ids), rebuild.lens.astype(np.int32))
    assert np.array_equal((ours.tables.block_table(ids) >= 0).sum(axis=1), rebuild.num_blocks)


# --- timing -------------------------------------------------------------------------------------


def summary(times: list[float], total_s: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": len(times), **distribution_us(times)}
    if total_s is not None:
        out["total_with_device_sync_us_per_step"] = total_s * 1e6 / len(times)
    return out


def run_path(
    make: Callable[[], Any], warmup: int, steps: int, device_sync: Callable[[], None] | None
) -> dict[str, Any]:
    path = make()
    if device_sync is not None:
        device_sync()
    t0 = time.perf_counter()
    times = per_call_seconds(path.step, warmup, steps)
    if device_sync is None:
        return summary(times)
    device_sync()
    total = time.perf_counter() - t0
    # the warm-up steps ran inside the total too: scale to the recorded steps' share
    return summary(times, total * steps / (warmup + steps))


def breakdown(device: str, warmup: int, steps: int, seed: int) -> dict[str, Any]:
    """Diagnostics, not targets: our step split into its two calls inside the real loop, and
    the cost of one `sync()` against how many rows changed since the last one and how they
    lie (contiguous rows share one copy; past 4 runs the uploader copies their bounding range)."""
    ours = Ours(device, warmup + steps, seed)
    clock = time.perf_counter
    append_us, sync_us = [], []
    for i in range(warmup + steps):
        t0 = clock()
        ours.append_only()
        t1 = clock()
        ours.sync_only()
        t2 = clock()
        if i >= warmup:
            append_us.append((t1 - t0) * 1e6)
            sync_us.append((t2 - t1) * 1e6)
    out: dict[str, Any] = {
        "in_loop_append_tokens_many_median_us": statistics.median(append_us),
        "in_loop_sync_median_us": statistics.median(sync_us),
    }
    rounds = 150
    sweep = {}
    for k in (0, 1, 4, 16, 64, 256):
        for layout in ("contiguous", "scattered"):
            if k in (0, NUM_REQUESTS) and layout == "scattered":
                continue
            pool = kvpool.Pool(LAYOUT, NUM_REQUESTS * (rounds + 2), device=device)
            tables = kvpool.BlockTables(pool, NUM_REQUESTS, rounds + 2)
            for rid in range(NUM_REQUESTS):
                tables.add(rid, BLOCK_SIZE)
            rows = (
                np.arange(k)
                if layout == "contiguous"
                else np.arange(k) * (NUM_REQUESTS // max(k, 1))
            )
            ids = np.array(tables.request_ids(), dtype=np.int64)[rows]
            tables.sync()
            times = []
            for _ in range(rounds):
                tables.append_tokens_many(ids, BLOCK_SIZE)  # exactly one new block per chosen row
                t0 = clock()
                tables.sync()
                times.append((clock() - t0) * 1e6)
            sweep[f"{k}_{layout}"] = statistics.median(times[rounds // 5 :])
    out["sync_median_us_by_changed_rows"] = sweep
    return out


# --- metadata ------------------------------------------------------------------------------------


def targets(ours_us: float, ratio: float, scope: str) -> list[dict[str, Any]]:
    return [
        {
            "target": f"ours < {TARGET_OURS_US:g} us per step ({scope})",
            "value_us": ours_us,
            "pass": ours_us < TARGET_OURS_US,
        },
        {
            "target": f"ours >= {TARGET_RATIO:g}x faster than the rebuild ({scope})",
            "value_ratio": ratio,
            "pass": ratio >= TARGET_RATIO,
        },
    ]


# --- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("host", "cuda"), default="host")
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    parser.add_argument(
        "--steps", type=int, default=2000, help="timed steps per path; the median is reported"
    )
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = args.out
    total_steps = args.warmup + args.steps

    check_same_job(Ours("host", 64, args.seed), Rebuild(None, 64, args.seed))
    check_same_job(Ours("host", 64, args.seed), Incremental(None, 64, args.seed))
    result: dict[str, Any] = {
        "provenance": provenance("bench/routines/tables.py"),
        "device": args.device,
        "config": {
            "num_requests": NUM_REQUESTS,
            "block_size": BLOCK_SIZE,
            "prompt_lengths": f"uniform 1..{MAX_PROMPT}, seed {args.seed}",
            "max_blocks_per_seq": capacity(total_steps)[0],
            "num_blocks": capacity(total_steps)[1],
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
        },
        "method": "time.perf_counter around each step; median over the timed steps after warm-up; "
        "ratio = rebuild median / ours median; ratio_vs_incremental = incremental median / ours median",
    }

    if args.device == "host":
        result["scope"] = (
            "host only, no upload: ours = append_tokens_many + sync() returning NumPy; rebuild = NumPy rebuild"
        )
        paths = {
            "ours_append_sync_numpy": run_path(
                lambda: Ours("host", total_steps, args.seed), args.warmup, args.steps, None
            ),
            "incremental_numpy": run_path(
                lambda: Incremental(None, total_steps, args.seed), args.warmup, args.steps, None
            ),
            "rebuild_numpy": run_path(
                lambda: Rebuild(None, total_steps, args.seed), args.warmup, args.steps, None
            ),
        }
        ours_key, incr_key, base_key = (
            "ours_append_sync_numpy",
            "incremental_numpy",
            "rebuild_numpy",
        )
        scope = "host, no upload"
    else:
        import cupy as cp

        result["scope"] = (
            "host time per step with uploads: ours = append_tokens_many + sync() (async upload on the pool's "
            "stream); incremental = persistent NumPy table + pinned double-buffered async upload; "
            "rebuild = NumPy rebuild + cupy.asarray(table) + cupy.asarray(seq_lens)"
        )
        sync = cp.cuda.runtime.deviceSynchronize
        paths = {
            "ours_append_sync_cuda": run_path(
                lambda: Ours("cuda", total_steps, args.seed), args.warmup, args.steps, sync
            ),
            "incremental_numpy_pinned_async": run_path(
                lambda: Incremental(cp, total_steps, args.seed), args.warmup, args.steps, sync
            ),
            "rebuild_numpy_cupy_asarray": run_path(
                lambda: Rebuild(cp.asarray, total_steps, args.seed), args.warmup, args.steps, sync
            ),
        }
        ours_key, incr_key, base_key = (
            "ours_append_sync_cuda",
            "incremental_numpy_pinned_async",
            "rebuild_numpy_cupy_asarray",
        )
        scope = "CUDA, with upload"

    result["paths"] = paths
    ratio = paths[base_key]["median_us"] / paths[ours_key]["median_us"]
    result["ratio"] = ratio
    result["ratio_vs_incremental"] = paths[incr_key]["median_us"] / paths[ours_key]["median_us"]
    result["breakdown"] = breakdown(args.device, args.warmup, args.steps, args.seed)
    result["targets"] = targets(paths[ours_key]["median_us"], ratio, scope)

    for name, p in paths.items():
        extra = ""
        if "total_with_device_sync_us_per_step" in p:
            extra = (
                f"   total incl. device sync {p['total_with_device_sync_us_per_step']:.2f} us/step"
            )
        print(f"{name:<30} median {p['median_us']:9.2f} us   p90 {p['p90_us']:9.2f} us{extra}")
    print(
        f"ratio (rebuild / ours): x{ratio:.1f}; (incremental / ours): x{result['ratio_vs_incremental']:.2f}"
    )
    print(f"breakdown: {json.dumps(result['breakdown'])}")
    for t in result["targets"]:
        print(f"{'PASS' if t['pass'] else 'FAIL'}  {t['target']}")
    write_json(out, result, indent=2)
    print(f"wrote {out}")
    return 0
