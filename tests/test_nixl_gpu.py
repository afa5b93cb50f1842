"""CUDA pools over NIXL on one GPU: each pool's slab registered as VRAM, the receiver READing the
sender's blocks device to device through whichever transport UCX picks: with the sender in
another process, UCX's cuda_ipc (the transport asks UCX for its GET: transfer.md, "CUDA pools
over NIXL"); in a thread of this process, UCX's GET emulated over tcp/lo (cuda_ipc cannot reach
its own process).

Each test runs twice: ``processes`` (the sender in another process) and ``threads`` (the sender
in a thread of this process with its own pool, agent and transport: two NIXL agents in one
process). Both move bytes through the same protocol and leases.

- a request's blocks (scattered across the sender's holes, and one run) byte-exact into other
  ids on the receiver, both pools conserved, no lease left: through the transports' default
  staging buffers (request 7 scattered on both sides, packed by the sender and unpacked by the
  receiver: one descriptor) and without them (one descriptor per run);
- a TP-2 prefill (two pools of 4 of the 8 KV heads) gathered into a TP-1 decode pool
  (``KvGatherReceiver``; each leg through its staging buffer, one descriptor, or by rows, one
  per (block, layer, K|V, token)), then kvpool's decode kernel on the receiver equal, bit for bit, to
  the two prefill ranks' decode of their heads side by side (one split, as the TP decode test
  of tests/test_multigpu_gpu.py), and a TP-1 prefill split into a TP-2 decode group
  (``KvSplitSender``), each rank's decode equal to the source's for its heads;
- a request offered before its layers are computed, each layer written on the GPU and
  announced in turn, landing byte-exact.

Skipped without a GPU or CuPy (conftest.py's ``gpu`` marker) or without NIXL. This file run as a
script is the sender's process.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import kvpool
import numpy as np
import pytest
from kvpool.transfer import KvReceiver, KvSender
from nixl_peers import (
    PEER_WAIT_S,
    STAGE_ALWAYS,
    NixlTransport,
    Peer,
    conserved,
    run_ranks,
    spawn,
)

pytestmark = pytest.mark.gpu

LAYOUT = kvpool.KvLayout(2, 8, 128, 16)  # fp16: 128 KiB blocks
NUM_BLOCKS = 96
REQUESTS = {7: 16 * 20 + 5, 8: 16 * 16}  # 21 blocks in the sender's holes, 16 in one run
TP_RID, TP_TOKENS, HQ = 3, 16 * 24 + 9, 32  # 25 blocks; 32 query heads over 8 KV heads
LAYERED_RID, LAYERED_TOKENS = 7, 16 * 9 + 3  # 10 blocks, announced layer by layer
FINISH_S = 180.0  # the sender's end, which may include compiling the decode kernel


def kv_of(rid: int, num_blocks: int) -> list[np.ndarray]:
    """Per (layer, K|V) the request's KV, all heads, made from ``rid``."""
    rng = np.random.default_rng(rid)
    shape = (num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [rng.standard_normal(shape).astype(np.float16) for _ in range(2 * LAYOUT.num_layers)]


def views(pool: kvpool.Pool) -> list:
    import cupy

    return [
        cupy.asarray(v)
        for layer in range(pool.layout.num_layers)
        for v in (pool.k_view(layer), pool.v_view(layer))
    ]


def write(pool: kvpool.Pool, ids: np.ndarray, kv: list[np.ndarray], heads: tuple) -> None:
    import cupy

    with cupy.cuda.Device(0):
        for view, full in zip(views(pool), kv):
            view[cupy.asarray(ids)] = cupy.asarray(full[:, :, heads[0] : heads[1]])
        cupy.cuda.runtime.deviceSynchronize()


def read(pool: kvpool.Pool, ids: np.ndarray) -> list[np.ndarray]:
    import cupy

    return [cupy.asnumpy(view[cupy.asarray(ids)]) for view in views(pool)]


def query() -> np.ndarray:
    return np.random.default_rng(99).standard_normal((1, HQ, LAYOUT.head_dim)).astype(np.float16)


_DECODE_LOCK = threading.Lock()  # one decode (and its first compile) at a time per process


def decode(pool: kvpool.Pool, tables: kvpool.BlockTables, q: np.ndarray) -> list[np.ndarray]:
    """Per layer kvpool's decode of request ``TP_RID`` alone (one split)."""
    import cupy

    out = []
    with _DECODE_LOCK, cupy.cuda.Device(0):
        bt = cupy.asarray(tables.block_table([TP_RID]))
        sl = cupy.asarray(tables.seq_lens([TP_RID]))
        for layer in range(pool.layout.num_layers):
            o = kvpool.paged_attention_decode(cupy.asarray(q), pool, layer, bt, sl, num_splits=1)
            cupy.cuda.runtime.deviceSynchronize()
            out.append(cupy.asnumpy(o))
    return out


# -- the sending side (another process, or a thread of the test's) -----------------------------


def send_requests(rendezvous: str, staging_bytes: int | None = None) -> dict:
    """A CUDA pool with holes sends requests 7 (scattered) and 8 (one run), through the
    transport's default staging buffer or (``staging_bytes=0``) run by run."""
    pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="cuda")
    tables = kvpool.BlockTables(pool, 32, 64)
    for rid in range(100, 110):  # holes, so request 7's ids form several runs
        tables.add(rid, 16 * 2)
    for rid in range(100, 110, 2):
        tables.free(rid)
    for rid, num_tokens in REQUESTS.items():
        tables.add(rid, num_tokens)
        write(pool, tables.blocks(rid), kv_of(rid, len(tables.blocks(rid))), (0, 8))
    free_before = pool.num_free
    transport = NixlTransport.connect(
        0, rendezvous, pool, timeout=PEER_WAIT_S, staging_bytes=staging_bytes
    )
    transport.staging_cost = STAGE_ALWAYS
    sender = KvSender(tables, transport, timeout_s=PEER_WAIT_S)
    for rid in REQUESTS:
        sender.send(rid).wait()
    conserved(sender, pool, free_before + 21 + 16)
    assert all(rid not in tables for rid in REQUESTS)
    transport.close()
    return {"sent": True}


