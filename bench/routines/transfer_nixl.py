"""A request's KV blocks through NIXL (UCX) host to host and device to device, against one
contiguous NIXL transfer of the same bytes, in the same run.

Two NIXL agents in one process (UCX picks CMA, shared memory or TCP on loopback; for GPU memory
cuda_ipc where it can, else a GET emulated over TCP, as on the one-H200 box, where cuda_ipc
cannot reach its own process; on a machine with RDMA the same calls use it), each with a pool whose
slab is registered once: ``--memory host`` host pools (DRAM), ``--memory cuda`` CUDA pools on
one GPU (VRAM, device 0), ``--memory both`` the two in turn. The
receiver READs the sender's blocks, as `NixlTransport.read_blocks` does, with the descriptors
it builds (`run_descriptors` over pieces.py's grouped pieces: one per run of blocks contiguous
on both sides). For each block size (64 KiB, 2 MiB) and number of blocks (1 .. 4096):

- ``request_scattered``: the sender's blocks a random set of ids (a pool after churn), the
  receiver's a fresh run: about one descriptor per block.
- ``request_fresh``: both sides one run (fresh pools): one descriptor after coalescing.
- ``contiguous``: one descriptor of n * block bytes, hand-made (the baseline: the same bytes
  already packed).

Each case: one warm-up READ, checked byte-exact (every block on the GPU and up to 1 GiB on the
host; past that a random 256 of the blocks, ``checked_blocks`` says how many), then the median
wall time of the READ (post to DONE) over repetitions that interleave the three cases (load
from other work on a shared machine falls on all three alike); ``ratio_to_contiguous`` is the
contiguous case's median over the case's, and ``us_per_extra_descriptor`` what each
descriptor past the first added to the contiguous READ's time. 2 MiB blocks stop at
``--max-bytes`` per pool (default 1 GiB: the dev machine is a shared 23 GiB one); the JSON
lists what was skipped. The host pools are filled from a tiled 64 MiB random chunk with each
block's index stamped in its first 8 bytes (filling 8 GiB from a generator took longer than
the READs). Run with ``UCX_PROTO_INFO=y`` to have UCX print which transport each READ took.
Usage:

    python bench/kvbench.py --routine transfer_nixl [--out DIR] [--quick] [--memory both]
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
    return 21 if nbytes <= 64 << 20 else 7 if nbytes <= 1 << 30 else 3


_FULL_CHECK_BYTES = 1 << 30  # host: every block checked up to this, a sample past it
_SAMPLE_BLOCKS = 256


class _Slabs:
    """A pair of pools (sender ``src``, receiver ``dst``) on ``memory`` ("host" or "cuda"),
    the sender's filled with distinct blocks, and the byte-exact check of a READ's result."""

    def __init__(self, memory: str, layout, num_blocks: int, rng) -> None:
        import kvpool

        self.memory, self.num_blocks, self.block_bytes = memory, num_blocks, layout.block_bytes
        device = "host" if memory == "host" else "cuda"
        self.src = kvpool.Pool(layout, num_blocks, device=device)
        self.dst = kvpool.Pool(layout, num_blocks, device=device)
        self.nbytes = num_blocks * self.block_bytes
        self.src_slab, self.dst_slab = self._array(self.src), self._array(self.dst)
        chunk = rng.integers(0, 256, min(self.nbytes, 64 << 20), dtype=np.uint8)
        xp = self._xp()
        chunk = xp.asarray(chunk)
        for start in range(0, self.nbytes, len(chunk)):
            end = min(start + len(chunk), self.nbytes)
            self.src_slab[start:end] = chunk[: end - start]
        words = self.src_slab.view(xp.uint64).reshape(num_blocks, self.block_bytes // 8)
        words[:, 0] = xp.arange(1, num_blocks + 1, dtype=xp.uint64)  # every block differs
        self.mem_type = "DRAM" if memory == "host" else "VRAM"
        if memory == "cuda":
            xp.cuda.runtime.deviceSynchronize()

    def _xp(self):
        if self.memory == "host":
            return np
        import cupy

        return cupy

    def _array(self, pool):
        if self.memory == "host":
            raw = (np.ctypeslib.ctypes.c_uint8 * self.nbytes).from_address(pool.base_ptr)
            return np.ctypeslib.as_array(raw)
        import cupy

        memory = cupy.cuda.UnownedMemory(pool.base_ptr, self.nbytes, pool)
        return cupy.ndarray((self.nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))

    def clear(self, nbytes: int) -> None:
        self.dst_slab[:nbytes] = 0
        if self.memory == "cuda":
            self._xp().cuda.runtime.deviceSynchronize()

    def check(self, src_ids: np.ndarray, rng) -> int:
        """Raises unless the receiver's first ``len(src_ids)`` blocks hold the sender's
        ``src_ids``; the number of blocks compared."""
        xp, n = self._xp(), len(src_ids)
        got = self.dst_slab[: n * self.block_bytes].reshape(n, self.block_bytes)
        want = self.src_slab.reshape(self.num_blocks, self.block_bytes)
        if self.memory == "host" and n * self.block_bytes > _FULL_CHECK_BYTES:
            rows = np.sort(rng.choice(n, _SAMPLE_BLOCKS, replace=False))
            assert np.array_equal(got[rows], want[src_ids[rows]]), "bytes differ"
            return _SAMPLE_BLOCKS
        same = xp.array_equal(got, want[xp.asarray(src_ids)])
        assert bool(same), "bytes differ"
        return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--quick", action="store_true", help="sizes up to 64 blocks, 3 repetitions")
    ap.add_argument("--max-bytes", type=int, default=1 << 30, help="bytes per pool, at most")
    ap.add_argument(
        "--memory", choices=("host", "cuda", "both"), default="host", help="the pools' memory"
    )
    ap.add_argument(
        "--blocks",
        nargs="+",
        choices=sorted(BLOCK_BYTES),
        default=list(BLOCK_BYTES),
        help="block sizes to measure",
    )
    args = ap.parse_args(argv)

    from kvpool.transfer.nixl_transport import load_nixl

    nixl = load_nixl()
    prov = provenance("bench/routines/transfer_nixl.py")
    rows, skipped = [], []
    sizes = [n for n in SIZES if n <= 64] if args.quick else SIZES
    rng = np.random.default_rng(0)
    # The GPU first: its cases are short, the host's 8 GiB ones the longest of the run.
    memories = ("cuda", "host") if args.memory == "both" else (args.memory,)
    result = {
        "routine": "transfer_nixl",
        "provenance": prov,
        "nixl_version": getattr(nixl, "__version__", None) or _dist_version(),
        "what": "READ of a request's blocks through NIXL/UCX, 2 agents 1 process, host or GPU",
        "memories": list(memories),
        "complete": False,  # written after each block size, so a run cut short keeps its rows
        "skipped": skipped,
        "rows": rows,
    }

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    for memory in memories:
        for label in args.blocks:
            block_bytes = BLOCK_BYTES[label]
            fit = [n for n in sizes if n * block_bytes <= args.max_bytes]
            skipped += [f"{memory} {label} x {n}" for n in sizes if n not in fit]
            if fit:
                _measure(nixl, memory, label, block_bytes, fit, args.quick, rng, rows, save)
    result["complete"] = True
    save()
    for r in rows:
        print(
            f"{r['memory']:<4} {r['case']:<18} {r['block']:>5} x {r['blocks']:>4}  "
            f"{r['descriptors']:>5} desc  "
            f"{r['median_us']:>10.1f} us  {r['gbytes_per_s']:>7.2f} GB/s  "
            f"x{r['ratio_to_contiguous']:.2f}"
        )
    return 0


def _measure(nixl, memory, label, block_bytes, fit, quick, rng, rows, save) -> None:
    """Appends to ``rows`` those of one memory kind and block size, every case at every number
    of blocks, calling ``save`` after each number of blocks."""
    from kvpool.transfer.nixl_transport import run_descriptors
    from kvpool.transfer.pieces import GROUPED, plan_pieces

    num_blocks = max(fit)
    slabs = _Slabs(memory, _layout(block_bytes), num_blocks, rng)
    src, dst, mem = slabs.src, slabs.dst, slabs.mem_type
    names = (f"bench-reader-{memory}-{label}", f"bench-owner-{memory}-{label}")
    reader = nixl.nixl_agent(names[0], nixl.nixl_agent_config(backends=["UCX"]))
    owner = nixl.nixl_agent(names[1], nixl.nixl_agent_config(backends=["UCX"]))
    registrations = [
        (reader, reader.register_memory([(dst.base_ptr, slabs.nbytes, 0, "")], mem)),
        (owner, owner.register_memory([(src.base_ptr, slabs.nbytes, 0, "")], mem)),
    ]
    reader.add_remote_agent(owner.get_agent_metadata())
    owner.add_remote_agent(reader.get_agent_metadata())

    def read(local, remote):
        handle = reader.initialize_xfer(
            "READ", reader.get_xfer_descs(local, mem), reader.get_xfer_descs(remote, mem), names[1]
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
            "contiguous": np.arange(n, dtype=np.int32),
        }
        descs, counts, checked = {}, {}, {}
        for case, src_ids in cases.items():
            if case == "contiguous":  # one hand-made descriptor: the same bytes, packed
                descs[case] = (
                    np.array([[dst.base_ptr, nbytes, 0]], np.uint64),
                    np.array([[src.base_ptr, nbytes, 0]], np.uint64),
                )
                counts[case] = 1
                continue
            pieces = plan_pieces(GROUPED, src_ids, dst_ids, n)
            descs[case] = (
                run_descriptors(dst.base_ptr, block_bytes, dst_ids, pieces),
                run_descriptors(src.base_ptr, block_bytes, src_ids, pieces),
            )
            counts[case] = len(pieces)
        for case, (local, remote) in descs.items():
            slabs.clear(nbytes)
            read(local, remote)  # warm-up: the first READ of a region sets UCX up
            try:
                checked[case] = slabs.check(cases[case], rng)
            except AssertionError as e:
                raise AssertionError(f"{memory} {case} {label} x {n}: {e}") from e
        times: dict[str, list[float]] = {case: [] for case in descs}
        # Repetitions interleave the cases, so that load from other work on this shared
        # machine falls on all of them alike.
        for _ in range(3 if quick else _reps(nbytes)):
            for case, (local, remote) in descs.items():
                times[case].append(read(local, remote))
        contiguous = statistics.median(times["contiguous"])
        for case in descs:
            row = _row(case, label, n, nbytes, counts[case], times[case])
            row["memory"] = memory
            row["checked_blocks"] = checked[case]
            row["ratio_to_contiguous"] = contiguous / statistics.median(times[case])
            if counts[case] > 1:
                extra = statistics.median(times[case]) - contiguous
                row["us_per_extra_descriptor"] = extra / (counts[case] - 1) * 1e6
            rows.append(row)
        save()
        print(f"{memory} {label} x {n} done", flush=True)
    for agent, registration in registrations:  # before the pools go: their memory is freed
        agent.deregister_memory(registration)


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
