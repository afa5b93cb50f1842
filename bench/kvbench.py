"""The benchmark driver: one routine per area, each ours against a baseline in the same run.

    python bench/kvbench.py --list
    python bench/kvbench.py --routine ROUTINE [--out DIR] [--name STEM] [--commit SHA] [ARGS...]

Runs `bench/routines/ROUTINE.py` and writes its JSON, with one provenance record
(`bench/provenance.py`), to DIR/STEM.json (STEM defaults to the routine's name; DIR defaults to
`bench/results/<date>_<commit>_<machine>/`). ARGS the driver does not know go to the routine
(`--routine pool --help` lists them). `--commit` names the commit measured where the checkout
has no git metadata. `--warm-flashinfer decode fp8 prefill` triggers FlashInfer's JIT builds
of what those routines time and exits (run it in the background while the GPU tests run).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
# The routines import `provenance`, `timing`, `shape_grid` and each other as `routines.<area>`.
# At module level so that the processes multiprocessing spawns (the transfer routine's) see it.
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

# name -> (what it needs, what it compares). "cpu" runs anywhere the package is installed;
# "gpu" needs one CUDA GPU and CuPy (torch and FlashInfer where it compares with them); "gpu2"
# two GPUs and NCCL; "cargo" the Rust toolchain (or a built criterion binary).
ROUTINES = {
    "pool": (
        "cpu",
        "alloc_many/free_many vs a pure-Python free list; with --device cuda, CUDA blocks vs "
        "cudaMalloc, CuPy's pool and torch's caching allocator",
    ),
    "pool_breakdown": ("cpu", "not a comparison: our 16-block Python round trip split into parts"),
    "tables": ("cpu", "block tables + sync vs an incremental NumPy table and a NumPy rebuild"),
    "prefix": ("cpu", "the prefix cache from Python vs a pure-Python one with the same checks"),
    "sim": ("cpu", "the paged scheduler vs contiguous reservation (three reservation rules)"),
    "prefix_sim": ("cpu", "the scheduler with prefix caching vs without, same KV memory"),
    "swap_sim": ("cpu", "preemption into a host tier (swap or recompute) vs no tier"),
    "hybrid_sim": (
        "cpu",
        "hybrid KV pages vs all-full-attention and vLLM's uniform page bytes, same KV memory",
    ),
    "free_list": ("cargo", "the Rust free list vs Mutex<Vec<u32>>, 1-16 threads (criterion)"),
    "decode": ("gpu", "paged decode vs torch SDPA and FlashInfer, with the read ceiling"),
    "mla": ("gpu", "MLA decode (latent 512 + rope 64) vs FlashInfer's MLA wrapper, read ceilings"),
    "mla_extend": ("gpu", "MLA extend (qo_len 4 and 512, causal) vs FlashInfer's MLA wrapper"),
    "shared_kv": (
        "gpu",
        "head_dim 512 K = V decode/extend vs FlashInfer, torch SDPA, read ceiling",
    ),
    "window": ("gpu", "sliding-window decode at 4k/64k vs FlashInfer window_left, full attention"),
    "fp8": ("gpu", "fp8 decode vs our fp16 decode and FlashInfer's fp8 decode"),
    "fp8_sweep": ("gpu", "tuning sweep of the fp8 decode and the fp8 prefill's loads"),
    "prefill": ("gpu", "paged prefill vs FlashInfer fa2/fa3 and torch SDPA"),
    "fp8_prefill": ("gpu", "fp8 prefill vs our fp16 prefill"),
    "growable": ("gpu", "growing a pool in place (CUDA virtual memory) vs allocate-copy-free"),
    "swap": ("gpu", "host-tier swaps vs one pinned cudaMemcpyAsync and a per-block loop"),
    "generate": ("gpu", "the generation loop vs transformers' caches (needs transformers)"),
    "hybrid_generate": (
        "gpu",
        "a gpt-oss-shaped model through the hybrid loop vs transformers' caches, same KV bytes",
    ),
    "transfer_nixl": (
        "cpu",
        "a request's blocks through NIXL host to host (--memory cuda/both: GPU to GPU) vs one "
        "contiguous NIXL read",
    ),
    "transfer_nixl_tp": (
        "gpu",
        "a TP-2 prefill gathered into a TP-1 pool over NIXL through staging buffers vs the "
        "same gather cut into rows",
    ),
    "disk_tier": (
        "cpu",
        "the disk tier's put/get (NIXL POSIX, checksums) vs a plain sequential file write/read",
    ),
    "transfer": ("gpu2", "a request's KV between two GPUs vs NCCL send/recv and cudaMemcpyPeer"),
    "tp_decode": ("gpu2", "decode over a two-GPU PoolGroup vs the same decode on one GPU"),
}


def list_routines() -> str:
    width = max(map(len, ROUTINES))
    return "\n".join(
        f"{name:<{width}}  {needs:<5}  {what}" for name, (needs, what) in ROUTINES.items()
    )


def run(routine: str, out_dir: Path, stem: str, routine_args: list[str]) -> int:
    """Runs one routine, its JSON at out_dir/stem.json; returns its exit status."""
    module = importlib.import_module(f"routines.{routine}")
    out_dir.mkdir(parents=True, exist_ok=True)
    status = module.main([*routine_args, "--out", str(out_dir / f"{stem}.json")])
    return int(status or 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,  # --help with --routine is the routine's
    )
    ap.add_argument("-h", "--help", action="store_true", help="this help, or the routine's")
    ap.add_argument("--list", action="store_true", help="list the routines and exit")
    ap.add_argument("--routine", choices=sorted(ROUTINES))
    ap.add_argument("--out", type=Path, help="results folder (default: a new run folder)")
    ap.add_argument("--name", help="file stem of the JSON (default: the routine's name)")
    ap.add_argument("--commit", help="the commit measured, where the checkout has no git")
    ap.add_argument(
        "--warm-flashinfer",
        nargs="+",
        choices=("decode", "fp8", "prefill", "mla"),
        metavar="ROUTINE",
        help="compile FlashInfer's kernels for these routines and exit",
    )
    args, routine_args = ap.parse_known_args(argv)
    if args.commit:
        os.environ["KVPOOL_COMMIT"] = args.commit  # provenance.commit() reads it
    if args.help and args.routine is None:
        ap.print_help()
        return 0
    if args.help:  # the routine's help; no run folder made
        importlib.import_module(f"routines.{args.routine}").main(["--help"])
        return 0
    if args.list:
        print(list_routines())
        return 0
    if args.warm_flashinfer:
        from timing import warm_flashinfer

        warm_flashinfer(args.warm_flashinfer)
        return 0
    if args.routine is None:
        ap.error("give --routine (or --list)")
    if args.out is None:
        from provenance import run_dir

        args.out = run_dir()
    return run(args.routine, args.out, args.name or args.routine, routine_args)


if __name__ == "__main__":
    sys.exit(main())