def prefill_rank(rank: int, rendezvous: str, report: dict) -> None:
    """One rank of a TP-2 prefill: 4 of the 8 KV heads; decodes its heads, then sends them."""
    try:
        pool = kvpool.Pool(LAYOUT.tp_shard(2), NUM_BLOCKS, device="cuda")
        tables = kvpool.BlockTables(pool, 8, 64)
        tables.add(
            99, 16 * (rank + 1)
        )  # the ranks' ids differ from each other's and the receiver's
        tables.add(TP_RID, TP_TOKENS)
        heads = LAYOUT.tp_head_range(2, rank)
        write(pool, tables.blocks(TP_RID), kv_of(TP_RID, len(tables.blocks(TP_RID))), heads)
        free_before = pool.num_free
        transport = NixlTransport.connect(0, rendezvous, pool, timeout=PEER_WAIT_S)
        sender = KvSender(tables, transport, timeout_s=PEER_WAIT_S, tp=(rank, 2))
        sender.send(TP_RID, free_after=False).wait()  # kept for the decode below
        conserved(sender, pool, free_before)
        transport.close()
        report["sent"] = True
        # Decoded after the transfer (its first call compiles): the receiver's waits stay short.
        q = query()[:, HQ // 2 * rank : HQ // 2 * (rank + 1)]
        report["decode"] = [o.tolist() for o in decode(pool, tables, q)]
        tables.free(TP_RID)
        conserved(sender, pool, free_before + 25)
    except Exception as e:  # reported to the test, which fails naming it
        report["error"] = f"{type(e).__name__}: {e}"


def tp2_prefill(rendezvous: list[str]) -> dict:
    return run_ranks(prefill_rank, rendezvous)


def tp1_prefill(rendezvous: list[str]) -> dict:
    """A TP-1 prefill (all 8 KV heads) split into a TP-2 decode group (``KvSplitSender``, a
    leg per rank); decodes the request after the transfer, every query head."""
    from kvpool.transfer.tp_legs import KvSplitSender

    pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="cuda")
    tables = kvpool.BlockTables(pool, 8, 64)
    tables.add(99, 16 * 3)  # the sender's ids differ from the receivers'
    tables.add(TP_RID, TP_TOKENS)
    write(pool, tables.blocks(TP_RID), kv_of(TP_RID, len(tables.blocks(TP_RID))), (0, 8))
    free_before = pool.num_free
    transports = [NixlTransport.connect(0, r, pool, timeout=PEER_WAIT_S) for r in rendezvous]
    sender = KvSplitSender(tables, transports, timeout_s=PEER_WAIT_S)
    sender.send(TP_RID, free_after=False).wait()  # kept for the decode below
    conserved(sender, pool, free_before)
    for transport in transports:
        transport.close()
    out = {"sent": True, "decode": [o.tolist() for o in decode(pool, tables, query())]}
    tables.free(TP_RID)
    conserved(sender, pool, free_before + 25)
    return out


