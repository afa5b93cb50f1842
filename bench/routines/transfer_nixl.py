"""A request's KV blocks through NIXL (UCX) host to host and device to device, against one
contiguous NIXL transfer of the same bytes, in the same run.

Two NIXL agents, each with a pool whose slab is registered once: in one process (``--owner
thread``, the default; UCX picks CMA, shared memory or TCP on loopback, and for GPU memory a GET
emulated over TCP: cuda_ipc cannot reach its own process) or the owner in a spawned process
(``--owner process``: for GPU memory UCX's cuda_ipc where it is enabled for GET; without NVLink
UCX's ``auto`` leaves it off; the agents are made as ``NixlTransport.connect`` makes them,
which sets ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` unless it is set; the JSON records the UCX_
variables of the run; on a machine with RDMA the same calls use it). ``--memory host``
host pools (DRAM), ``--memory cuda`` CUDA pools on one GPU (VRAM, device 0), ``--memory both``
the two in turn. The
receiver READs the sender's blocks, as `NixlTransport.read_blocks` does, with the descriptors
it builds (`run_descriptors` over pieces.py's grouped pieces: one per run of blocks contiguous
on both sides). For each block size (64 KiB, 2 MiB) and number of blocks (1 .. 4096):

- ``request_scattered``: the sender's blocks a random set of ids (a pool after churn), the
  receiver's a fresh run: about one descriptor per block.
- ``request_fresh``: both sides one run (fresh pools): one descriptor after coalescing.
- ``contiguous``: one descriptor of n * block bytes, hand-made (the baseline: the same bytes
  already packed).
- ``request_staged`` (CUDA pools, ``--owner process``): the scattered source packed first, as
  ``NixlTransport`` does with its staging buffer (nixl_staging.py): the owner's gather of the
  blocks into its registered buffer, timed in its process, plus one descriptor's READ (the
  pipe's round trip asking for the gather is not counted: the protocol's sender gathers before
  the offer that every case needs).
- ``cuda_ipc_memcpy`` (CUDA pools, ``--owner process``): no NIXL, one cudaMemcpyAsync of the
  same packed bytes from the owner's slab opened through CUDA IPC: the copy engine's rate
  between two processes of one GPU, what the contiguous READ's own overhead is measured on.

Each case: one warm-up READ, checked byte-exact (every block on the GPU and up to 1 GiB on the
host; past that a random 256 of the blocks, ``checked_blocks`` says how many), then the median
wall time of the READ (post to DONE) over repetitions that interleave the cases, in a new
random order each (load from other work on a shared machine falls on all alike, and so does
whatever one case leaves behind for the next); ``ratio_to_contiguous`` is the
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
import functools
import json
import multiprocessing
import os
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


def _fill(xp, slab, num_blocks: int, block_bytes: int, seed: int) -> None:
    """Fills ``slab`` (``num_blocks`` blocks) from a tiled random 64 MiB chunk made from
    ``seed``, with each block's index stamped in its first 8 bytes: the same bytes wherever it
    runs, so a reader in another process can rebuild what the owner's pool holds."""
    nbytes = num_blocks * block_bytes
    chunk = np.random.default_rng(seed).integers(0, 256, min(nbytes, 64 << 20), dtype=np.uint8)
    chunk = xp.asarray(chunk)
    for start in range(0, nbytes, len(chunk)):
        end = min(start + len(chunk), nbytes)
        slab[start:end] = chunk[: end - start]
    words = slab.view(xp.uint64).reshape(num_blocks, block_bytes // 8)
    words[:, 0] = xp.arange(1, num_blocks + 1, dtype=xp.uint64)  # every block differs


def _xp(memory: str):
    if memory == "host":
        return np
    import cupy

    return cupy


def _slab_array(memory: str, pool, nbytes: int):
    """The bytes of ``pool``'s slab as a NumPy (host) or CuPy (cuda) uint8 array."""
    if memory == "host":
        raw = (np.ctypeslib.ctypes.c_uint8 * nbytes).from_address(pool.base_ptr)
        return np.ctypeslib.as_array(raw)
    import cupy

    memory_ = cupy.cuda.UnownedMemory(pool.base_ptr, nbytes, pool)
    return cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory_, 0))


