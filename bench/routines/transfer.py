"""KV transfer between two GPUs, one process each: kvpool's data phase against NCCL send/recv of
one contiguous buffer of the same size and against cudaMemcpyPeer, in the same run.

Llama-3-8B layout (32 layers, 8 KV heads, head_dim 128, block 16, fp16: 2 MiB blocks); the
sender's blocks are a random (shuffled) set of ids, the receiver's are its own. For each
number of blocks (1 .. 4096):

- ``staged/<chunk MiB>``: kvpool's gather -> one NCCL send per chunk -> scatter, pipelined.
- ``grouped``: kvpool's one NCCL send per run of blocks contiguous on both sides, in one group.
- ``nccl_contiguous``: one ncclSend/ncclRecv of n * 2 MiB (what moving already-packed KV costs).
- ``memcpy_peer``: cudaMemcpyPeerAsync of n * 2 MiB (no NCCL; one process owning both GPUs).

Timing: both ranks first exchange a 1-byte NCCL message on the stream the transfer runs on;
the receiver's CUDA events measure from that message's arrival to its last block landing
(median of the repetitions). Each repetition is checked byte-exact by sampling blocks.
``protocol_us``: host wall time of the whole protocol (offer, accept, data, completion) for
the same transfer, from the sender's side. Usage (NCCL_NVLS_ENABLE=0 and friends set):

    python bench/kvbench.py --routine transfer [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
LAYOUT = (32, 8, 128, 16, "float16")
SIZES = [1, 2, 4, 16, 64, 256, 1024, 4096]
CHUNK_MIB = [16, 64, 256]


def _reps(n: int) -> int:
    return 20 if n <= 64 else 8 if n <= 1024 else 4


def _variants():
    return [("staged", c) for c in CHUNK_MIB] + [("grouped", 0), ("nccl_contiguous", 0)]


def _setup(rank: int, max_blocks: int):
    os.environ.update(MULTICAST_OFF)
    import cupy
    import numpy as np

    cupy.cuda.Device(rank).use()
    import kvpool

    pool = kvpool.Pool(kvpool.KvLayout(*LAYOUT), max_blocks + 64, device=f"cuda:{rank}")
    rng = np.random.default_rng(rank)
    ids = rng.permutation(pool.num_blocks)[:max_blocks].astype(np.int32)  # ours, shuffled
    return cupy, np, pool, ids


def _slab(cupy, pool):
    mem = cupy.cuda.UnownedMemory(pool.base_ptr, pool.num_blocks * pool.block_bytes, pool)
    return cupy.ndarray(
        (pool.num_blocks, pool.block_bytes), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0)
    )


def worker(rank: int, rendezvous: str, sizes: list[int], results) -> None:
    try:
        _worker(rank, rendezvous, sizes, results)
    except Exception:
        results.put(("error", rank, traceback.format_exc()))


def _worker(rank, rendezvous, sizes, results):
    from kvpool.transfer import NcclTransport
    from kvpool.transfer.movers import make_mover
    from kvpool.transfer.pieces import plan_pieces

    max_n = max(sizes)
    cupy, np, pool, my_ids = _setup(rank, max_n)
    transport = NcclTransport.connect(rank, rendezvous, rank)
    transport.send_control({"ids": my_ids.tolist()})
    peer_ids = np.asarray(transport.recv_control(120)["ids"], np.int32)
    src_ids, dst_ids = (my_ids, peer_ids) if rank == 0 else (peer_ids, my_ids)
    slab = _slab(cupy, pool)
    if rank == 0:
        cupy.random.seed(7)
        slab[...] = cupy.random.randint(0, 256, slab.shape, dtype=cupy.uint8)
    bb = pool.block_bytes
    contiguous = cupy.empty(max_n * bb, cupy.uint8)
    ping = cupy.zeros(1, cupy.uint8)
    cupy.cuda.Device(rank).synchronize()
    mover = make_mover(pool, ring_slots=2)
    stream = mover.comm_stream
    rows = []
    for n in sizes:
        for mode, chunk_mib in _variants():
            times = []
            for rep in range(_reps(n) + 2):  # two warm-ups
                if rank == 1:
                    slab[dst_ids[:n]] = 0  # poison, so a missing block cannot pass
                    cupy.cuda.Device(1).synchronize()
                transport.send_control({"ready": rep})
                transport.recv_control(120)
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                if rank == 0:
                    transport.send(ping.data.ptr, 1, stream.ptr)
                else:
                    transport.recv(ping.data.ptr, 1, stream.ptr)
                start.record(stream)
                if mode == "nccl_contiguous":
                    op = transport.send if rank == 0 else transport.recv
                    op(contiguous.data.ptr, n * bb, stream.ptr)
                else:
                    chunk = max(1, (chunk_mib << 20) // bb)
                    pieces = plan_pieces(mode, src_ids[:n], dst_ids[:n], chunk)
                    ids = src_ids[:n] if rank == 0 else dst_ids[:n]
                    move = mover.send if rank == 0 else mover.recv
                    move(transport, ids, pieces, mode, stream)
                end.record(stream)
                end.synchronize()
                if rep >= 2:
                    times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
            if mode != "nccl_contiguous":
                # Up to 8 blocks spread over the transfer, as the receiver holds them after the
                # last repetition and as the sender holds them: compared by digest.
                sample = np.unique(np.linspace(0, n - 1, min(n, 8)).astype(np.int64))
                ids = dst_ids if rank == 1 else src_ids
                digest = hashlib.sha256(cupy.asnumpy(slab[ids[sample]]).tobytes()).hexdigest()
                results.put(("sample", rank, n, mode, chunk_mib, digest))
            if rank == 1:
                us = statistics.median(times)
                rows.append(
                    {
                        "num_blocks": n,
                        "bytes": n * bb,
                        "mode": mode,
                        "chunk_mib": chunk_mib or None,
                        "median_us": round(us, 2),
                        "gb_per_s": round(n * bb / us / 1e3, 2),
                        "times_us": [round(t, 2) for t in times],
                    }
                )
    if rank == 0:
        rows = _protocol_times(cupy, np, pool, transport, sizes)
    else:
        _protocol_receive(cupy, np, pool, transport, sizes)
        rows += _memcpy_peer(cupy, sizes, bb)
    results.put(("rows", rank, rows))
    transport.close()


def _protocol_times(cupy, np, pool, transport, sizes):
    """Sender side of the full protocol (offer, accept, data, completion): host wall time."""
    import kvpool
    from kvpool.transfer import KvSender

    tables = kvpool.BlockTables(pool, 4, max(sizes))
    sender = KvSender(tables, transport)
    rows = []
    for n in [s for s in sizes if s <= 64]:
        times = []
        for rep in range(12):
            tables.add(rep, n * 16)
            transport.recv_control(120)
            t0 = time.perf_counter()
            sender.send(rep).wait(timeout=120)
            times.append((time.perf_counter() - t0) * 1e6)
        rows.append(
            {
                "num_blocks": n,
                "mode": "protocol_auto",
                "median_us": round(statistics.median(times[2:]), 2),
                "times_us": [round(t, 2) for t in times[2:]],
            }
        )
    return rows


def _protocol_receive(cupy, np, pool, transport, sizes):
    import kvpool
    from kvpool.transfer import KvReceiver

    tables = kvpool.BlockTables(pool, 4, max(sizes))
    receiver = KvReceiver(tables, transport)
    for _n in [s for s in sizes if s <= 64]:
        for _ in range(12):
            transport.send_control({"go": True})
            t = receiver.recv(timeout=120)
            t.wait(timeout=120)
            tables.free(t.request_id)


def _memcpy_peer(cupy, sizes, bb):
    """cudaMemcpyPeerAsync of the same sizes, device 0 -> device 1, in this process."""
    rt = cupy.cuda.runtime
    nbytes = max(sizes) * bb
    with cupy.cuda.Device(0):
        src = cupy.ones(nbytes, cupy.uint8)
    with cupy.cuda.Device(1):
        dst = cupy.zeros(nbytes, cupy.uint8)
        try:
            rt.deviceEnablePeerAccess(0)
        except rt.CUDARuntimeError:
            pass  # already enabled
        stream = cupy.cuda.Stream(non_blocking=True)
        rows = []
        for n in sizes:
            times = []
            for rep in range(_reps(n) + 2):
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                rt.memcpyPeerAsync(dst.data.ptr, 1, src.data.ptr, 0, n * bb, stream.ptr)
                end.record(stream)
                end.synchronize()
                if rep >= 2:
                    times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
            us = statistics.median(times)
            rows.append(
                {
                    "num_blocks": n,
                    "bytes": n * bb,
                    "mode": "memcpy_peer",
                    "median_us": round(us, 2),
                    "gb_per_s": round(n * bb / us / 1e3, 2),
                    "times_us": [round(t, 2) for t in times],
                }
            )
    return rows


def _summary(rows):
    """Per size: the best kvpool variant against the contiguous NCCL send, as ratios."""
    out = []
    for n in sorted({r["num_blocks"] for r in rows if "gb_per_s" in r}):
        at = [r for r in rows if r["num_blocks"] == n and "gb_per_s" in r]
        ours = [r for r in at if r["mode"] in ("staged", "grouped")]
        base = next(r for r in at if r["mode"] == "nccl_contiguous")
        peer = next((r for r in at if r["mode"] == "memcpy_peer"), None)
        best = min(ours, key=lambda r: r["median_us"])
        staged = min((r for r in ours if r["mode"] == "staged"), key=lambda r: r["median_us"])
        grouped = next(r for r in ours if r["mode"] == "grouped")
        out.append(
            {
                "num_blocks": n,
                "best": f"{best['mode']}/{best['chunk_mib']}",
                "best_us": best["median_us"],
                "best_gb_per_s": best["gb_per_s"],
                "nccl_contiguous_us": base["median_us"],
                "nccl_contiguous_gb_per_s": base["gb_per_s"],
                "memcpy_peer_gb_per_s": peer and peer["gb_per_s"],
                "best_over_contiguous_bandwidth": round(best["gb_per_s"] / base["gb_per_s"], 3),
                "staged_over_contiguous_bandwidth": round(staged["gb_per_s"] / base["gb_per_s"], 3),
                "grouped_over_contiguous_bandwidth": round(
                    grouped["gb_per_s"] / base["gb_per_s"], 3
                ),
                "best_latency_over_contiguous": round(best["median_us"] / base["median_us"], 3),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="sizes 1, 64, 1024 only")
    args = parser.parse_args(argv)
    os.environ.update(MULTICAST_OFF)
    from provenance import provenance

    sizes = [1, 64, 1024] if args.quick else SIZES
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous.json")
        procs = [ctx.Process(target=worker, args=(r, rendezvous, sizes, results)) for r in (0, 1)]
        for p in procs:
            p.start()
        rows, samples, errors = {}, {}, []
        while len(rows) < 2 and not errors:
            msg = results.get(timeout=600)
            if msg[0] == "rows":
                rows[msg[1]] = msg[2]
            elif msg[0] == "sample":
                samples.setdefault(msg[2:5], {})[msg[1]] = msg[5]
            else:
                errors.append(msg)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if errors:
        print("\n".join(str(e[2]) for e in errors), file=sys.stderr)
        return 1
    mismatched = [k for k, v in samples.items() if v.get(0) != v.get(1)]
    import cupy

    doc = {
        "benchmark": "transfer",
        "provenance": provenance("bench/routines/transfer.py"),
        "gpus": [cupy.cuda.runtime.getDeviceProperties(d)["name"].decode() for d in (0, 1)],
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "layout": dict(
            zip(["num_layers", "num_kv_heads", "head_dim", "block_size", "dtype"], LAYOUT)
        ),
        "block_bytes": 2 << 20,
        "byte_exact_samples": not mismatched,
        "mismatched_samples": [list(map(str, k)) for k in mismatched],
        "summary": _summary(rows[1]),
        "rows": rows[1],
        "protocol": rows[0],
        "env": {k: os.environ.get(k) for k in MULTICAST_OFF},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    for s in doc["summary"]:
        print(json.dumps(s))
    print("byte-exact samples:", doc["byte_exact_samples"])
    return 0 if not mismatched else 1