def layer_kv(rid: int, num_blocks: int, layer: int) -> list[np.ndarray]:
    """Layer ``layer``'s K and V of request ``rid``, all heads (``kv_of``'s entries of it)."""
    return kv_of(rid, num_blocks)[2 * layer : 2 * layer + 2]


def send_layers(rendezvous: str) -> dict:
    """Request 7 offered before any layer is computed, then each layer written on the GPU and
    announced in turn (``layers_ready``), as a prefill computing layer by layer would."""
    import cupy

    pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="cuda")
    tables = kvpool.BlockTables(pool, 8, 64)
    tables.add(99, 16 * 4)  # holes on the sender's side: its ids differ from the receiver's
    tables.add(LAYERED_RID, LAYERED_TOKENS)
    ids = tables.blocks(LAYERED_RID)
    free_before = pool.num_free
    transport = NixlTransport.connect(0, rendezvous, pool, timeout=PEER_WAIT_S)
    sender = KvSender(tables, transport, timeout_s=PEER_WAIT_S)
    transfer = sender.send(LAYERED_RID, layers_ready=0)
    pool_views = views(pool)
    for layer in range(LAYOUT.num_layers):
        with cupy.cuda.Device(0):
            for view, full in zip(
                pool_views[2 * layer : 2 * layer + 2], layer_kv(LAYERED_RID, len(ids), layer)
            ):
                view[cupy.asarray(ids)] = cupy.asarray(full)
            cupy.cuda.runtime.deviceSynchronize()  # written before it is announced
        transfer.layers_ready(layer + 1)
    transfer.wait()
    conserved(sender, pool, free_before + len(ids))
    transport.close()
    return {"sent": True}


ROLES = {
    "requests": lambda r: send_requests(r[0]),
    "requests_unstaged": lambda r: send_requests(r[0], staging_bytes=0),
    "tp2": tp2_prefill,
    "tp1": tp1_prefill,
    "layers": lambda r: send_layers(r[0]),
}

if __name__ == "__main__":
    print("RESULT " + json.dumps(ROLES[sys.argv[1]](sys.argv[2:])), flush=True)
    sys.exit(0)


# -- the receiving side (the tests) -------------------------------------------------------------


class ThreadPeer(Peer):
    """The sending role in a thread of this process (its own pool, agent and transport)."""

    def __init__(self, role: str, rendezvous: list[Path]) -> None:
        super().__init__(None, rendezvous)
        self.result: dict | None = None
        self.thread = threading.Thread(target=self._run, args=(role, list(map(str, rendezvous))))
        self.thread.start()

    def _run(self, role: str, args: list[str]) -> None:
        try:
            self.result = ROLES[role](args)
        except Exception as e:
            self.result = {"error": f"{type(e).__name__}: {e}"}

    def finish(self, timeout: float = PEER_WAIT_S) -> dict:
        self.thread.join(timeout)
        assert not self.thread.is_alive() and self.result is not None
        return self.result


