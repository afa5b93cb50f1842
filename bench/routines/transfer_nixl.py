"""A request's KV blocks through NIXL (UCX) host to host, against one contiguous NIXL transfer of
the same bytes, in the same run.

Two NIXL agents in one process (UCX picks shared memory or TCP on loopback; on a machine with
RDMA the same calls use it), each with a host pool whose slab is registered once. The
receiver READs the sender's blocks, as `NixlTransport.read_blocks` does, with the descriptors
it builds (`run_descriptors` over pieces.py's grouped pieces: one per run of blocks contiguous
on both sides). For each block size (64 KiB, 2 MiB) and number of blocks (1 .. 4096):

- ``request_scattered``: the sender's blocks a random set of ids (a pool after churn), the
  receiver's a fresh run: about one descriptor per block.
- ``request_fresh``: both sides one run (fresh pools): one descriptor after coalescing.
- ``contiguous``: one descriptor of n * block bytes, hand-made (the baseline: the same bytes
  already packed).

Each case: one warm-up READ, checked byte-exact, then the median wall time of the READ (post
to DONE) over repetitions that interleave the three cases (load from other work on a shared
machine falls on all three alike); ``ratio_to_contiguous`` is the contiguous case's median
over the case's. 2 MiB blocks stop at ``--max-bytes`` per pool (default 1 GiB: this is a shared 23 GiB
machine); the JSON lists what was skipped. Usage:

    python bench/kvbench.py --routine transfer_nixl [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from provenance import provenance

SIZES = [1, 4, 16, 64, 256, 1024, 4096]
BLOCK_BYTES = {"64KiB": 64 << 10, "2MiB": 2 << 20}


def _layout(block_bytes: int):
    import kvpool

    # fp16, block of 16 tokens, 8 KV heads: head_dim chosen so one block has block_bytes.
    # bytes = 2 (K, V) * layers * heads * block_size * head_dim * 2
    layers, heads, block_size = 2, 8, 16
    head_dim = block_bytes // (2 * layers * heads * block_size * 2)
    layout = kvpool.KvLayout(layers, heads, head_dim, block_size)
    assert layout.block_bytes == block_bytes, (layout.block_bytes, block_bytes)
    return layout


def _reps(nbytes: int) -> int:
    return 21 if nbytes <= 64 << 20 else 7


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--quick", action="store_true", help="sizes up to 64 blocks, 3 repetitions")
    ap.add_argument("--max-bytes", type=int, default=1 << 30, help="bytes per pool, at most")
    args = ap.parse_args(argv)

    import kvpool
    from kvpool.transfer.nixl_transport import load_nixl, run_descriptors
    from kvpool.transfer.pieces import GROUPED, plan_pieces

    nixl = load_nixl()
    prov = provenance("bench/routines/transfer_nixl.py")
    rows, skipped = [], []
    sizes = [n for n in SIZES if n <= 64] if args.quick else SIZES
    rng = np.random.default_rng(0)
    for label, block_bytes in BLOCK_BYTES.items():
        fit = [n for n in sizes if n * block_bytes <= args.max_bytes]
        skipped += [f"{label} x {n}" for n in sizes if n not in fit]
        if not fit:
            continue
        num_blocks = max(fit)
        layout = _layout(block_bytes)
        src = kvpool.Pool(layout, num_blocks, device="host")
        dst = kvpool.Pool(layout, num_blocks, device="host")
        slab_bytes = num_blocks * block_bytes
        src_slab = np.ctypeslib.as_array(
            (np.ctypeslib.ctypes.c_uint8 * slab_bytes).from_address(src.base_ptr)
        )
        dst_slab = np.ctypeslib.as_array(
            (np.ctypeslib.ctypes.c_uint8 * slab_bytes).from_address(dst.base_ptr)
        )
        src_slab[:] = rng.integers(0, 256, slab_bytes, dtype=np.uint8)
        config = nixl.nixl_agent_config(backends=["UCX"])
        reader = nixl.nixl_agent(f"bench-reader-{label}", config)
        owner = nixl.nixl_agent(f"bench-owner-{label}", nixl.nixl_agent_config(backends=["UCX"]))
        reader.register_memory([(dst.base_ptr, slab_bytes, 0, "")], "DRAM")
        owner.register_memory([(src.base_ptr, slab_bytes, 0, "")], "DRAM")
        reader.add_remote_agent(owner.get_agent_metadata())
        owner.add_remote_agent(reader.get_agent_metadata())

        def read(local, remote, reader=reader, label=label):
            handle = reader.initialize_xfer(
                "READ",
                reader.get_xfer_descs(local, "DRAM"),
                reader.get_xfer_descs(remote, "DRAM"),
                f"bench-owner-{label}",
            )
            t0 = time.perf_counter()
            state = reader.transfer(handle)
            while state == "PROC":
                state = reader.check_xfer_state(handle)
            elapsed = time.perf_counter() - t0
            reader.release_xfer_handle(handle)
            assert state == "DONE", state
            return elapsed

        for n in fit:
            nbytes = n * block_bytes
            dst_ids = np.arange(n, dtype=np.int32)
            cases = {
                "request_scattered": rng.permutation(num_blocks)[:n].astype(np.int32),
                "request_fresh": np.arange(n, dtype=np.int32),
            }
            descs, counts = {}, {}
            for case, src_ids in cases.items():
                pieces = plan_pieces(GROUPED, src_ids, dst_ids, n)
                descs[case] = (
                    run_descriptors(dst.base_ptr, block_bytes, dst_ids, pieces),
                    run_descriptors(src.base_ptr, block_bytes, src_ids, pieces),
                )
                counts[case] = len(pieces)
            descs["contiguous"] = (
                np.array([[dst.base_ptr, nbytes, 0]], np.uint64),
                np.array([[src.base_ptr, nbytes, 0]], np.uint64),
            )
            counts["contiguous"] = 1
            times: dict[str, list[float]] = {case: [] for case in descs}
            for case, (local, remote) in descs.items():
                dst_slab[:nbytes] = 0
                read(local, remote)  # warm-up: the first READ of a region sets UCX up
                got = dst_slab[:nbytes].reshape(n, block_bytes)
                src_ids = cases.get(case, np.arange(n))
                want = src_slab.reshape(num_blocks, block_bytes)[src_ids]
                assert np.array_equal(got, want), f"{case} {label} x {n}: bytes differ"
            # Repetitions interleave the cases, so that load from other work on this shared
            # machine falls on all of them alike.
            for _ in range(3 if args.quick else _reps(nbytes)):
                for case, (local, remote) in descs.items():
                    times[case].append(read(local, remote))
            contiguous = statistics.median(times["contiguous"])
            for case in descs:
                row = _row(case, label, n, nbytes, counts[case], times[case])
                row["ratio_to_contiguous"] = contiguous / statistics.median(times[case])
                rows.append(row)
        del reader, owner
    result = {
        "routine": "transfer_nixl",
        "provenance": prov,
        "nixl_version": getattr(nixl, "__version__", None) or _dist_version(),
        "what": "READ of a request's blocks host to host through NIXL/UCX, 2 agents 1 process",
        "skipped": skipped,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(
            f"{r['case']:<18} {r['block']:>5} x {r['blocks']:>4}  {r['descriptors']:>5} desc  "
            f"{r['median_us']:>10.1f} us  {r['gbytes_per_s']:>7.2f} GB/s  "
            f"x{r['ratio_to_contiguous']:.2f}"
        )
    return 0


def _row(case, label, n, nbytes, descriptors, times):
    med = statistics.median(times)
    return {
        "case": case,
        "block": label,
        "blocks": n,
        "bytes": nbytes,
        "descriptors": descriptors,
        "reps": len(times),
        "median_us": med * 1e6,
        "gbytes_per_s": nbytes / med / 1e9,
    }


def _dist_version():
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None
