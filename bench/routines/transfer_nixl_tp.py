"""A TP-2 prefill gathered into a TP-1 decode pool through NIXL, CUDA pools on one GPU: each
leg through the receiver's staging buffer (the shard's blocks whole in one READ, then its rows
scattered into the wider blocks) against the same gather cut into rows (a descriptor per block,
layer, K|V and token: what ``kv_descriptors`` posts without a buffer), in the same run.

The two prefill ranks are threads of a spawned process (each its own pool of half the KV heads,
tables and transports; CUDA IPC needs the other process), the decode pool and its
``KvGatherReceiver`` here. A model-like layout: 32 layers, 8 KV heads (4 a rank), head_dim
128, fp16, 16 tokens a block (2 MiB a TP-1 block, 1 MiB a shard's). One case: the ranks send a
request of n blocks written beforehand (``KvSender.send(..., free_after=False)``), the
receiver takes it and waits for it (``recv`` to ``wait``), then frees it; timed from the
receiver's request (a pipe message) to the transfer's end here, the control messages included
for both cases alike. The first
gather of each case is checked byte-exact against the model's KV; then the median of the
repetitions, the staged and the rows cases interleaved. ``--rows-max`` bounds the rows case
(its descriptors grow as n x 1024). Usage:

    python bench/kvbench.py --routine transfer_nixl_tp --out DIR [--blocks 4 16 64 256]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path

from provenance import provenance

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
RID = 7
MODES = ("staged", "rows")


def _layout():
    import kvpool

    return kvpool.KvLayout(LAYERS, HEADS, HEAD_DIM, BLOCK)


def _fill_shard(pool, ids, rank: int) -> None:
    """The rank's heads of the model's KV: every element a function of (block, layer, K|V,
    token, head, dim), so the receiver can rebuild what it must hold."""
    import cupy

    heads = _layout().tp_head_range(2, rank)
    with cupy.cuda.Device(0):
        for layer in range(LAYERS):
            for kv, view in enumerate((pool.k_view(layer), pool.v_view(layer))):
                view = cupy.asarray(view)
                view[cupy.asarray(ids)] = _expected(len(ids), layer, kv, heads)
        cupy.cuda.runtime.deviceSynchronize()


def _expected(n: int, layer: int, kv: int, heads: tuple[int, int]):
    import cupy

    b = cupy.arange(n, dtype=cupy.float32)[:, None, None, None]
    t = cupy.arange(BLOCK, dtype=cupy.float32)[None, :, None, None]
    h = cupy.arange(*heads, dtype=cupy.float32)[None, None, :, None]
    d = cupy.arange(HEAD_DIM, dtype=cupy.float32)[None, None, None, :]
    return cupy.sin(b * 0.37 + t * 1.3 + h * 2.1 + d * 0.05 + layer * 0.7 + kv * 5.0).astype(
        cupy.float16
    )


def _prefill(conn, rendezvous: list[list[str]], max_blocks: int) -> None:
    """The two prefill ranks (threads), one leg per (mode, rank): on ``("fill", n)`` both
    ranks write an n-block request (kept: sent with ``free_after=False``), on ``("send",
    mode)`` each sends it over that mode's leg, then answers."""
    import kvpool
    from kvpool.transfer import KvSender
    from kvpool.transfer.nixl_transport import NixlTransport

    shard = _layout().tp_shard(2)
    ranks = []
    for rank in range(2):
        pool = kvpool.Pool(shard, max_blocks + 4, device="cuda")
        tables = kvpool.BlockTables(pool, 4, max_blocks + 4)
        tables.add(99, BLOCK * (rank + 1))  # the ranks' ids differ from each other's
        ranks.append((pool, tables))
    senders: dict = {}

    def connect(mode: str, rank: int) -> None:
        pool, tables = ranks[rank]
        transport = NixlTransport.connect(0, rendezvous[MODES.index(mode)][rank], pool)
        senders[mode, rank] = (transport, KvSender(tables, transport, timeout_s=600, tp=(rank, 2)))

    threads = [threading.Thread(target=connect, args=(m, r)) for m in MODES for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    conn.send("connected")
    while (message := conn.recv()) != "stop":
        if message[0] == "fill":  # a case's request, written before any send is timed
            for rank, (pool, tables) in enumerate(ranks):
                if RID in tables:
                    tables.free(RID)
                tables.add(RID, message[1] * BLOCK)
                _fill_shard(pool, tables.blocks(RID), rank)
            conn.send("filled")
            continue
        mode = message[1]
        errors: list = []

        def send(rank: int) -> None:
            try:
                senders[mode, rank][1].send(RID, free_after=False).wait()
            except Exception as e:  # reported to the bench, which fails naming it
                errors.append(f"rank {rank}: {type(e).__name__}: {e}")

        workers = [threading.Thread(target=send, args=(r,)) for r in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        conn.send(errors or "sent")
    for transport, _ in senders.values():
        transport.close()
    conn.send("stopped")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--blocks", type=int, nargs="+", default=[4, 16, 64, 256])
    ap.add_argument("--rows-max", type=int, default=64, help="the rows case up to this many")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)

    import cupy
    import kvpool
    from kvpool.transfer.nixl_transport import NixlTransport
    from kvpool.transfer.tp_legs import KvGatherReceiver

    prov = provenance("bench/routines/transfer_nixl_tp.py")
    max_blocks = max(args.blocks)
    folder = Path(tempfile.mkdtemp(prefix="kvpool-tp-bench-"))
    rendezvous = [[str(folder / f"{mode}{rank}.json") for rank in range(2)] for mode in MODES]
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_prefill, args=(child_conn, rendezvous, max_blocks), daemon=True)
    child.start()
    pool = kvpool.Pool(_layout(), max_blocks + 4, device="cuda")
    tables = kvpool.BlockTables(pool, 4, max_blocks + 4)
    legs: dict = {}

    def connect(mode: str, rank: int) -> None:
        staging = None if mode == "staged" else 0  # the default buffer, or none
        legs[mode, rank] = NixlTransport.connect(
            1, rendezvous[MODES.index(mode)][rank], pool, staging_bytes=staging
        )

    threads = [threading.Thread(target=connect, args=(m, r)) for m in MODES for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert conn.recv() == "connected"
    receivers = {
        mode: KvGatherReceiver(tables, [legs[mode, 0], legs[mode, 1]], timeout_s=600)
        for mode in MODES
    }
    rows_out: list[dict] = []
    result = {
        "routine": "transfer_nixl_tp",
        "provenance": prov,
        "what": "TP-2 to TP-1 gather of a request over NIXL, staged against cut into rows",
        "layout": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
        "rows": rows_out,
    }

    def gather(mode: str) -> tuple[float, list]:
        t0 = time.perf_counter()
        conn.send(("send", mode))
        transfer = receivers[mode].recv(timeout=600)
        transfer.wait()
        elapsed = time.perf_counter() - t0
        answer = conn.recv()
        assert answer == "sent", answer
        reads = [read.reads for read in transfer._completion.legs]
        return elapsed, reads

    def check(n: int) -> None:
        ids = cupy.asarray(tables.blocks(RID))
        with cupy.cuda.Device(0):
            for layer in (0, LAYERS // 2, LAYERS - 1):
                for kv, view in enumerate((pool.k_view(layer), pool.v_view(layer))):
                    got = cupy.asarray(view)[ids]
                    assert bool(cupy.array_equal(got, _expected(n, layer, kv, (0, HEADS))))

    for n in args.blocks:
        conn.send(("fill", n))
        assert conn.recv() == "filled"
        modes = [m for m in MODES if m == "staged" or n <= args.rows_max]
        times: dict = {m: [] for m in modes}
        reads: dict = {}
        for mode in modes:  # warm-up, checked
            _, reads[mode] = gather(mode)
            check(n)
            tables.free(RID)
        for _ in range(args.reps):
            for mode in modes:
                elapsed, _ = gather(mode)
                times[mode].append(elapsed)
                tables.free(RID)
        nbytes = n * _layout().block_bytes
        for mode in modes:
            med = statistics.median(times[mode])
            row = {
                "case": mode,
                "blocks": n,
                "bytes": nbytes,
                "descriptors_per_leg": reads[mode][0][0][2],
                "reps": len(times[mode]),
                "median_us": med * 1e6,
                "gbytes_per_s": nbytes / med / 1e9,
            }
            if "rows" in times and mode == "staged":
                row["speedup_over_rows"] = statistics.median(times["rows"]) / med
            rows_out.append(row)
            print(
                f"{mode:<6} {n:>5} blocks  {row['descriptors_per_leg']:>7} desc/leg  "
                f"{row['median_us']:>10.0f} us  {row['gbytes_per_s']:>7.2f} GB/s",
                flush=True,
            )
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    conn.send("stop")
    assert conn.recv() == "stopped"
    for transport in legs.values():
        transport.close()
    child.join(timeout=60)
    return 0
