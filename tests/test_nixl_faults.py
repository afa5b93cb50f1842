"""Faults in a NIXL transfer between two processes on loopback (host pools, UCX): a peer killed
mid-transfer (either side), a deadline passing during the READ, a silent peer (connected, never
sends), a peer that never says its NIXL hello (``connect`` times out, nothing left registered),
malformed offers, a duplicate request id and a receiver out of blocks. Each leaves
both pools conserved (free + evictable + used + in_flight == total, ``check_invariants``, no
lease left) and every surviving side with a TransferError naming what happened.

The test process plays one side; this file, run as a script, plays the other (``peer(role)``)
and reports what it saw as a ``RESULT {json}`` line. Faults are placed deterministically: a
process kills itself (or is killed) at a chosen step, deadlines are on injected clocks, so no
test waits on a real timeout longer than a fraction of a second.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import kvpool
import pytest
from kvpool import TransferError
from kvpool.transfer import KvReceiver, KvSender
from nixl_peers import PEER_WAIT_S, NixlTransport, conserved, fill, request_bytes, spawn

LAYOUT_ARGS = (2, 2, 64, 16)  # 8 KiB blocks, 16 tokens each
NUM_BLOCKS = 64


def make_side() -> tuple[kvpool.Pool, kvpool.BlockTables]:
    pool = kvpool.Pool(kvpool.KvLayout(*LAYOUT_ARGS), NUM_BLOCKS, device="host")
    return pool, kvpool.BlockTables(pool, 16, 64)


def expected_bytes(rid: int, num_tokens: int) -> list[bytes]:
    pool, tables = make_side()
    fill(pool, tables, rid, num_tokens)
    return request_bytes(pool, tables, rid)


class Clock:
    """A fake monotonic clock: still until a test moves it, or ``step`` per reading."""

    def __init__(self, step: float = 0.0) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


# -- the other process ------------------------------------------------------------------------


class ReadThenDie(NixlTransport):
    """A receiver whose process dies (SIGKILL, no cleanup) right after posting its READ."""

    def move(self, *args: Any, **kwargs: Any) -> None:
        post = self.agent.transfer

        def post_then_die(handle: Any, *a: Any) -> str:
            post(handle, *a)
            os.kill(os.getpid(), signal.SIGKILL)
            raise AssertionError("unreachable")

        self.agent.transfer = post_then_die
        super().move(*args, **kwargs)


class StuckRead(NixlTransport):
    """A receiver whose READ never completes (NIXL keeps answering PROC): it stays silent."""

    def move(self, *args: Any, **kwargs: Any) -> None:
        self.agent.transfer = lambda handle, *a: "PROC"
        self.agent.check_xfer_state = lambda handle: "PROC"
        super().move(*args, **kwargs)


def peer(role: str, rendezvous: str) -> dict:
    """The other side of each test; returns what it saw."""
    pool, tables = make_side()
    report: dict[str, Any] = {}
    transport_class = {"read_then_die": ReadThenDie, "stuck_reader": StuckRead}.get(
        role, NixlTransport
    )
    if role in ("sender", "killed_sender"):
        fill(pool, tables, 7, 16 * 5 + 3)
    if role == "forger":
        fill(pool, tables, 5, 16 * 2)  # an id the test's receiver already holds
        fill(pool, tables, 6, 16 * 40)  # more blocks than the receiver has free
        fill(pool, tables, 8, 16 * 3)
    free_before = pool.num_free
    transport = transport_class.connect(0, rendezvous, pool, timeout=PEER_WAIT_S)
    if role in ("sender", "killed_sender"):
        sender = KvSender(tables, transport, timeout_s=PEER_WAIT_S)
        try:
            sender.send(7).wait()
            report["sent"] = True
        except TransferError as e:
            report["error"] = str(e)
        report["kept"] = 7 in tables and request_bytes(pool, tables, 7) == expected_bytes(
            7, 16 * 5 + 3
        )
        conserved(sender, pool, free_before)
    elif role in ("read_then_die", "stuck_reader"):
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S)
        try:
            receiver.recv(timeout=PEER_WAIT_S)
            report["received"] = True
        except TransferError as e:
            report["error"] = str(e)
        conserved(receiver, pool, free_before)
    elif role == "silent":
        # Connected, answers nothing: reads what comes until the test side closes.
        seen = []
        try:
            while True:
                seen.append(transport.recv_control(PEER_WAIT_S).get("kind"))
        except Exception as e:
            report["ended"] = type(e).__name__
        report["seen"] = seen
    elif role == "forger":
        report["refusals"] = forge_offers(pool, tables, transport)
        sender = KvSender(tables, transport, timeout_s=PEER_WAIT_S)
        for rid in (5, 6):  # refused by the receiver: kept here, unchanged
            try:
                sender.send(rid)
            except TransferError as e:
                report[f"error_{rid}"] = str(e)
            assert rid in tables, rid
        report["kept"] = request_bytes(pool, tables, 6) == expected_bytes(6, 16 * 40)
        sender.send(8).wait()  # the transport still serves after every refusal
        conserved(sender, pool, free_before + 3)
    transport.close()
    return report


def forged_offer(src_ids: Any, num_tokens: int = 16 * 3, **fields: Any) -> dict:
    from kvpool.transfer.protocol import PROTOCOL_VERSION, layout_fingerprint

    return {
        "kind": "offer",
        "version": PROTOCOL_VERSION,
        "request_id": 9,
        "num_tokens": num_tokens,
        "layout": layout_fingerprint(kvpool.KvLayout(*LAYOUT_ARGS)),
        "src_ids": src_ids,
        "mode": "auto",
        "chunk_blocks": 8,
        **fields,
    }


# Offers a hostile or broken sender could make, each with the words its refusal must name.
MALFORMED = [
    ([0, 1, 2**31], "int32"),  # past int32 (a bare OverflowError after tables.add, once)
    ([0, -1, 2], "int32"),
    ([0, 1.5, 2], "int32"),
    ([0, "1", 2], "int32"),
    ([0, True, 2], "int32"),
    ([0, 1], "2 blocks offered for 48 tokens"),  # wrong length
    ([0, 1, 2, 3], "4 blocks offered for 48 tokens"),
    ([0, 1, 1], "repeat"),
    ([NUM_BLOCKS - 1, NUM_BLOCKS, NUM_BLOCKS + 1], "the sender's pool has 64"),  # not in its slab
    ("0,1,2", "src_ids of type str"),
]


def forge_offers(pool: kvpool.Pool, tables: kvpool.BlockTables, transport: Any) -> list[str]:
    reasons = []
    for src_ids, _ in MALFORMED:
        transport.send_control(forged_offer(src_ids))
        answer = transport.recv_control(PEER_WAIT_S)
        assert answer["kind"] == "refuse", answer
        reasons.append(answer["reason"])
    return reasons


if __name__ == "__main__":
    result = peer(sys.argv[1], sys.argv[2])
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0)


# -- the tests --------------------------------------------------------------------------------


def test_a_sender_killed_before_the_read_lands_frees_the_receivers_blocks(tmp_path):
    class KillTheSenderFirst(NixlTransport):
        victim: subprocess.Popen

        def move(self, *args: Any, **kwargs: Any) -> None:
            self.victim.kill()  # after the accept, before the READ is posted
            self.victim.wait()
            super().move(*args, **kwargs)

    with spawn(__file__, "killed_sender", tmp_path=tmp_path) as other:
        pool, tables = make_side()
        free_before = pool.num_free
        transport = other.connect(pool, KillTheSenderFirst)
        transport.victim = other.process
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S)
        with pytest.raises(TransferError, match="receiving request 7 failed.*died") as raised:
            receiver.recv(timeout=PEER_WAIT_S)
        assert raised.value.request_id == 7
        assert 7 not in tables
        conserved(receiver, pool, free_before)
    assert other.process.returncode == -signal.SIGKILL


def test_a_receiver_killed_mid_read_leaves_the_sender_its_request(tmp_path):
    with spawn(__file__, "read_then_die", tmp_path=tmp_path) as other:
        pool, tables = make_side()
        fill(pool, tables, 7, 16 * 5 + 3)
        free_before = pool.num_free
        transport = other.connect(pool)
        sender = KvSender(tables, transport, timeout_s=PEER_WAIT_S)
        with pytest.raises(TransferError, match="sending request 7.*receiver's process died"):
            sender.send(7)
        assert request_bytes(pool, tables, 7) == expected_bytes(7, 16 * 5 + 3)
        conserved(sender, pool, free_before)
        other.process.wait(timeout=PEER_WAIT_S)
    assert other.process.returncode == -signal.SIGKILL


def deadline_passes_during_the_read(clock: Clock) -> type[NixlTransport]:
    """A receiver's transport whose READ is seen complete only past its deadline on ``clock``
    (also used by tests/test_nixl_staging.py)."""

    class DeadlinePassesDuringTheRead(NixlTransport):
        def move(self, *args: Any, **kwargs: Any) -> None:
            post = self.agent.transfer

            def post_then_late(handle: Any, *a: Any) -> str:
                state = post(handle, *a)
                clock.now += 2 * PEER_WAIT_S  # the READ is seen complete past the deadline
                return state

            self.agent.transfer = post_then_late
            super().move(*args, **kwargs)

    return DeadlinePassesDuringTheRead


def test_a_deadline_passing_during_the_read_discards_it_and_tells_the_sender(tmp_path):
    clock = Clock()
    DeadlinePassesDuringTheRead = deadline_passes_during_the_read(clock)

    with spawn(__file__, "sender", tmp_path=tmp_path) as other:
        pool, tables = make_side()
        free_before = pool.num_free
        transport = other.connect(pool, DeadlinePassesDuringTheRead)
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S, clock=clock)
        with pytest.raises(TransferError, match="request 7 passed its deadline.*NIXL READ"):
            receiver.recv(timeout=PEER_WAIT_S)
        assert 7 not in tables
        conserved(receiver, pool, free_before)
        seen = other.finish()
    assert "sent" not in seen and seen["kept"], seen
    assert "receiver gave the transfer up" in seen["error"], seen
    assert "passed its deadline" in seen["error"], seen


def test_a_silent_receiver_is_given_up_at_the_senders_deadline(tmp_path):
    # The receiver accepts, then neither reads nor answers: the sender's lease ends at its
    # deadline (a clock stepping 10 s per reading; timeout_s is also the real
    # bound on the wait for the accept, so it stays generous), it keeps its request and tells the
    # receiver, which frees what it had allocated.
    with spawn(__file__, "stuck_reader", tmp_path=tmp_path) as other:
        pool, tables = make_side()
        fill(pool, tables, 7, 16 * 5 + 3)
        free_before = pool.num_free
        transport = other.connect(pool)
        sender = KvSender(tables, transport, timeout_s=PEER_WAIT_S, clock=Clock(step=10.0))
        with pytest.raises(TransferError, match="did not finish reading before the deadline"):
            sender.send(7)
        assert request_bytes(pool, tables, 7) == expected_bytes(7, 16 * 5 + 3)
        conserved(sender, pool, free_before)
        seen = other.finish()
    assert "received" not in seen, seen
    assert "the peer gave the transfer up" in seen["error"], seen
    assert "did not finish reading before the deadline" in seen["error"], seen


def test_a_silent_peer_bounds_the_wait_for_an_offer_and_for_an_answer(tmp_path):
    with spawn(__file__, "silent", tmp_path=tmp_path) as other:
        pool, tables = make_side()
        fill(pool, tables, 7, 16 * 2)
        free_before = pool.num_free
        transport = other.connect(pool)
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S)
        with pytest.raises(TransferError, match="waiting for an offer: no control message"):
            receiver.recv(timeout=0.2)
        conserved(receiver, pool, free_before)
        sender = KvSender(tables, transport, timeout_s=0.2)
        with pytest.raises(TransferError, match="receiver's answer to request 7: no control"):
            sender.send(7)
        assert 7 in tables
        conserved(sender, pool, free_before)
        transport.close()
        seen = other.finish()
    assert seen["seen"] == ["offer"] and seen["ended"] == "PeerGone", seen


def test_malformed_offers_a_duplicate_id_and_too_few_blocks_are_refused(tmp_path):
    with spawn(__file__, "forger", tmp_path=tmp_path) as other:
        pool, tables = make_side()
        fill(pool, tables, 5, 16 * 3)  # the id the sender will offer again
        for rid in range(20, 24):
            tables.add(rid, 16 * 8)  # 3 + 32 used: 29 free, fewer than request 6's 40
        held = request_bytes(pool, tables, 5)
        free_before = pool.num_free
        transport = other.connect(pool)
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S)
        for src_ids, words in MALFORMED:
            with pytest.raises(TransferError, match="refused request 9") as raised:
                receiver.recv(timeout=PEER_WAIT_S)
            assert words in str(raised.value), (src_ids, str(raised.value))
            assert 9 not in tables
            conserved(receiver, pool, free_before)
        with pytest.raises(TransferError, match="refused request 5: DuplicateRequestError"):
            receiver.recv(timeout=PEER_WAIT_S)
        assert request_bytes(pool, tables, 5) == held  # the receiver's own request untouched
        conserved(receiver, pool, free_before)
        with pytest.raises(TransferError, match="refused request 6: OutOfBlocks"):
            receiver.recv(timeout=PEER_WAIT_S)
        conserved(receiver, pool, free_before)
        receiver.recv(timeout=PEER_WAIT_S).wait()  # after all that, a good transfer lands
        assert request_bytes(pool, tables, 8) == expected_bytes(8, 16 * 3)
        conserved(receiver, pool, free_before - 3)
        seen = other.finish()
    assert [w in r for (_, w), r in zip(MALFORMED, seen["refusals"], strict=True)] == [True] * len(
        MALFORMED
    ), seen["refusals"]
    assert "refused request 5: DuplicateRequestError" in seen["error_5"], seen
    assert "refused request 6: OutOfBlocks" in seen["error_6"], seen
    assert seen["kept"], seen


@pytest.mark.parametrize("staging_bytes", [None, 4 * 8192])
def test_a_peer_that_never_says_hello_leaves_nothing_registered(
    tmp_path, monkeypatch, staging_bytes
):
    """The peer (a thread here) joins the control connection and never sends its NIXL hello:
    ``connect`` times out, having deregistered the slab (and, ``staging_bytes`` given, its
    staging buffer) and closed its socket (the peer reads the hello sent, then end-of-file),
    and the agent goes with the error."""
    import gc
    import socket
    import threading
    import weakref
    from types import SimpleNamespace

    from kvpool.transfer import nixl_transport
    from kvpool.transfer.nccl import rendezvous_control

    nixl = nixl_transport.load_nixl()
    registered: list = []
    registrations: list[int] = []  # how many were held after each register_memory
    agents: list = []

    class RecordingAgent(nixl.nixl_agent):
        def register_memory(self, *args: Any, **kwargs: Any) -> Any:
            registered.append(super().register_memory(*args, **kwargs))
            registrations.append(len(registered))
            return registered[-1]

        def deregister_memory(self, registration: Any) -> None:
            super().deregister_memory(registration)
            registered.remove(registration)

    def recording_agent(*args: Any) -> Any:
        agent = RecordingAgent(*args)
        agents.append(weakref.ref(agent))
        return agent

    monkeypatch.setattr(
        nixl_transport,
        "load_nixl",
        lambda: SimpleNamespace(
            nixl_agent=recording_agent, nixl_agent_config=nixl.nixl_agent_config
        ),
    )
    rendezvous = tmp_path / "rendezvous.json"
    joined: list[socket.socket] = []
    mute = threading.Thread(
        target=lambda: joined.append(
            rendezvous_control(0, rendezvous, lambda: [], timeout=PEER_WAIT_S)[0]
        )
    )
    mute.start()
    pool, _ = make_side()
    try:
        while mute.is_alive() and not rendezvous.exists():  # then connect waits for the hello only
            mute.join(0.05)
        with pytest.raises(TimeoutError, match="no control message"):
            NixlTransport.connect(1, rendezvous, pool, timeout=2.0, staging_bytes=staging_bytes)
    finally:
        mute.join()
    gc.collect()
    assert len(agents) == 1 and agents[0]() is None and registered == []
    assert registrations == ([1] if staging_bytes is None else [1, 2])  # the slab, the buffer
    with joined[0] as peer_sock:
        peer_sock.settimeout(PEER_WAIT_S)
        received = b""
        while chunk := peer_sock.recv(1 << 16):
            received += chunk
    assert b"nixl_hello" in received
