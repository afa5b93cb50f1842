#!/usr/bin/env python3
"""Collect the free-list criterion results into free_list_rust.json (in this run's results folder).

Reproduce (from the repository root):

    cargo bench -p kvpool-core --bench free_list -- --warm-up-time 1 --measurement-time 2
    python3 bench/collect_criterion.py [--machine "2-core x86_64 dev VM, no GPU"]

Reads target/criterion/<group>/<impl>/<threads>/new/{benchmark,estimates}.json (or under
$CARGO_TARGET_DIR, or --criterion-dir) as written by rust/core/benches/free_list.rs, whose
throughput is counted in blocks. For each group and thread count it records ours and the
Mutex<Vec<u32>> baseline in ns per block round trip (alloc + free of one block, wall clock
across all threads: the inverse of aggregate throughput) and their ratio.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

from provenance import provenance, run_dir, write_json

ROOT = pathlib.Path(__file__).resolve().parent.parent
GROUPS = {"single": 1, "batch16": 16, "batch256": 256, "batch16_scattered": 16}
IMPLS = ("ours", "mutex")


def git(*args):
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def headline(estimates):
    """The estimate criterion prints as `time:`: the slope when it sampled linearly."""
    key = "slope" if estimates.get("slope") else "mean"
    est = estimates[key]
    ci = est["confidence_interval"]
    return key, est["point_estimate"], (ci["lower_bound"], ci["upper_bound"])


def load(criterion_dir):
    """{(group, impl, threads): (estimate kind, ns/block, (lo, hi) ns/block)}."""
    found = {}
    for bench_file in criterion_dir.glob("*/*/*/new/benchmark.json"):
        meta = json.loads(bench_file.read_text())
        group, impl = meta["group_id"], meta["function_id"]
        if group not in GROUPS or impl not in IMPLS:
            continue
        elements = meta["throughput"]["Elements"]
        estimates = json.loads((bench_file.parent / "estimates.json").read_text())
        kind, ns, (lo, hi) = headline(estimates)
        found[(group, impl, int(meta["value_str"]))] = (
            kind,
            ns / elements,
            (lo / elements, hi / elements),
        )
    return found


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    parser.add_argument("--criterion-dir", type=pathlib.Path, default=target / "criterion")
    parser.add_argument(
        "--machine", default="2-core x86_64 dev VM, no GPU", help="a description, recorded"
    )
    parser.add_argument(
        "--note", default="", help="conditions of the run, e.g. other load on the machine"
    )
    parser.add_argument("--commit", help="the commit measured, where there is no git (a GPU host)")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="default: bench/results/<date>_<commit>_<machine>/free_list_rust.json",
    )
    args = parser.parse_args()

    found = load(args.criterion_dir)
    if not found:
        sys.exit(
            f"no free_list criterion results under {args.criterion_dir}; run the cargo bench command first"
        )
    results = []
    for group, batch in GROUPS.items():
        for threads in sorted({t for (g, _, t) in found if g == group}):
            ours, mutex = found.get((group, "ours", threads)), found.get((group, "mutex", threads))
            if ours is None or mutex is None:
                continue
            results.append(
                {
                    "group": group,
                    "blocks_per_call": batch,
                    "threads": threads,
                    "ours_ns_per_block": round(ours[1], 3),
                    "mutex_ns_per_block": round(mutex[1], 3),
                    "ours_over_mutex": round(ours[1] / mutex[1], 3),
                    "ours_ci95_ns": [round(x, 3) for x in ours[2]],
                    "mutex_ci95_ns": [round(x, 3) for x in mutex[2]],
                }
            )
    record = {
        "provenance": provenance("bench/collect_criterion.py"),
        "benchmark": "rust/core/benches/free_list.rs",
        "command": "cargo bench -p kvpool-core --bench free_list -- --warm-up-time 1 --measurement-time 2",
        "core_sources_modified_since_commit": None
        if args.commit
        else bool(git("status", "--porcelain", "rust/core/src")),
        "machine_description": args.machine,
        "note": args.note,
        "unit": "ns per block round trip (alloc + free of one block), wall clock across all threads",
        "estimate": "criterion slope over the samples (mean where there is no slope), with its 95% interval",
        "ratio": "ours_over_mutex = ours_ns_per_block / mutex_ns_per_block; below 1 means ours is faster",
        "results": results,
    }
    out = args.out or run_dir() / "free_list_rust.json"
    write_json(out, record, indent=2)
    print(f"{'group':<18}{'threads':>8}{'ours ns':>12}{'mutex ns':>12}{'ours/mutex':>12}")
    for r in results:
        print(
            f"{r['group']:<18}{r['threads']:>8}{r['ours_ns_per_block']:>12.2f}"
            f"{r['mutex_ns_per_block']:>12.2f}{r['ours_over_mutex']:>12.2f}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
