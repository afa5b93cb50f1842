"""Process bodies of the two-GPU transfer tests (one process per GPU, started with spawn).

Each worker reports through a multiprocessing queue: SHA-256 digests of every block it sent
or received (the parent compares them), and the receiver's decode check against the float64
reference. NVLink multicast is turned off in every process before CUDA or NCCL start.
"""

from __future__ import annotations

import hashlib
import os
import traceback

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
LAYOUT = (4, 8, 128, 16, "float16")  # 256 KiB blocks
NUM_BLOCKS = 2600
HQ = 32


def _setup(device: int):
    os.environ.update(MULTICAST_OFF)
    import cupy

    cupy.cuda.Device(device).use()
    import kvpool

    pool = kvpool.Pool(kvpool.KvLayout(*LAYOUT), NUM_BLOCKS, device=f"cuda:{device}")
    tables = kvpool.BlockTables(pool, 64, 2048)
    return cupy, kvpool, pool, tables


def _slab(cupy, pool, dtype):
    nbytes = pool.num_blocks * pool.block_bytes
    mem = cupy.cuda.UnownedMemory(pool.base_ptr, nbytes, pool)
    width = pool.block_bytes // cupy.dtype(dtype).itemsize
    return cupy.ndarray((pool.num_blocks, width), dtype, cupy.cuda.MemoryPointer(mem, 0))


def _digests(cupy, pool, ids) -> list[str]:
    rows = cupy.asnumpy(_slab(cupy, pool, cupy.uint8)[cupy.asarray(ids)])
    return [hashlib.sha256(row.tobytes()).hexdigest() for row in rows]


def _scatter_free_list(tables, seed: int) -> None:
    """Leave the free list in a shuffled order, so a request's blocks are not one run."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for rid in range(10_000, 10_000 + 60):
        tables.add(rid, 16 * int(rng.integers(1, 30)))
    for rid in rng.permutation(np.arange(10_000, 10_000 + 60)):
        tables.free(int(rid))


def sender(rendezvous: str, sizes: list[int], modes: list[str], results) -> None:
    try:
        cupy, kvpool, pool, tables = _setup(0)
        from kvpool.transfer import KvSender, NcclTransport

        transport = NcclTransport.connect(0, rendezvous, 0)
        cupy.random.seed(1)
        _slab(cupy, pool, cupy.float16)[...] = cupy.random.standard_normal(
            (pool.num_blocks, pool.block_bytes // 2), dtype=cupy.float32
        ).astype(cupy.float16)
        cupy.cuda.Device(0).synchronize()  # the fill ran on the legacy stream
        _scatter_free_list(tables, 2)
        rid = 0
        for mode in modes:
            snd = KvSender(tables, transport, mode=mode, chunk_bytes=16 * pool.block_bytes)
            for n in sizes:
                rid += 1
                tables.add(rid, 16 * n - rid % 16)
                digests = _digests(cupy, pool, tables.blocks(rid))
                snd.send(rid).wait(timeout=120)
                results.put(("sent", mode, rid, digests, rid in tables))
        tables.check_invariants()
        results.put(("sender_done", pool.num_used))
        transport.close()
    except Exception:
        results.put(("error", "sender", traceback.format_exc()))


def receiver(rendezvous: str, count: int, results) -> None:
    try:
        cupy, kvpool, pool, tables = _setup(1)
        import numpy as np
        from attention_check import assert_attention_close
        from kvpool import reference
        from kvpool.transfer import KvReceiver, NcclTransport

        transport = NcclTransport.connect(1, rendezvous, 1)
        _scatter_free_list(tables, 3)
        rcv = KvReceiver(tables, transport)
        rng = np.random.default_rng(4)
        for _ in range(count):
            t = rcv.recv(timeout=120)
            t.wait(timeout=120)
            rid = t.request_id
            digests = _digests(cupy, pool, tables.blocks(rid))
            decode_error = _decode_check(
                cupy, kvpool, reference, pool, tables, rid, rng, assert_attention_close
            )
            results.put(("received", rid, digests, decode_error))
            tables.free(rid)
        tables.check_invariants()
        pool.check_invariants(exact_refs=True)
        results.put(("receiver_done", pool.num_used))
        transport.close()
    except Exception:
        results.put(("error", "receiver", traceback.format_exc()))


def _decode_check(cupy, kvpool, reference, pool, tables, rid, rng, assert_close) -> str | None:
    """Decode of the received request (one query token, last layer) on the pool's stream,
    against the float64 reference over the same blocks; None when within bounds."""
    layer = pool.layout.num_layers - 1
    q = rng.standard_normal((1, HQ, pool.layout.head_dim)).astype("float16")
    row = tables.blocks(rid)[None, :]
    lens = tables.seq_lens([rid])
    stream = cupy.cuda.Stream.from_external(pool.stream)
    with stream:
        out = kvpool.paged_attention_decode(
            cupy.asarray(q), pool, layer, cupy.asarray(row), cupy.asarray(lens), stream=pool.stream
        )
        stream.synchronize()
    k = cupy.asnumpy(cupy.asarray(pool.k_view(layer)))
    v = cupy.asnumpy(cupy.asarray(pool.v_view(layer)))
    want = reference.paged_attention_decode(q, k, v, row, lens, "float16", None)
    try:
        assert_close(out, want, "float16", f"request {rid}")
    except AssertionError as e:
        return str(e)
    return None


def dying_sender(rendezvous: str, results) -> None:
    """Offers a 64-block request, sends its first chunk, and exits mid-transfer."""
    try:
        cupy, kvpool, pool, tables = _setup(0)
        from kvpool.transfer import KvSender, NcclTransport

        class DiesOnSecondSend(NcclTransport):
            sends = 0

            def send(self, ptr, nbytes, stream):
                if self.sends == 1:
                    cupy.cuda.Device(0).synchronize()
                    os._exit(3)
                self.sends += 1
                super().send(ptr, nbytes, stream)

        transport = DiesOnSecondSend.connect(0, rendezvous, 0)
        tables.add(1, 64 * 16)
        KvSender(tables, transport, mode="staged", chunk_bytes=4 * pool.block_bytes).send(1)
        results.put(("error", "dying_sender", "the sender did not exit"))
    except Exception:
        results.put(("error", "dying_sender", traceback.format_exc()))


def surviving_receiver(rendezvous: str, results) -> None:
    try:
        cupy, kvpool, pool, tables = _setup(1)
        from kvpool.transfer import KvReceiver, NcclTransport, TransferError

        transport = NcclTransport.connect(1, rendezvous, 1)
        tables.add(500, 40)  # a request that must survive untouched
        before = pool.num_used
        t = KvReceiver(tables, transport).recv(timeout=120)
        try:
            t.wait(timeout=120)
            results.put(("error", "receiver", "the interrupted transfer completed"))
            return
        except TransferError as e:
            message = str(e)
        tables.check_invariants()
        pool.check_invariants(exact_refs=True)
        consistent = (
            1 not in tables and 500 in tables and pool.num_used == before and t.state == "failed"
        )
        # The pool is still usable: a new request, a block copy, a device sync.
        tables.add(2, 100)
        kvpool.copy_blocks(
            pool, [[int(tables.blocks(500)[0]), int(tables.blocks(2)[0])]], stream=pool.stream
        )
        cupy.cuda.Device(1).synchronize()
        results.put(("interrupted", message, consistent, pool.num_used))
    except Exception:
        results.put(("error", "receiver", traceback.format_exc()))
