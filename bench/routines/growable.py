"""Growing a KV pool in place (CUDA virtual memory) against the copy path, on one GPU.

Scenario: a pool holds `--live-gib` (8) GiB of live KV and must grow by
`--grow-gib` (1) GiB.

- vmm: a growable kvpool pool (`growable=True`) whose live blocks are allocated and written;
  `pool.grow()` maps the new chunks (cuMemCreate + cuMemMap per chunk, one cuMemSetAccess).
  No byte moves: the base pointer and the live data are checked unchanged afterwards. Also
  timed: the same growth reached on demand by `alloc_many`, and `shrink()` giving the grown
  chunks back (it synchronises the context before unmapping).
- copy: what a fixed slab must do: `cudaMalloc` a larger buffer, device-to-device copy the
  live bytes, `cudaFree` the old one (CuPy with its memory pool disabled, so both calls reach
  the driver, as a real resize would).

Times are host wall clock around the call with the device synchronised before and after,
medians over `--reps`. The VMM rows are repeated per chunk size (`--chunk-mib`; 0 = the
driver's minimum granularity, 2 MiB on H200): the driver cost is per physical allocation, so
larger chunks grow faster and shrink coarser. Target: growth >= 20x faster than the copy.

    python bench/kvbench.py --routine growable [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import kvpool
from provenance import provenance, write_json
from timing import synced_wall

GiB = 1 << 30
MiB = 1 << 20
# Llama-3-8B's KV: 32 layers x 8 KV heads x 128 dims, 16-token blocks, fp16: 2 MiB blocks.
LAYOUT_ARGS = {
    "num_layers": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "block_size": 16,
    "dtype": "float16",
}
TARGET_SPEEDUP = 20.0


def load_cupy() -> Any:
    """CuPy with a usable device, or exit with a message saying what is missing."""
    try:
        import cupy
    except Exception as e:
        sys.exit(
            f"growable_bench: needs CuPy and a CUDA GPU (pip install 'kvpool[cuda13]'): {type(e).__name__}: {e}"
        )
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        sys.exit(f"growable_bench: no CUDA driver: {type(e).__name__}: {e}")
    if count == 0 or not kvpool.cuda_available():
        sys.exit("growable_bench: no CUDA device visible (kvpool.cuda_available() is False)")
    return cupy


def wall(cp: Any, fn: Any) -> tuple[float, Any]:
    """Seconds `fn()` takes with the device idle before and synchronised after."""
    return synced_wall(fn, cp.cuda.runtime.deviceSynchronize)


def free_bytes(cp: Any) -> int:
    cp.cuda.runtime.deviceSynchronize()
    return int(cp.cuda.runtime.memGetInfo()[0])


def raw(cp: Any, ptr: int, nbytes: int, owner: Any) -> Any:
    memory = cp.cuda.UnownedMemory(ptr, nbytes, owner)
    return cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(memory, 0))


def fingerprint(cp: Any, arr: Any) -> list[int]:
    """Cheap content check of a large byte array: sums of a few 1 MiB windows."""
    n = arr.size
    starts = [0, n // 3, n // 2, n - MiB]
    return [int(arr[s : s + MiB].sum(dtype=cp.uint64)) for s in starts]


def fill_pattern(cp: Any, arr: Any, seed: int) -> None:
    """A position-dependent pattern, written in place (no 8 GiB temporaries)."""
    kernel = cp.ElementwiseKernel(
        "uint32 seed", "uint32 w", "w = (unsigned int)i * 2654435761u + seed", "fill_pattern"
    )
    kernel(seed, arr.view(cp.uint32))


def vmm_rep(
    cp: Any,
    layout: kvpool.KvLayout,
    live_blocks: int,
    grow_blocks: int,
    chunk_bytes: int | None,
    on_demand: bool,
) -> dict[str, Any]:
    bb = layout.block_bytes
    pool = kvpool.Pool(
        layout,
        growable=True,
        max_num_blocks=live_blocks + grow_blocks,
        initial_num_blocks=live_blocks,
        chunk_bytes=chunk_bytes,
        device="cuda",
    )
    live = pool.alloc_many(live_blocks)
    assert live.tolist() == list(range(live_blocks))
    live_bytes = live_blocks * bb
    fill_pattern(cp, raw(cp, pool.base_ptr, live_bytes, pool), seed=7)
    before_print = fingerprint(cp, raw(cp, pool.base_ptr, live_bytes, pool))
    base, free_before = pool.base_ptr, free_bytes(cp)
    if on_demand:
        seconds, grown_ids = wall(cp, lambda: pool.alloc_many(grow_blocks))
        mapped = pool.stats()["mapped_bytes"] - live_bytes
    else:
        seconds, mapped = wall(cp, lambda: pool.grow(live_blocks + grow_blocks))
        grown_ids = pool.alloc_many(grow_blocks)
    free_after = free_bytes(cp)
    assert pool.base_ptr == base, "the base pointer moved"
    assert fingerprint(cp, raw(cp, pool.base_ptr, live_bytes, pool)) == before_print, (
        "live KV changed"
    )
    new = raw(cp, pool.base_ptr + live_bytes, grow_blocks * bb, pool)
    new.fill(3)  # the new memory is mapped and writable
    pool.free_many(grown_ids)
    shrink_seconds, released = wall(cp, pool.shrink)
    free_shrunk = free_bytes(cp)
    pool.check_invariants()
    stats = pool.stats()
    return {
        "grow_s": seconds,
        "shrink_s": shrink_seconds,
        "mapped_bytes": int(mapped),
        "released_bytes": int(released),
        "device_free_drop_bytes": free_before - free_after,
        "device_free_rise_bytes": free_shrunk - free_after,
        "chunk_bytes": stats["chunk_bytes"],
        "chunks_mapped": int(mapped) // int(stats["chunk_bytes"]),
    }


def copy_rep(cp: Any, live_bytes: int, grow_bytes: int) -> dict[str, Any]:
    old = cp.empty(live_bytes, dtype=cp.uint8)
    fill_pattern(cp, old, seed=7)
    before_print = fingerprint(cp, old)

    def resize() -> Any:
        nonlocal old
        new = cp.empty(live_bytes + grow_bytes, dtype=cp.uint8)
        cp.cuda.runtime.memcpy(
            new.data.ptr, old.data.ptr, live_bytes, cp.cuda.runtime.memcpyDeviceToDevice
        )
        old = None  # cudaFree (no memory pool)
        return new

    seconds, new = wall(cp, resize)
    assert fingerprint(cp, new[:live_bytes]) == before_print
    del new
    return {"grow_s": seconds}


def median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--live-gib", type=float, default=8.0)
    ap.add_argument("--grow-gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--chunk-mib",
        type=str,
        default="0,32,128",
        help="comma-separated chunk sizes to try; 0 = the driver's minimum granularity",
    )
    args = ap.parse_args(argv)
    cp = load_cupy()
    cp.cuda.set_allocator(None)  # every cp.empty/free reaches cudaMalloc/cudaFree
    layout = kvpool.KvLayout(**LAYOUT_ARGS)
    bb = layout.block_bytes
    live_blocks = int(args.live_gib * GiB) // bb
    grow_blocks = int(args.grow_gib * GiB) // bb
    live_bytes, grow_bytes = live_blocks * bb, grow_blocks * bb

    # Warm-up: context, kernels, driver paths.
    vmm_rep(cp, layout, 64, 64, None, on_demand=False)
    copy_rep(cp, 256 * MiB, 64 * MiB)

    copy_rows = [copy_rep(cp, live_bytes, grow_bytes) for _ in range(args.reps)]
    copy_s = median(copy_rows, "grow_s")
    variants = []
    for chunk_mib in [int(c) for c in args.chunk_mib.split(",") if c.strip()]:
        chunk = chunk_mib * MiB if chunk_mib else None
        for on_demand in (False, True):
            rows = [
                vmm_rep(cp, layout, live_blocks, grow_blocks, chunk, on_demand)
                for _ in range(args.reps)
            ]
            grow_s = median(rows, "grow_s")
            variants.append(
                {
                    "chunk_bytes": rows[0]["chunk_bytes"],
                    "how": "alloc_many on demand" if on_demand else "pool.grow",
                    "grow_ms": grow_s * 1e3,
                    "grow_ms_all": [r["grow_s"] * 1e3 for r in rows],
                    "shrink_ms": median(rows, "shrink_s") * 1e3,
                    "speedup_vs_copy": copy_s / grow_s,
                    "meets_target": copy_s / grow_s >= TARGET_SPEEDUP,
                    "chunks_mapped": rows[0]["chunks_mapped"],
                    "mapped_bytes": rows[0]["mapped_bytes"],
                    "released_bytes": rows[0]["released_bytes"],
                    "device_free_drop_bytes": rows[0]["device_free_drop_bytes"],
                    "device_free_rise_bytes": rows[0]["device_free_rise_bytes"],
                }
            )
            print(
                f"chunk {rows[0]['chunk_bytes'] // MiB:>4} MiB  {variants[-1]['how']:<22} "
                f"grow {grow_s * 1e3:8.3f} ms  shrink {variants[-1]['shrink_ms']:8.3f} ms  "
                f"{copy_s / grow_s:7.1f}x vs copy",
                flush=True,
            )
    result = {
        "provenance": provenance("bench/routines/growable.py"),
        "layout": LAYOUT_ARGS | {"block_bytes": bb},
        "live_bytes": live_bytes,
        "grow_bytes": grow_bytes,
        "reps": args.reps,
        "copy_path": {
            "what": "cudaMalloc(live + grow), cudaMemcpy D2D of live bytes, cudaFree(old)",
            "grow_ms": copy_s * 1e3,
            "grow_ms_all": [r["grow_s"] * 1e3 for r in copy_rows],
            "effective_copy_GBps": live_bytes / copy_s / 1e9,
        },
        "vmm": variants,
        "target_speedup": TARGET_SPEEDUP,
    }
    print(
        f"copy path: {copy_s * 1e3:.3f} ms for {live_bytes / GiB:.1f} GiB live + {grow_bytes / GiB:.1f} GiB"
    )
    write_json(args.out, result)
    print(f"wrote {args.out}")
