"""Hybrid requests (HybridTables: full, sliding window, chunked local, MLA latent and state
groups) over NIXL between two processes on loopback, host pools: the receiver READs every
group's pages byte-exact into its own ids (a slid window: only its live pages); a spec
mismatch, forged page lists, a duplicate id and a receiver out of pages are refused with
nothing allocated and the same transport then carries a good transfer; a sender killed before
the READ and a receiver killed after posting it leave both pools conserved, every group's
pages returned (free + evictable + used + in_flight == total, no lease left).

The test process plays one side; this file, run as a script, plays the other (``peer``) and
reports a ``RESULT {json}`` line, as tests/test_nixl_faults.py does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
from hybrid_pages import (
    expected_group_bytes,
    fill_groups,
    group_bytes,
    same_per_group,
    side,
    table_shapes,
)
from kvpool import TransferError
from kvpool.transfer import KvReceiver, KvSender
from kvpool.transfer.kinds import HybridRequests
from nixl_peers import PEER_WAIT_S, NixlTransport, conserved, spawn

SENDER_PAGES, RECEIVER_PAGES = 256, 100
# The sender's requests: id -> (tokens added, tokens after one more call or None).
REQUESTS = {7: (90, 161), 5: (30, None), 6: (300, None), 8: (40, 41)}


def make_request(tables: Any, rid: int) -> None:
    added, grown = REQUESTS[rid]
    tables.add(rid, added)
    if grown is not None:
        tables.append_tokens(rid, grown - added)  # window and chunk pages leave
    fill_groups(tables, rid, seed=rid)


def with_holes(tables: Any) -> None:
    for rid in range(500, 506):
        tables.add(rid, 9)
    for rid in range(500, 506, 2):
        tables.free(rid)


def expected(rid: int) -> tuple[list, list]:
    """Per group the bytes and (first_page, pages, tokens) the sender's request has."""
    pool, tables = side(SENDER_PAGES)
    make_request(tables, rid)
    shapes = table_shapes(tables, rid)
    return [expected_group_bytes(rid, g, n) for g, (_, n, _) in enumerate(shapes)], shapes


def forged_offers(tables: Any) -> list[tuple[dict, str]]:
    """Offers of request 8 a broken or hostile sender could make, with the words their
    refusals must name."""
    from kvpool.transfer.protocol import PROTOCOL_VERSION

    fields, _ = HybridRequests(tables).describe(8)

    def offer(**changes: Any) -> dict:
        message = {
            "kind": "offer",
            "version": PROTOCOL_VERSION,
            "request_id": 9,
            **json.loads(json.dumps(fields)),
            "mode": "auto",
            "chunk_blocks": 8,
        }
        message.update(changes)
        return message

    window = offer()
    window["spec"]["groups"][0]["window"] = 16
    short = offer()
    short["groups"][1]["page_ids"].pop()
    outside = offer()
    outside["groups"][3]["page_ids"][-1] = SENDER_PAGES + 5
    return [
        (window, "spec mismatch: group 0 window 16 (sender) != 24 (receiver)"),
        (short, "group 1: 2 pages from page 0 offered"),
        (outside, "the sender's pool has 256"),
        (offer(next_query=50), "0 <= next_query <= num_tokens"),
    ]


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


def peer(role: str, rendezvous: str) -> dict:
    pool, tables = side(RECEIVER_PAGES if role == "read_then_die" else SENDER_PAGES)
    with_holes(tables)
    report: dict[str, Any] = {}
    if role in ("sender", "killed_sender"):
        for rid in (7, 5, 6, 8) if role == "sender" else (7,):
            make_request(tables, rid)
    free_before = pool.num_free
    transport_class = ReadThenDie if role == "read_then_die" else NixlTransport
    transport = transport_class.connect(0, rendezvous, pool, timeout=PEER_WAIT_S)
    if role == "sender":
        sender = KvSender(tables, transport, timeout_s=PEER_WAIT_S)
        sender.send(7).wait()
        for rid in (5, 6):  # refused by the receiver: kept here, unchanged
            try:
                sender.send(rid)
            except TransferError as e:
                report[f"error_{rid}"] = str(e)
        reasons = []
        for message, _ in forged_offers(tables):
            transport.send_control(message)
            answer = transport.recv_control(PEER_WAIT_S)
            assert answer["kind"] == "refuse", answer
            reasons.append(answer["reason"])
        report["refusals"] = reasons
        report["kept"] = all(
            rid in tables and same_per_group(group_bytes(tables, rid), expected(rid)[0])
            for rid in (5, 6)
        )
        sender.send(8).wait()  # the transport still serves after every refusal
        freed = sum(n for _, n, _ in expected(7)[1]) + sum(n for _, n, _ in expected(8)[1])
        conserved(sender, pool, free_before + freed)
    elif role == "killed_sender":
        KvSender(tables, transport, timeout_s=PEER_WAIT_S).send(7).wait()
    elif role == "read_then_die":
        KvReceiver(tables, transport, timeout_s=PEER_WAIT_S).recv(timeout=PEER_WAIT_S)
    transport.close()
    return report


