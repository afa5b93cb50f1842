"""Layer-by-layer transfer over NIXL between two processes on loopback (host pools, UCX): the
sender announces layers as it "computes" them (it writes layer k only when the test tells it
to, right before announcing it), the receiver READs each announced range and sees layers land
before the last is announced, byte-exact per layer, the rest of its blocks untouched; the
sender killed between layers, the receiver's deadline passing mid-way, and an abort by either
side leave both pools conserved (free + evictable + used + in_flight == total, no lease left)
and each surviving side with a TransferError naming what happened.

The test process is the receiver; this file, run as a script, is the sender, driven line by
line through its stdin (``layers K``, ``wait``, ``abort``, ``end``) and answering each line,
so every step is ordered by the test, with no sleeps and no timed assertions.
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
from nixl_peers import PEER_WAIT_S, NixlTransport, Peer, conserved, spawn

LAYOUT_ARGS = (4, 2, 32, 16)  # 4 layers of 4 KiB in 16 KiB blocks
NUM_BLOCKS = 32
RID, NUM_TOKENS = 7, 16 * 4 + 9  # 5 blocks
SENTINEL = 0x5A


def make_side() -> tuple[kvpool.Pool, kvpool.BlockTables]:
    pool = kvpool.Pool(kvpool.KvLayout(*LAYOUT_ARGS), NUM_BLOCKS, device="host")
    return pool, kvpool.BlockTables(pool, 8, 16)


def layer_bytes(pool: kvpool.Pool, ids: Any, layer: int) -> bytes:
    return pool.k_view(layer)[ids].tobytes() + pool.v_view(layer)[ids].tobytes()


def write_layer(pool: kvpool.Pool, ids: Any, layer: int) -> None:
    """The sender's "compute" of one layer: K and V from a seed of the layer."""
    rng = np.random.default_rng(100 + layer)
    for view in (pool.k_view(layer), pool.v_view(layer)):
        view[ids] = rng.standard_normal(view[ids].shape).astype(view.dtype)


def expected_layer(layer: int) -> bytes:
    pool, tables = make_side()
    tables.add(RID, NUM_TOKENS)
    write_layer(pool, tables.blocks(RID), layer)
    return layer_bytes(pool, tables.blocks(RID), layer)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- the sender process -----------------------------------------------------------------------


def sender(rendezvous: str) -> None:
    pool, tables = make_side()
    tables.add(RID, NUM_TOKENS)  # allocated, nothing computed yet
    ids = tables.blocks(RID)
    free_before = pool.num_free
    transport = NixlTransport.connect(0, rendezvous, pool, timeout=PEER_WAIT_S)
    kv_sender = KvSender(tables, transport, timeout_s=PEER_WAIT_S)
    transfer = kv_sender.send(RID, layers_ready=0)
    written = 0
    report: dict[str, Any] = {}
    print("SENT", flush=True)
    for line in sys.stdin:
        command = line.split()
        try:
            if command[0] == "layers":
                while written < int(command[1]):
                    write_layer(pool, ids, written)
                    written += 1
                transfer.layers_ready(written)
            elif command[0] == "wait":
                transfer.wait()
                report["sent"] = True
            elif command[0] == "abort":
                transfer.abort()
            elif command[0] == "end":
                break
        except TransferError as e:
            report["error"] = str(e)
        print("OK", flush=True)
    report["kept"] = RID in tables and all(
        layer_bytes(pool, ids, layer) == expected_layer(layer) for layer in range(written)
    )
    if report.get("sent"):
        conserved(kv_sender, pool, free_before + len(ids))
    else:
        conserved(kv_sender, pool, free_before)
    transport.close()
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    sender(sys.argv[1])
    sys.exit(0)


# -- the tests (the receiver) ------------------------------------------------------------------


class Sender(Peer):
    """The sender process, driven through its stdin."""

    def tell(self, line: str) -> None:
        """Sends a command and waits until the sender has carried it out."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        self.expect("OK")

    def expect(self, word: str) -> None:
        """Reads the sender's output up to its next answer (NIXL logs to stdout too)."""
        assert self.process.stdout is not None
        for answer in self.process.stdout:
            if answer.strip() in ("OK", "SENT"):
                assert answer.strip() == word, answer
                return
        raise AssertionError(f"the sender ended before answering {word}")

    def finish(self) -> dict:
        """Tells the sender to end, then its ``RESULT``."""
        assert self.process.stdin is not None
        self.process.stdin.write("end\n")
        self.process.stdin.flush()
        return super().finish()


def start(other: Sender, clock: Any = None) -> tuple[Any, ...]:
    """The receiver: connected, the offer accepted (nothing ready, nothing read), its blocks
    filled with a sentinel so a layer read too early or too much shows."""
    pool, tables = make_side()
    free_before = pool.num_free
    transport = other.connect(pool)
    receiver = KvReceiver(
        tables, transport, timeout_s=PEER_WAIT_S, **({"clock": clock} if clock else {})
    )
    transfer = receiver.recv(timeout=PEER_WAIT_S)
    other.expect("SENT")
    ids = tables.blocks(RID)
    for layer in range(pool.layout.num_layers):
        for view in (pool.k_view(layer), pool.v_view(layer)):
            shape = view[ids].shape
            view[ids] = np.frombuffer(bytes([SENTINEL]) * view[ids].nbytes, view.dtype).reshape(
                shape
            )
    assert transfer.layers_landed == 0 and not transfer.done()
    return pool, tables, receiver, transfer, free_before