def _pool(memory: str, block_bytes: int, num_blocks: int):
    import kvpool

    return kvpool.Pool(
        _layout(block_bytes), num_blocks, device="host" if memory == "host" else "cuda"
    )


class _Slabs:
    """The receiver's pool ``dst`` on ``memory`` ("host" or "cuda") and the owner's bytes: its
    pool ``src`` when the owner is in this process, else (``owner_pool=False``) a copy of what
    the owner's pool in the other process holds (``_fill`` from the same seed), for the
    byte-exact check of a READ's result."""

    def __init__(
        self, memory: str, block_bytes: int, num_blocks: int, seed: int, owner_pool: bool
    ) -> None:
        self.memory, self.num_blocks, self.block_bytes = memory, num_blocks, block_bytes
        self.nbytes = num_blocks * block_bytes
        xp = _xp(memory)
        self.dst = _pool(memory, block_bytes, num_blocks)
        self.dst_slab = _slab_array(memory, self.dst, self.nbytes)
        if owner_pool:
            self.src = _pool(memory, block_bytes, num_blocks)
            self.src_slab = _slab_array(memory, self.src, self.nbytes)
        else:
            self.src, self.src_slab = None, xp.empty(self.nbytes, xp.uint8)
        _fill(xp, self.src_slab, num_blocks, block_bytes, seed)
        self.mem_type = "DRAM" if memory == "host" else "VRAM"
        if memory == "cuda":
            xp.cuda.runtime.deviceSynchronize()

    def clear(self, nbytes: int) -> None:
        self.dst_slab[:nbytes] = 0
        if self.memory == "cuda":
            _xp(self.memory).cuda.runtime.deviceSynchronize()

    def check(self, src_ids: np.ndarray, rng) -> int:
        """Raises unless the receiver's first ``len(src_ids)`` blocks hold the sender's
        ``src_ids``; the number of blocks compared."""
        xp, n = _xp(self.memory), len(src_ids)
        got = self.dst_slab[: n * self.block_bytes].reshape(n, self.block_bytes)
        want = self.src_slab.reshape(self.num_blocks, self.block_bytes)
        if self.memory == "host" and n * self.block_bytes > _FULL_CHECK_BYTES:
            rows = np.sort(rng.choice(n, _SAMPLE_BLOCKS, replace=False))
            assert np.array_equal(got[rows], want[src_ids[rows]]), "bytes differ"
            return _SAMPLE_BLOCKS
        same = xp.array_equal(got, want[xp.asarray(src_ids)])
        assert bool(same), "bytes differ"
        return n


def _owner_process(conn) -> None:
    """The owner in its own process (``--owner process``): builds and fills its pool, registers
    it with its NIXL agent, sends (agent metadata, slab base) and takes the reader's metadata,
    then holds the pool until told to stop."""
    from kvpool.transfer.nixl_staging import StagingBuffer
    from kvpool.transfer.nixl_transport import enable_cuda_ipc_get, load_nixl

    nixl = load_nixl()
    memory, block_bytes, num_blocks, seed, name = conn.recv()
    pool = _pool(memory, block_bytes, num_blocks)
    nbytes = num_blocks * block_bytes
    _fill(_xp(memory), _slab_array(memory, pool, nbytes), num_blocks, block_bytes, seed)
    if memory == "cuda":
        _xp(memory).cuda.runtime.deviceSynchronize()
    mem = "DRAM" if memory == "host" else "VRAM"
    enable_cuda_ipc_get(mem)
    agent = nixl.nixl_agent(name, nixl.nixl_agent_config(backends=["UCX"]))
    registration = agent.register_memory([(pool.base_ptr, nbytes, 0, "")], mem)
    ipc = None  # the slab's CUDA IPC handle, for the reader's plain-copy baseline
    staging = None  # the request_staged case's buffer, as NixlTransport.connect makes it
    if memory == "cuda":
        try:
            ipc = bytes(_xp(memory).cuda.runtime.ipcGetMemHandle(pool.base_ptr))
        except Exception as e:  # the reader records why the baseline is missing
            ipc = f"{type(e).__name__}: {e}"
        staging = StagingBuffer(pool, num_blocks, agent, mem, 0)
    staging_base = None if staging is None else staging.base_ptr
    conn.send((agent.get_agent_metadata(), pool.base_ptr, ipc, staging_base))
    agent.add_remote_agent(conn.recv())
    while True:
        # The owner polls its pipe rather than sleeping in recv: a sender about to offer has
        # just waited for its stream and is running (woken from a blocking recv, the gather of
        # one block measured 120-330 us on the H200, against 32 us in a running process).
        while not conn.poll(0):
            pass
        if (message := conn.recv()) == "stop":
            break
        assert staging is not None and message[0] == "gather", message
        t0 = time.perf_counter()
        staging.gather(message[1])  # as NixlTransport.stage_source, before an offer
        conn.send(time.perf_counter() - t0)
    if staging is not None:
        staging.close()
    agent.deregister_memory(registration)
    conn.send("stopped")


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
    ap.add_argument(
        "--owner",
        choices=("thread", "process"),
        default="thread",
        help="the owner's agent and pool in this process or in a spawned one (CUDA IPC needs two)",
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
        "what": "READ of a request's blocks through NIXL/UCX, host or GPU",
        "owner": args.owner,
        "ucx_env": {},  # the UCX_ variables the agents were made with (at each save)
        "memories": list(memories),
        "complete": False,  # written after each block size, so a run cut short keeps its rows
        "skipped": skipped,
        "rows": rows,
    }

    def save() -> None:
        result["ucx_env"] = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    for memory in memories:
        for label in args.blocks:
            block_bytes = BLOCK_BYTES[label]
            fit = [n for n in sizes if n * block_bytes <= args.max_bytes]
            skipped += [f"{memory} {label} x {n}" for n in sizes if n not in fit]
            if fit:
                _measure(
                    nixl,
                    memory,
                    label,
                    block_bytes,
                    fit,
                    args.quick,
                    rng,
                    rows,
                    save,
                    args.owner,
                    skipped,
                )
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


