"""Where the time of the `pool` routine's 16-block round trip goes, from Python, in one run.

Each row is one call pattern on the same host pool; differences between rows bound the parts:

  getter              pool.num_free: entering a PyO3 method and back, nothing else
  ref_cnt             pool.ref_cnt(0): a method with one int argument checked
  empty_round_trip    alloc_many(0) + free_many(empty int32 array): both calls, the NumPy array
                      made and freed, the array read path; no block moves
  single              alloc() + free(id)
  round_trip16        alloc_many(16) + free_many(ids): the `pool` routine's alloc_many16 case
  round_trip16_list   alloc_many(16) + free_many(list of 16 ints): the iterable path

round_trip16 - empty_round_trip is the core's work for 16 blocks plus the per-id reads and
writes of the binding (the core alone is criterion's batch16/ours/1 in benches/free_list.rs).
No baseline: the `pool` routine compares with the pure-Python pool; this only splits our time.

Usage: python bench/kvbench.py --routine pool_breakdown [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvpool
from provenance import provenance, write_json
from timing import interleaved_timeit

LAYOUT = kvpool.KvLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
NUM_BLOCKS = 4096  # as in routines/pool.py


def patterns(pool: kvpool.Pool) -> dict[str, Callable[[], object]]:
    alloc, free, alloc_many, free_many = pool.alloc, pool.free, pool.alloc_many, pool.free_many
    return {
        "getter": lambda: pool.num_free,
        "ref_cnt": lambda: pool.ref_cnt(0),
        "empty_round_trip": lambda: free_many(alloc_many(0)),  # an empty int32 array each way
        "single": lambda: free(alloc()),
        "round_trip16": lambda: free_many(alloc_many(16)),
        "round_trip16_list": lambda: free_many(alloc_many(16).tolist()),
    }


def time_all(
    fns: dict[str, Callable[[], object]], repeat: int, min_time_s: float
) -> dict[str, dict[str, float]]:
    """Median and best per-call time (ns) of each pattern, in interleaved runs."""
    return {
        name: {"median_ns": round(statistics.median(r) * 1e9, 1), "best_ns": round(min(r) * 1e9, 1)}
        for name, r in interleaved_timeit(fns, repeat, min_time_s).items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    parser.add_argument(
        "--repeat", type=int, default=7, help="runs per pattern; the median is reported"
    )
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per run")
    args = parser.parse_args(argv)

    prov = provenance("bench/routines/pool_breakdown.py")
    pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="host")
    rows = time_all(patterns(pool), args.repeat, args.min_time)
    pool.check_invariants()
    assert pool.num_free == NUM_BLOCKS
    result: dict[str, Any] = {
        "provenance": prov,
        "method": f"timeit, patterns interleaved, median (and best) of {args.repeat} runs of >= {args.min_time} s each",
        "num_blocks": NUM_BLOCKS,
        "rows": rows,
    }
    for name, r in rows.items():
        print(f"{name:<20} median {r['median_ns']:8.1f} ns   best {r['best_ns']:8.1f} ns")
    out = args.out
    write_json(out, result, indent=2)
    print(f"wrote {out}")
    return 0
