"""Heterogeneous tensor parallelism over NIXL between processes on loopback (host pools, UCX):
a TP-2 prefill (two ranks, each a pool holding half the KV heads) gathered into a TP-1 decode
pool, and a TP-1 prefill pool split into a TP-2 decode group (each rank READing its head
range), byte-exact against the full model's KV; a fault on one of the two legs returns every
block on all three pools (free + evictable + used + in_flight == total, no lease left), each
side told. Head-range descriptors and the refusal of a shard that does not fit are checked
without NIXL in tests/test_transfer_tp.py.

The test process plays the decode side; this file, run as a script, the prefill side (the two
ranks of a TP-2 prefill as two threads, each with its own pool, tables and transport) and
reports ``RESULT {json}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import kvpool
import numpy as np
import pytest
from kvpool import TransferError
from kvpool.transfer import KvReceiver, KvSender
from kvpool.transfer.transport import PeerGone
from nixl_peers import (
    PEER_WAIT_S,
    STAGE_ALWAYS,
    NixlTransport,
    Peer,
    conserved,
    run_ranks,
    spawn,
)

FULL = kvpool.KvLayout(2, 4, 16, 16)  # the model: 2 layers, 4 KV heads
NUM_BLOCKS = 24
RID, NUM_TOKENS = 7, 16 * 3 + 5  # 4 blocks


def full_kv() -> list[np.ndarray]:
    """Per (layer, K|V) the model's KV of the request's 4 blocks, all heads."""
    rng = np.random.default_rng(RID)
    shape = (4, FULL.block_size, FULL.num_kv_heads, FULL.head_dim)
    return [rng.standard_normal(shape).astype(np.float16) for _ in range(2 * FULL.num_layers)]


def views(pool: kvpool.Pool) -> list:
    return [
        v
        for layer in range(pool.layout.num_layers)
        for v in (pool.k_view(layer), pool.v_view(layer))
    ]


def make_side(layout: kvpool.KvLayout, holes: int) -> tuple[kvpool.Pool, kvpool.BlockTables]:
    """A pool and tables whose next request's ids start past ``holes`` blocks."""
    pool = kvpool.Pool(layout, NUM_BLOCKS, device="host")
    tables = kvpool.BlockTables(pool, 8, 8)
    if holes:
        tables.add(99, 16 * holes)
    return pool, tables


def heads_of(rank: int, size: int) -> tuple[int, int]:
    return FULL.tp_head_range(size, rank)


def fill(pool: kvpool.Pool, tables: kvpool.BlockTables, heads: tuple[int, int]) -> None:
    tables.add(RID, NUM_TOKENS)
    ids = tables.blocks(RID)
    for view, full in zip(views(pool), full_kv()):
        view[ids] = full[:, :, heads[0] : heads[1]]


def holds(pool: kvpool.Pool, tables: kvpool.BlockTables, heads: tuple[int, int]) -> bool:
    ids = tables.blocks(RID)
    return all(
        np.array_equal(view[ids], full[:, :, heads[0] : heads[1]])
        for view, full in zip(views(pool), full_kv())
    )


# -- the prefill side (another process) -------------------------------------------------------


def prefill_rank(rank: int, rendezvous: str, report: dict) -> None:
    """One rank of a TP-2 prefill: its own pool of half the heads, sending its part."""
    pool, tables = make_side(FULL.tp_shard(2), holes=rank + 1)  # the ranks' ids differ
    fill(pool, tables, heads_of(rank, 2))
    free_before = pool.num_free
    transport = NixlTransport.connect(0, rendezvous, pool, timeout=PEER_WAIT_S)
    sender = KvSender(tables, transport, timeout_s=PEER_WAIT_S, tp=(rank, 2))
    try:
        sender.send(RID).wait()
        report["sent"] = True
        conserved(sender, pool, free_before + 4)
    except TransferError as e:
        report["error"] = str(e)
        report["kept"] = holds(pool, tables, heads_of(rank, 2))
        conserved(sender, pool, free_before)
    transport.close()