def _measure(
    nixl, memory, label, block_bytes, fit, quick, rng, rows, save, owner_mode, skipped
) -> None:
    """Appends to ``rows`` those of one memory kind and block size, every case at every number
    of blocks, calling ``save`` after each number of blocks."""
    from kvpool.transfer.nixl_transport import enable_cuda_ipc_get, run_descriptors
    from kvpool.transfer.pieces import GROUPED, plan_pieces

    num_blocks = max(fit)
    seed = int(rng.integers(1 << 31))
    slabs = _Slabs(memory, block_bytes, num_blocks, seed, owner_pool=owner_mode == "thread")
    dst, mem = slabs.dst, slabs.mem_type
    names = (f"bench-reader-{memory}-{label}", f"bench-owner-{memory}-{label}")
    enable_cuda_ipc_get(mem)  # as NixlTransport.connect does, before the agents are made
    reader = nixl.nixl_agent(names[0], nixl.nixl_agent_config(backends=["UCX"]))
    registrations = [(reader, reader.register_memory([(dst.base_ptr, slabs.nbytes, 0, "")], mem))]
    if owner_mode == "thread":  # a second agent in this process
        owner = nixl.nixl_agent(names[1], nixl.nixl_agent_config(backends=["UCX"]))
        registrations.append(
            (owner, owner.register_memory([(slabs.src.base_ptr, slabs.nbytes, 0, "")], mem))
        )
        reader.add_remote_agent(owner.get_agent_metadata())
        owner.add_remote_agent(reader.get_agent_metadata())
        src_base, ipc_base, staging_base = slabs.src.base_ptr, None, None
    else:  # the owner's pool and agent in another process (spawned: a CUDA context of its own)
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        child = ctx.Process(target=_owner_process, args=(child_conn,), daemon=True)
        child.start()
        conn.send((memory, block_bytes, num_blocks, seed, names[1]))
        owner_metadata, src_base, ipc, staging_base = conn.recv()
        reader.add_remote_agent(owner_metadata)
        conn.send(reader.get_agent_metadata())
        ipc_base = _open_ipc(ipc, memory, label, skipped)

    def memcpy(nbytes: int) -> float:
        """The plain-copy baseline: one cudaMemcpyAsync of the owner's first ``nbytes``, opened
        by CUDA IPC, post to completion, as a user copying packed bytes between two processes
        of one GPU would (no NIXL, no descriptors)."""
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
        t0 = time.perf_counter()
        cupy.cuda.runtime.memcpyAsync(dst.base_ptr, ipc_base, nbytes, 3, stream.ptr)
        stream.synchronize()
        return time.perf_counter() - t0

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

    gather_us: list[float] = []  # the staged case's gathers, as the owner timed them

    def staged(local, remote, src_ids) -> float:
        """The staged request: the owner's gather of ``src_ids`` into its staging buffer, as
        timed in its process (ids to the device, the kernel, its wait), plus one READ of the
        packed bytes. The pipe's round trip that asks for the gather is left out: in the
        protocol the sender gathers before its offer, a message every case sends."""
        conn.send(("gather", src_ids))
        gather_s = conn.recv()
        gather_us.append(gather_s * 1e6)
        return gather_s + read(local, remote)

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
                    np.array([[src_base, nbytes, 0]], np.uint64),
                )
                counts[case] = 1
                continue
            pieces = plan_pieces(GROUPED, src_ids, dst_ids, n)
            descs[case] = (
                run_descriptors(dst.base_ptr, block_bytes, dst_ids, pieces),
                run_descriptors(src_base, block_bytes, src_ids, pieces),
            )
            counts[case] = len(pieces)
        runs = {case: functools.partial(read, *pair) for case, pair in descs.items()}
        if staging_base is not None:
            packed = np.array([[staging_base, nbytes, 0]], np.uint64)
            src_ids = cases["request_scattered"]
            runs["request_staged"] = functools.partial(
                staged, descs["contiguous"][0], packed, src_ids
            )
            cases["request_staged"], counts["request_staged"] = src_ids, 1
        if ipc_base is not None:
            runs["cuda_ipc_memcpy"] = functools.partial(memcpy, nbytes)
            cases["cuda_ipc_memcpy"], counts["cuda_ipc_memcpy"] = cases["contiguous"], 1
        for case, run in runs.items():
            slabs.clear(nbytes)
            run()  # warm-up: the first READ of a region sets UCX up
            try:
                checked[case] = slabs.check(cases[case], rng)
            except AssertionError as e:
                raise AssertionError(f"{memory} {case} {label} x {n}: {e}") from e
        times: dict[str, list[float]] = {case: [] for case in runs}
        # Repetitions interleave the cases, so that load from other work on this shared
        # machine falls on all of them alike, in a new random order each time: a READ right
        # after the scattered case's thousands of descriptors, or after the staged case's
        # gather in the other process, was measured slower (on one H200, 64 KiB x 1024 blocks
        # in a fixed order: the fresh case 1004 us against 85 us for the same descriptor as
        # the contiguous one).
        case_names = list(runs)
        gather_us.clear()
        for _ in range(3 if quick else _reps(nbytes)):
            for case in rng.permutation(case_names):
                times[case].append(runs[case]())
        contiguous = statistics.median(times["contiguous"])
        for case in runs:
            row = _row(case, label, n, nbytes, counts[case], times[case])
            row["memory"] = memory
            row["owner"] = owner_mode
            row["checked_blocks"] = checked[case]
            row["ratio_to_contiguous"] = contiguous / statistics.median(times[case])
            if case == "request_staged":
                row["gather_us_median"] = statistics.median(gather_us)
            if counts[case] > 1:
                extra = statistics.median(times[case]) - contiguous
                row["us_per_extra_descriptor"] = extra / (counts[case] - 1) * 1e6
            rows.append(row)
        save()
        print(f"{memory} {label} x {n} done", flush=True)
    for agent, registration in registrations:  # before the pools go: their memory is freed
        agent.deregister_memory(registration)
    if ipc_base is not None:
        import cupy

        cupy.cuda.runtime.ipcCloseMemHandle(ipc_base)
    if owner_mode == "process":
        conn.send("stop")
        assert conn.recv() == "stopped"
        child.join(timeout=60)


def _open_ipc(ipc, memory: str, label: str, skipped: list) -> int | None:
    """The owner's slab opened through its CUDA IPC handle (its base address here), or None
    with the reason appended to ``skipped`` (host memory: no such baseline)."""
    if memory != "cuda":
        return None
    if not isinstance(ipc, bytes):
        skipped.append(f"cuda_ipc_memcpy {label}: the owner could not export its slab: {ipc}")
        return None
    import cupy

    return cupy.cuda.runtime.ipcOpenMemHandle(ipc)


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