@contextmanager
def sender(how: str, role: str, tmp_path: Path, legs: int = 1) -> Iterator[Peer]:
    """The sending role run in another process (tests/nixl_peers.py's ``spawn``) or in a
    thread of this one; on leaving, this side's transports (``connect``) are closed."""
    if how == "processes":
        with spawn(__file__, role, tmp_path=tmp_path, legs=legs) as other:
            yield other
        return
    other = ThreadPeer(role, [tmp_path / f"rendezvous{leg}.json" for leg in range(legs)])
    try:
        yield other
    finally:
        other.thread.join(FINISH_S)
        for transport in other.transports:
            transport.close()


HOW = ["processes", "threads"]


@pytest.mark.parametrize("staging", ["staged", "unstaged"])
@pytest.mark.parametrize("how", HOW)
def test_a_requests_blocks_move_device_to_device_byte_exact(tmp_path, how, staging):
    role = "requests" if staging == "staged" else "requests_unstaged"
    with sender(how, role, tmp_path) as other:
        pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="cuda")
        tables = kvpool.BlockTables(pool, 32, 64)
        tables.add(1, 16 * 5)  # the receiver's ids differ from the sender's
        if staging == "staged":  # holes here too: request 7 lands scattered, unpacked
            for rid in range(100, 108):
                tables.add(rid, 16 * 2)
            for rid in range(100, 108, 2):
                tables.free(rid)
        staging_bytes = None if staging == "staged" else 0
        transport = other.connect(pool, staging_bytes=staging_bytes)
        transport.staging_cost = STAGE_ALWAYS
        assert (transport.mem_type, transport.remote_mem_type) == ("VRAM", "VRAM")
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S)
        free = pool.num_free
        for rid, num_tokens in REQUESTS.items():
            receiver.recv(timeout=PEER_WAIT_S).wait()
            ids = tables.blocks(rid)
            free -= len(ids)
            conserved(receiver, pool, free)
            assert tables.num_tokens(rid) == num_tokens
            for got, want in zip(read(pool, ids), kv_of(rid, len(ids))):
                np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        seen = other.finish(FINISH_S)
    assert seen == {"sent": True}, seen
    counts = transport.descriptor_counts
    if staging == "staged":
        # Request 7, scattered on both sides, packed by the sender and unpacked here: one
        # descriptor; request 8, one run each side, one too.
        assert counts == [1, 1], counts
        assert transport.staging is not None and transport.staging.holder is None
    else:
        # Request 7 in the sender's holes took several descriptors, request 8 (one run) 1.
        assert counts[0] > 1 and counts[1] == 1, counts
    print(how, staging, "descriptors per request:", counts)


@pytest.mark.parametrize("staging", ["staged", "rows"])
@pytest.mark.parametrize("how", HOW)
def test_a_tp2_prefill_gathered_into_tp1_decodes_as_on_the_source(tmp_path, how, staging):
    from kvpool.transfer.tp_legs import KvGatherReceiver

    with sender(how, "tp2", tmp_path, legs=2) as other:
        pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="cuda")
        tables = kvpool.BlockTables(pool, 8, 64)
        free_before = pool.num_free
        # Staged by the default costs (1,600 rows a leg against one run of blocks); "rows":
        # no buffer, a descriptor per (block, layer, K|V, token).
        options = {} if staging == "staged" else {"staging_bytes": 0}
        legs = [other.connect(pool, leg=leg, **options) for leg in range(2)]
        receiver = KvGatherReceiver(tables, legs, timeout_s=PEER_WAIT_S)
        transfer = receiver.recv(timeout=PEER_WAIT_S)
        transfer.wait()
        reads = [read.reads for read in transfer._completion.legs]
        rows = 25 * LAYOUT.num_layers * 2 * LAYOUT.block_size
        assert reads == [[(0, 2, 1 if staging == "staged" else rows)]] * 2, reads
        conserved(receiver, pool, free_before - 25)
        ids = tables.blocks(TP_RID)
        for got, want in zip(read(pool, ids), kv_of(TP_RID, len(ids))):
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        got_decode = decode(pool, tables, query())
        seen = other.finish(FINISH_S)
    ranks = seen["ranks"]
    assert [r.get("sent") for r in ranks] == [True, True], [r.get("error") for r in ranks]
    for layer in range(LAYOUT.num_layers):
        want = np.concatenate([np.asarray(r["decode"][layer], np.float16) for r in ranks], axis=1)
        np.testing.assert_array_equal(got_decode[layer], want)
        assert np.isfinite(want).all() and np.abs(want).max() > 0


