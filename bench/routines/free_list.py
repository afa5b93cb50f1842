"""The Rust free list against a `Mutex<Vec<u32>>` with the same checks (criterion, 1-16 threads).

Runs the criterion groups of rust/core/benches/free_list.rs (1, 2, 4, 8, 16 threads x 1, 16 and
256 blocks per call, and 16 scattered ids), then reads
<criterion dir>/<group>/<impl>/<threads>/new/{benchmark,estimates}.json, whose throughput is
counted in blocks. For each group and thread count it records ours and the baseline in ns per
block round trip (alloc + free of one block, wall clock across all threads: the inverse of
aggregate throughput) and their ratio. The criterion run is either
`cargo bench -p kvpool-core --bench free_list` (the default) or a bench binary built elsewhere
(`--binary`, from `cargo bench -p kvpool-core --bench free_list --no-run`), for a machine
without the Rust toolchain; `--criterion-dir` only collects results already there.

    python3 bench/kvbench.py --routine free_list [--binary PATH] [--machine TEXT]
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from provenance import provenance, write_json

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRITERION_ARGS = ("--warm-up-time", "1", "--measurement-time", "2")
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


def run_criterion(binary: pathlib.Path | None) -> pathlib.Path:
    """Runs the free-list groups into a fresh criterion folder; returns the folder."""
    home = pathlib.Path(tempfile.mkdtemp(prefix="kvpool-criterion-"))
    env = {**os.environ, "CRITERION_HOME": str(home)}
    if binary:
        command = [str(binary), "--bench", *CRITERION_ARGS]
    else:
        command = ["cargo", "bench", "--locked", "-p", "kvpool-core", "--bench", "free_list"]
        command += ["--", *CRITERION_ARGS]
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    return home


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--binary", type=pathlib.Path, help="a built criterion binary to run instead of cargo"
    )
    parser.add_argument(
        "--criterion-dir", type=pathlib.Path, help="collect the results there; run nothing"
    )
    parser.add_argument("--machine", default="", help="a description of the machine, recorded")
    parser.add_argument(
        "--note", default="", help="conditions of the run, e.g. other load on the machine"
    )
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the JSON to write")
    args = parser.parse_args(argv)

    criterion_dir = args.criterion_dir or run_criterion(args.binary)
    found = load(criterion_dir)
    if not found:
        sys.exit(f"no free_list criterion results under {criterion_dir}")
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
        "provenance": provenance("bench/routines/free_list.py"),
        "benchmark": "rust/core/benches/free_list.rs",
        "command": "cargo bench -p kvpool-core --bench free_list -- " + " ".join(CRITERION_ARGS),
        "core_sources_modified_since_commit": None
        if os.environ.get("KVPOOL_COMMIT")
        else bool(git("status", "--porcelain", "rust/core/src")),
        "machine_description": args.machine,
        "note": args.note,
        "unit": "ns per block round trip (alloc + free of one block), wall clock across all threads",
        "estimate": "criterion slope over the samples (mean where there is no slope), with its 95% interval",
        "ratio": "ours_over_mutex = ours_ns_per_block / mutex_ns_per_block; below 1 means ours is faster",
        "results": results,
    }
    out = args.out
    write_json(out, record, indent=2)
    print(f"{'group':<18}{'threads':>8}{'ours ns':>12}{'mutex ns':>12}{'ours/mutex':>12}")
    for r in results:
        print(
            f"{r['group']:<18}{r['threads']:>8}{r['ours_ns_per_block']:>12.2f}"
            f"{r['mutex_ns_per_block']:>12.2f}{r['ours_over_mutex']:>12.2f}"
        )
    print(f"wrote {out}")
