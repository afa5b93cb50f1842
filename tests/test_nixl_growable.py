"""A growable pool and NIXL (two processes on loopback, host pools, UCX): NIXL registers a
pool's memory once at connect, so the blocks a growth maps later lie outside the registration.
Before ``connect`` refused growable pools, a growable host receiver was accepted, grew to
receive a request, and the READ into its new blocks failed mid-transfer (``NIXL could not
prepare the READ: nixlNotFoundError: NIXL_ERR_NOT_FOUND``). Now ``connect`` refuses it by name
before it loads NIXL or touches the rendezvous, so the same rendezvous then joins a fixed-size
pool, which receives the request byte-exact.

The test process is the receiver; this file, run as a script, is the sender
(tests/nixl_peers.py)."""

from __future__ import annotations

import json
import sys

import kvpool
import pytest
from kvpool import TransferError
from kvpool.transfer import KvReceiver, KvSender
from nixl_peers import PEER_WAIT_S, NixlTransport, conserved, fill, request_bytes, spawn

LAYOUT_ARGS = (2, 2, 64, 16)  # 16 KiB blocks, 16 tokens each
NUM_TOKENS = 16 * 20 + 3  # 21 blocks


def sender(rendezvous: str) -> dict:
    """The peer: a fixed-size host pool sending request 7."""
    pool = kvpool.Pool(kvpool.KvLayout(*LAYOUT_ARGS), 64, device="host")
    tables = kvpool.BlockTables(pool, 16, 64)
    fill(pool, tables, 7, NUM_TOKENS)
    transport = NixlTransport.connect(0, rendezvous, pool, timeout=PEER_WAIT_S)
    KvSender(tables, transport, timeout_s=PEER_WAIT_S).send(7).wait()
    transport.close()
    return {"sent": True, "num_used": pool.num_used}


def test_a_growable_receiver_is_refused_at_connect_and_a_fixed_pool_then_receives(tmp_path):
    layout = kvpool.KvLayout(*LAYOUT_ARGS)
    growable = kvpool.Pool(
        layout, growable=True, initial_num_blocks=8, max_num_blocks=1024, device="host"
    )
    growable_tables = kvpool.BlockTables(growable, 16, 256)
    # Almost full: receiving 21 blocks would make it grow past what connect registered.
    growable_tables.add(1, 16 * (growable.num_blocks - 4))
    num_blocks_before, free_before = growable.num_blocks, growable.num_free
    with spawn(__file__, "sender", tmp_path=tmp_path) as other:
        with pytest.raises(TransferError, match="growable pools") as refused:
            other.connect(growable)
        assert "fixed-size pool" in str(refused.value)
        # The refusal changed nothing: the pool, and the rendezvous the peer waits on.
        assert (growable.num_blocks, growable.num_free) == (num_blocks_before, free_before)
        assert other.transports == []

        pool = kvpool.Pool(layout, 64, device="host")
        tables = kvpool.BlockTables(pool, 16, 64)
        transport = other.connect(pool)
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S)
        receiver.recv(timeout=PEER_WAIT_S).wait()
        want_pool = kvpool.Pool(layout, 64, device="host")
        want_tables = kvpool.BlockTables(want_pool, 16, 64)
        fill(want_pool, want_tables, 7, NUM_TOKENS)
        assert request_bytes(pool, tables, 7) == request_bytes(want_pool, want_tables, 7)
        conserved(receiver, pool, 64 - 21)
        seen = other.finish()
    assert seen == {"sent": True, "num_used": 0}, seen


if __name__ == "__main__":
    print("RESULT " + json.dumps({"sender": sender}[sys.argv[1]](sys.argv[2])), flush=True)
