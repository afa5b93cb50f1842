"""An untrusted sender against a receiver on host pools: a malformed offer is refused whole
before anything is allocated (the sender told why), a sender that goes silent after the accept
meets the transfer's deadline (its blocks returned, the sender told), and no message at all,
however malformed, leaves a block held. The peer is played by hand on the fake transport's
other end, with a fake clock, so nothing here waits on real time."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvpool.transfer import STAGED, KvReceiver, TransferError, layout_fingerprint
from kvpool.transfer.protocol import PROTOCOL_VERSION, Offer, decode_offer
from kvpool.transfer.testing import fake_transport_pair

LAYOUT = kvpool.KvLayout(2, 2, 64, 4)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _receiver(timeout_s=5.0):
    pool = kvpool.Pool(LAYOUT, 32, device="host")
    tables = kvpool.BlockTables(pool, 32, 32)
    clock = FakeClock()
    a, b = fake_transport_pair(clock=clock)
    # The silent peer: whenever the receiver waits for data, time passes instead.
    b.on_idle = lambda end: setattr(clock, "now", clock.now + 1.0)
    return pool, tables, KvReceiver(tables, b, timeout_s=timeout_s, clock=clock), a


def _offer(**changes):
    offer = {
        "kind": "offer",
        "version": PROTOCOL_VERSION,
        "request_id": 7,
        "num_tokens": 9,
        "layout": layout_fingerprint(LAYOUT),
        "src_ids": [0, 1, 2],
        "mode": STAGED,
        "chunk_blocks": 2,
    }
    offer.update(changes)
    return offer


def _answers(sender_end):
    out = []
    while True:
        try:
            out.append(sender_end.recv_control(timeout=0))
        except (TimeoutError, kvpool.transfer.PeerGone):
            return out


def _nothing_held(pool, tables, receiver):
    assert pool.num_used == 0 and len(tables) == 0 and receiver.leases.in_flight == 0
    receiver.check_invariants()


@pytest.mark.parametrize(
    "src_ids",
    [
        [0, 1, 2**31],
        [0, -1, 2],
        [0, 1, 2**64],
        ["0", 1, 2],
        [0, 1.5, 2],
        [True, 1, 2],
        [0, 1, None],
    ],
)
def test_an_offer_of_non_int32_source_ids_is_refused_before_anything_is_allocated(src_ids):
    # Before: tables.add ran first, then np.asarray(src_ids, int32) raised OverflowError (or
    # ValueError / TypeError) with the request and its blocks kept and the sender unanswered.
    pool, tables, receiver, sender_end = _receiver()
    sender_end.send_control(_offer(src_ids=src_ids))
    with pytest.raises(TransferError, match="src_ids"):
        receiver.recv(timeout=1)
    _nothing_held(pool, tables, receiver)
    (answer,) = _answers(sender_end)
    assert answer["kind"] == "refuse" and "src_ids" in answer["reason"]


@pytest.mark.parametrize("pieces_sent", [0, 1])
def test_a_sender_silent_after_the_accept_meets_the_deadline_and_everything_is_returned(
    pieces_sent,
):
    # Before: recv() waited for the data forever (timeout_s and recv(timeout=) did not apply
    # once an offer was accepted), holding the request's blocks.
    pool, tables, receiver, sender_end = _receiver(timeout_s=5.0)
    for _ in range(pieces_sent):  # staged pieces of 2 blocks: the first arrives, then silence
        payload = np.zeros(2 * LAYOUT.block_bytes, np.uint8)
        sender_end.send(payload.ctypes.data, payload.nbytes, None)
    sender_end.send_control(_offer())
    with pytest.raises(TransferError, match="deadline"):
        receiver.recv(timeout=1)
    _nothing_held(pool, tables, receiver)
    accept, abort = _answers(sender_end)
    assert accept["kind"] == "accept" and len(accept["dst_ids"]) == 3
    assert abort["kind"] == "abort" and abort["request_id"] == 7 and "deadline" in abort["reason"]
    assert not sender_end.peer_alive()  # and the transport is torn down


# Any JSON value, with the shapes an offer's fields take over-represented.
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)
_fields = [
    "kind",
    "version",
    "request_id",
    "num_tokens",
    "layout",
    "src_ids",
    "mode",
    "chunk_blocks",
]


@st.composite
def _messages(draw):
    shape = draw(st.sampled_from(["valid", "field", "drop", "ids", "anything"]))
    if shape == "anything":
        return draw(_json)
    num_tokens = draw(st.integers(0, 40))
    offer = _offer(
        num_tokens=num_tokens,
        src_ids=draw(st.permutations(range(64)))[: -(-num_tokens // LAYOUT.block_size)],
        chunk_blocks=draw(st.integers(1, 4)),
        mode=draw(st.sampled_from(["staged", "grouped", "auto"])),
    )
    if shape == "field":
        offer[draw(st.sampled_from(_fields))] = draw(_json)
    elif shape == "drop":
        del offer[draw(st.sampled_from(_fields))]
    elif shape == "ids" and offer["src_ids"]:
        i = draw(st.integers(0, len(offer["src_ids"]) - 1))
        offer["src_ids"][i] = draw(_json | st.integers(2**31 - 2, 2**31 + 2))
    return offer


@given(_messages())
def test_no_message_leaves_a_block_held_and_the_sender_always_gets_an_answer(message):
    pool, tables, receiver, sender_end = _receiver(timeout_s=3.0)
    sender_end.send_control(message)  # and then nothing: no data ever arrives
    with pytest.raises(TransferError):
        t = receiver.recv(timeout=1)
        t.wait()  # an empty request (0 tokens) completes at accept
        tables.free(t.request_id)
        raise TransferError("accepted and completed with nothing to move")
    _nothing_held(pool, tables, receiver)
    answers = _answers(sender_end)
    assert answers, "the sender was never answered"
    assert answers[0]["kind"] in ("refuse", "accept")
    if answers[0]["kind"] == "accept" and answers[1:]:
        assert answers[1]["kind"] == "abort"


@given(_json | _messages())
def test_decode_offer_never_raises_and_a_decoded_offer_is_well_typed(message):
    decoded = decode_offer(message, LAYOUT)
    if isinstance(decoded, str):
        return
    assert isinstance(decoded, Offer)
    assert decoded.src_ids.dtype == np.int32 and len(decoded.src_ids) == len(message["src_ids"])
    assert np.array_equal(decoded.src_ids, np.asarray(message["src_ids"], dtype=np.int64))
    assert len(set(message["src_ids"])) == len(message["src_ids"])
    assert type(decoded.request_id) is int and 0 <= decoded.request_id < 2**64