if __name__ == "__main__":
    result = peer(sys.argv[1], sys.argv[2])
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0)


# -- the tests --------------------------------------------------------------------------------


def test_every_group_moves_byte_exact_and_bad_offers_are_refused(tmp_path):
    with spawn(__file__, "sender", tmp_path=tmp_path) as other:
        pool, tables = side(RECEIVER_PAGES)
        make_request(tables, 5)  # the id the sender will offer again (its own content)
        tables.add(20, 128)  # 36 pages: 53 left, enough for requests 7 and 8, not for 6
        held = group_bytes(tables, 5)
        transport = other.connect(pool)
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S)
        free_before = pool.num_free
        receiver.recv(timeout=PEER_WAIT_S).wait()
        want, shapes = expected(7)
        assert table_shapes(tables, 7) == shapes and shapes[0][0] > 0  # the slid window
        assert tables.next_query(7) == 90
        assert same_per_group(group_bytes(tables, 7), want)
        free_before -= sum(n for _, n, _ in shapes)
        conserved(receiver, pool, free_before)
        for words in ("refused request 5: DuplicateRequestError", "refused request 6: OutOf"):
            with pytest.raises(TransferError, match=words):
                receiver.recv(timeout=PEER_WAIT_S)
            conserved(receiver, pool, free_before)
        assert same_per_group(group_bytes(tables, 5), held)
        for _, words in forged_offers(tables_of_sender()):
            with pytest.raises(TransferError, match="refused request 9") as raised:
                receiver.recv(timeout=PEER_WAIT_S)
            assert words in str(raised.value), (words, str(raised.value))
            assert 9 not in tables
            conserved(receiver, pool, free_before)
        receiver.recv(timeout=PEER_WAIT_S).wait()
        want, shapes = expected(8)
        assert table_shapes(tables, 8) == shapes and tables.next_query(8) == 40
        assert same_per_group(group_bytes(tables, 8), want)
        conserved(receiver, pool, free_before - sum(n for _, n, _ in shapes))
        seen = other.finish()
        # Request 7's pages are scattered in the sender's pool: several descriptors.
        assert transport.descriptor_counts[0] > 1, transport.descriptor_counts
    assert "DuplicateRequestError" in seen["error_5"] and "OutOfBlocks" in seen["error_6"]
    assert seen["kept"], seen
    for (_, words), reason in zip(forged_offers(tables_of_sender()), seen["refusals"], strict=True):
        assert words in reason, (words, reason)


def tables_of_sender() -> Any:
    """Tables holding request 8 as the sender holds it (for its forged offers' words)."""
    pool, tables = side(SENDER_PAGES)
    with_holes(tables)
    make_request(tables, 8)
    return tables


def test_a_sender_killed_before_the_read_frees_every_group_on_the_receiver(tmp_path):
    class KillTheSenderFirst(NixlTransport):
        victim: subprocess.Popen

        def move(self, *args: Any, **kwargs: Any) -> None:
            self.victim.kill()  # after the accept, before the READ is posted
            self.victim.wait()
            super().move(*args, **kwargs)

    with spawn(__file__, "killed_sender", tmp_path=tmp_path) as other:
        process = other.process
        pool, tables = side(RECEIVER_PAGES)
        free_before = pool.num_free
        transport = other.connect(pool, KillTheSenderFirst)
        transport.victim = process
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S)
        with pytest.raises(TransferError, match="receiving request 7 failed.*died"):
            receiver.recv(timeout=PEER_WAIT_S)
        assert 7 not in tables and len(tables) == 0
        conserved(receiver, pool, free_before)
    assert process.returncode == -signal.SIGKILL


def test_a_receiver_killed_mid_read_leaves_the_sender_every_group(tmp_path):
    with spawn(__file__, "read_then_die", tmp_path=tmp_path) as other:
        process = other.process
        pool, tables = side(SENDER_PAGES)
        make_request(tables, 7)
        want = group_bytes(tables, 7)
        free_before = pool.num_free
        transport = other.connect(pool)
        sender = KvSender(tables, transport, timeout_s=PEER_WAIT_S)
        with pytest.raises(TransferError, match="sending request 7.*receiver's process died"):
            sender.send(7)
        assert same_per_group(group_bytes(tables, 7), want)
        conserved(sender, pool, free_before)
        process.wait(timeout=PEER_WAIT_S)
    assert process.returncode == -signal.SIGKILL