def tp2_prefill(rendezvous: list[str]) -> dict:
    return run_ranks(prefill_rank, rendezvous)


def tp1_prefill(rendezvous: list[str]) -> dict:
    from kvpool.transfer.tp_legs import KvSplitSender

    pool, tables = make_side(FULL, holes=2)
    fill(pool, tables, (0, 4))
    free_before = pool.num_free
    transports = [NixlTransport.connect(0, r, pool, timeout=PEER_WAIT_S) for r in rendezvous]
    sender = KvSplitSender(tables, transports, timeout_s=PEER_WAIT_S)
    report: dict[str, Any] = {}
    try:
        sender.send(RID).wait()
        report["sent"] = True
        conserved(sender, pool, free_before + 4)
    except TransferError as e:
        report["error"] = str(e)
        report["kept"] = holds(pool, tables, (0, 4))
        conserved(sender, pool, free_before)
    for transport in transports:
        transport.close()
    return report


if __name__ == "__main__":
    role = {"tp2": tp2_prefill, "tp1": tp1_prefill}[sys.argv[1]]
    print("RESULT " + json.dumps(role(sys.argv[2:])), flush=True)
    sys.exit(0)


# -- the decode side (the tests) ----------------------------------------------------------------


class FailingRead(NixlTransport):
    """A leg whose READ NIXL refuses (the fault on one leg)."""

    def post(self, *args: Any, **kwargs: Any) -> Any:
        raise PeerGone("injected: this leg's NIXL READ failed")


class ReadEndsInError(NixlTransport):
    """A leg whose READ is posted but ends in error (NIXL's "ERR"), seen while polled."""

    def post(self, *args: Any, **kwargs: Any) -> Any:
        handle, state = super().post(*args, **kwargs)
        self.agent.check_xfer_state = lambda handle: "ERR"
        return handle, "PROC"


# Every gather leg READs through its staging buffer (host pools get one only when asked; these
# few rows would not pay by the default costs): the shard's blocks whole, then the rows
# scattered into the wider blocks.
STAGED = {"staging_bytes": 1 << 20}


def gather_legs(prefill: Peer, pool: kvpool.Pool, staging: str, classes: tuple = ()) -> list:
    """The decode side's two legs, staged or cut into rows; ``classes`` per leg if given."""
    legs = []
    for leg in range(2):
        cls = classes[leg] if classes else NixlTransport
        if staging == "staged":
            legs.append(prefill.connect(pool, cls, leg=leg, **STAGED))
            legs[-1].staging_cost = STAGE_ALWAYS
        else:
            legs.append(prefill.connect(pool, cls, leg=leg))
    return legs


@pytest.mark.parametrize("staging", ["rows", "staged"])
def test_a_tp2_prefill_gathers_into_a_tp1_decode_pool_byte_exact(tmp_path, staging):
    from kvpool.transfer.tp_legs import KvGatherReceiver

    with spawn(__file__, "tp2", tmp_path=tmp_path, legs=2) as prefill:
        pool, tables = make_side(FULL, holes=0)
        free_before = pool.num_free
        legs = gather_legs(prefill, pool, staging)
        receiver = KvGatherReceiver(tables, legs, timeout_s=PEER_WAIT_S)
        transfer = receiver.recv(timeout=PEER_WAIT_S)
        transfer.wait()
        assert tables.num_tokens(RID) == NUM_TOKENS and holds(pool, tables, (0, 4))
        conserved(receiver, pool, free_before - 4)
        seen = prefill.finish()
    assert seen["ranks"] == [{"sent": True}, {"sent": True}], seen
    assert [leg.descriptor_counts for leg in legs] == [[], []]
    reads = [read.reads for read in transfer._completion.legs]
    if staging == "staged":  # each rank's 4 blocks are one run: one descriptor
        assert reads == [[(0, 2, 1)]] * 2, reads
        assert [leg.staging.holder for leg in legs] == [None, None]
    else:  # one descriptor per (block, layer, K|V, token), its two heads of each row
        assert reads == [[(0, 2, 4 * 2 * 2 * 16)]] * 2, reads