@pytest.mark.parametrize("how", HOW)
def test_a_tp1_prefill_split_into_tp2_decodes_as_on_the_source(tmp_path, how):
    from kvpool.transfer import wait_all

    with sender(how, "tp1", tmp_path, legs=2) as other:
        ranks = []
        for rank in range(2):
            pool = kvpool.Pool(LAYOUT.tp_shard(2), NUM_BLOCKS, device="cuda")
            tables = kvpool.BlockTables(pool, 8, 64)
            tables.add(98, 16 * (rank + 1))  # each rank's ids differ from the sender's
            transport = other.connect(pool, leg=rank)
            receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S, tp=(rank, 2))
            ranks.append((pool, tables, receiver, pool.num_free))
        wait_all([receiver.recv(timeout=PEER_WAIT_S) for _, _, receiver, _ in ranks])
        got_decode = []
        for rank, (pool, tables, receiver, free_before) in enumerate(ranks):
            conserved(receiver, pool, free_before - 25)
            ids = tables.blocks(TP_RID)
            lo, hi = LAYOUT.tp_head_range(2, rank)
            for got, want in zip(read(pool, ids), kv_of(TP_RID, len(ids))):
                np.testing.assert_array_equal(
                    got.view(np.uint16), want[:, :, lo:hi].view(np.uint16)
                )
            got_decode.append(
                decode(pool, tables, query()[:, HQ // 2 * rank : HQ // 2 * (rank + 1)])
            )
        seen = other.finish(FINISH_S)
    assert seen.get("sent"), seen
    for layer in range(LAYOUT.num_layers):
        want = np.asarray(seen["decode"][layer], np.float16)
        got = np.concatenate([got_decode[rank][layer] for rank in range(2)], axis=1)
        np.testing.assert_array_equal(got, want)
        assert np.isfinite(want).all() and np.abs(want).max() > 0


@pytest.mark.parametrize("how", HOW)
def test_layers_written_on_the_gpu_land_as_announced_byte_exact(tmp_path, how):
    with sender(how, "layers", tmp_path) as other:
        pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="cuda")
        tables = kvpool.BlockTables(pool, 8, 64)
        tables.add(1, 16 * 2)  # the receiver's ids differ from the sender's
        transport = other.connect(pool)
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S)
        free_before = pool.num_free
        transfer = receiver.recv(timeout=PEER_WAIT_S)
        transfer.wait()
        ids = tables.blocks(LAYERED_RID)
        conserved(receiver, pool, free_before - len(ids))
        assert tables.num_tokens(LAYERED_RID) == LAYERED_TOKENS
        for got, want in zip(read(pool, ids), kv_of(LAYERED_RID, len(ids))):
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        seen = other.finish(FINISH_S)
    assert seen == {"sent": True}, seen
    # The READs cover the layers in order, each range once (how announcements group into READs
    # depends on when the receiver polled: not asserted).
    reads = transfer._completion.reads
    assert [r[0] for r in reads] == [0] + [r[1] for r in reads[:-1]], reads
    assert reads[-1][1] == LAYOUT.num_layers, reads
    print(how, "layer READs (first, end, blocks):", reads)