def land(transfer: Any, layers: int) -> None:
    """Polls the receiver's transfer until ``layers`` layers have landed (the READ runs while
    it is polled; bounded so a broken transfer fails instead of hanging)."""
    for _ in range(2_000_000):
        if transfer.layers_landed >= layers:
            return
        transfer.done()
    raise AssertionError(f"{transfer.layers_landed} layers landed, waiting for {layers}")


def check_layers(pool: kvpool.Pool, ids: Any, landed: int) -> None:
    for layer in range(pool.layout.num_layers):
        got = layer_bytes(pool, ids, layer)
        if layer < landed:
            assert got == expected_layer(layer), f"layer {layer} differs"
        else:
            assert got == bytes([SENTINEL]) * len(got), f"layer {layer} was written early"


def test_layers_land_as_they_are_announced_byte_exact(tmp_path):
    with spawn(__file__, tmp_path=tmp_path, stdin=True, peer_class=Sender) as other:
        pool, tables, receiver, transfer, free_before = start(other)
        ids = tables.blocks(RID)
        other.tell("layers 1")
        land(transfer, 1)
        check_layers(pool, ids, 1)  # layer 0 here before layers 1..3 were even computed
        assert transfer.layers_landed == 1 and transfer.state == "in_flight"
        receiver.check_invariants()  # its blocks leased while layers land
        assert receiver.leases.in_flight == len(ids)
        other.tell("layers 3")
        land(transfer, 3)
        check_layers(pool, ids, 3)
        other.tell("layers 4")
        transfer.wait()
        check_layers(pool, ids, 4)
        conserved(receiver, pool, free_before - len(ids))
        assert tables.num_tokens(RID) == NUM_TOKENS
        other.tell("wait")
        seen = other.finish()
    assert seen == {"sent": True, "kept": False}, seen
    # One READ per announced range, one descriptor per block (a layer range of a block is
    # contiguous; blocks are not, as the range leaves out the other layers between them).
    reads = transfer._completion.reads
    assert reads == [(0, 1, 5), (1, 3, 5), (3, 4, 5)], reads


def test_a_sender_killed_between_layers_frees_the_receivers_blocks(tmp_path):
    with spawn(__file__, tmp_path=tmp_path, stdin=True, peer_class=Sender) as other:
        pool, tables, receiver, transfer, free_before = start(other)
        other.tell("layers 2")
        land(transfer, 2)
        other.process.kill()
        other.process.wait()
        with pytest.raises(TransferError, match="request 7.*(died|closed)") as raised:
            transfer.wait()
        assert raised.value.request_id == RID
        assert RID not in tables
        conserved(receiver, pool, free_before)


def test_a_deadline_passing_between_layers_is_given_up_on_both_sides(tmp_path):
    clock = Clock()
    with spawn(__file__, tmp_path=tmp_path, stdin=True, peer_class=Sender) as other:
        pool, tables, receiver, transfer, free_before = start(other, clock)
        other.tell("layers 1")
        land(transfer, 1)
        clock.now += 2 * PEER_WAIT_S
        with pytest.raises(TransferError, match="request 7 passed its deadline"):
            transfer.wait()
        assert RID not in tables
        conserved(receiver, pool, free_before)
        other.tell("wait")
        seen = other.finish()
    assert "sent" not in seen and seen["kept"], seen
    assert "receiver gave the transfer up" in seen["error"], seen
    assert "passed its deadline" in seen["error"], seen


def test_the_sender_aborting_between_layers_frees_the_receivers_blocks(tmp_path):
    with spawn(__file__, tmp_path=tmp_path, stdin=True, peer_class=Sender) as other:
        pool, tables, receiver, transfer, free_before = start(other)
        other.tell("layers 1")
        land(transfer, 1)
        other.tell("abort")
        with pytest.raises(TransferError, match="gave the transfer up: aborted by the caller"):
            transfer.wait()
        conserved(receiver, pool, free_before)
        seen = other.finish()
    assert "sent" not in seen and seen["kept"], seen


def test_the_receiver_aborting_between_layers_leaves_the_sender_its_request(tmp_path):
    with spawn(__file__, tmp_path=tmp_path, stdin=True, peer_class=Sender) as other:
        pool, tables, receiver, transfer, free_before = start(other)
        other.tell("layers 1")
        land(transfer, 1)
        transfer.abort("the decode server is shutting down")
        assert RID not in tables
        conserved(receiver, pool, free_before)
        other.tell("layers 2")  # the sender learns it here, at the latest
        seen = other.finish()
    assert "sent" not in seen and seen["kept"], seen
    assert "the decode server is shutting down" in seen["error"], seen


def test_a_receiver_gone_between_layers_leaves_the_sender_its_request(tmp_path):
    with spawn(__file__, tmp_path=tmp_path, stdin=True, peer_class=Sender) as other:
        pool, tables, receiver, transfer, free_before = start(other)
        other.tell("layers 1")
        land(transfer, 1)
        # The receiver's process "dies": its control connection closes with no abort sent.
        receiver._ep.transport._control.abort()
        other.tell("layers 2")  # the sender sees end-of-file when it announces
        seen = other.finish()
        transfer.abort("the test tears its side down")  # frees what this side held
        conserved(receiver, pool, free_before)
    assert "sent" not in seen and seen["kept"], seen
    assert "the receiver's process died" in seen["error"], seen