@pytest.mark.parametrize("staging", ["rows", "staged"])
def test_a_fault_on_one_gather_leg_returns_every_block_on_all_three_pools(tmp_path, staging):
    from kvpool.transfer.tp_legs import KvGatherReceiver

    with spawn(__file__, "tp2", tmp_path=tmp_path, legs=2) as prefill:
        pool, tables = make_side(FULL, holes=0)
        free_before = pool.num_free
        legs = gather_legs(prefill, pool, staging, (NixlTransport, ReadEndsInError))
        receiver = KvGatherReceiver(tables, legs, timeout_s=PEER_WAIT_S)
        transfer = receiver.recv(timeout=PEER_WAIT_S)
        # Leg 0's READ completes; leg 1's fails: no sender may free its part (a "done" to
        # rank 0 before leg 1 landed would lose rank 0's half of the request).
        with pytest.raises(TransferError, match="request 7 failed.*READ failed \\(state ERR"):
            transfer.wait()
        assert RID not in tables
        conserved(receiver, pool, free_before)
        if staging == "staged":
            assert [leg.staging.holder for leg in legs] == [None, None]
        seen = prefill.finish()
    for rank in seen["ranks"]:  # each rank kept its request, bytes intact, its pool conserved
        assert "sent" not in rank and rank["kept"], seen
        assert "the receiver gave the transfer up" in rank["error"], seen


def split_receivers(prefill: Peer, fail_leg: int | None = None) -> list[tuple[Any, ...]]:
    out = []
    for rank in range(2):
        pool, tables = make_side(FULL.tp_shard(2), holes=rank)
        cls = FailingRead if rank == fail_leg else NixlTransport
        transport = prefill.connect(pool, cls, leg=rank)
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S, tp=(rank, 2))
        out.append((pool, tables, receiver, pool.num_free))
    return out


def test_a_tp1_prefill_splits_into_a_tp2_decode_group_byte_exact(tmp_path):
    from kvpool.transfer import wait_all

    with spawn(__file__, "tp1", tmp_path=tmp_path, legs=2) as prefill:
        ranks = split_receivers(prefill)
        transfers = [receiver.recv(timeout=PEER_WAIT_S) for _, _, receiver, _ in ranks]
        # Neither rank's request is ready before the sender commits, after both have read.
        assert [t.done() for t in transfers] == [False, False]
        wait_all(transfers)
        for rank, (pool, tables, receiver, free_before) in enumerate(ranks):
            assert holds(pool, tables, heads_of(rank, 2)), rank
            conserved(receiver, pool, free_before - 4)
        seen = prefill.finish()
    assert seen == {"sent": True}, seen


def test_a_fault_on_one_split_leg_returns_every_block_on_all_three_pools(tmp_path):
    from kvpool.transfer import wait_all

    with spawn(__file__, "tp1", tmp_path=tmp_path, legs=2) as prefill:
        ranks = split_receivers(prefill, fail_leg=1)
        first = ranks[0][2].recv(timeout=PEER_WAIT_S)
        with pytest.raises(TransferError, match="receiving request 7 failed.*leg's NIXL READ"):
            ranks[1][2].recv(timeout=PEER_WAIT_S)
        # Rank 0 read its heads, but the sender, told by rank 1, aborts rank 0's leg too.
        with pytest.raises(TransferError, match="the sender gave the transfer up.*receiver 1"):
            wait_all([first])
        for pool, tables, receiver, free_before in ranks:
            assert RID not in tables
            conserved(receiver, pool, free_before)
        seen = prefill.finish()
    assert "sent" not in seen and seen["kept"], seen
    assert "receiver 1 gave the transfer up" in seen["error"], seen
