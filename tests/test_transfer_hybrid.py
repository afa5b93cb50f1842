"""Transfers of hybrid requests (HybridTables) through the same KvSender / KvReceiver as uniform
ones, on host pools over the in-process fake transport: every group moves (full, sliding
window, chunked local, MLA latent, recurrent state), byte-exact per group into the receiver's
own page ids; a window that slid moves only its live pages; a spec mismatch, a malformed
offer, a duplicate id or a receiver out of pages is refused with nothing allocated; a dying
or silent peer, an abort or a passed deadline returns every page of every group on both
sides (free + evictable + used + in_flight == total, the tables' own invariants)."""

from __future__ import annotations

import threading
from typing import Any

import kvpool
import numpy as np
import pytest
from hybrid_pages import (
    PAGE_BYTES,
    fill_groups,
    group_bytes,
    group_ids,
    mixed_spec,
    same_per_group,
    side,
    table_shapes,
)
from hypothesis import given
from hypothesis import strategies as st
from kvpool.transfer import (
    AUTO,
    GROUPED,
    STAGED,
    KvReceiver,
    KvSender,
    TransferError,
    spec_fingerprint,
)
from kvpool.transfer.kinds import HybridRequests
from kvpool.transfer.offers import PROTOCOL_VERSION, Offer, decode_hybrid_offer
from kvpool.transfer.testing import fake_transport_pair


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _run(sender, receiver, rid, **send_kw):
    """Receive in a thread, send here; returns (send error, recv error, recv transfer)."""
    out: dict = {}

    def receive():
        try:
            t = receiver.recv(timeout=5)
            t.wait(timeout=5)
            out["transfer"] = t
        except TransferError as e:
            out["recv_error"] = e

    th = threading.Thread(target=receive)
    th.start()
    try:
        sender.send(rid, **send_kw).wait(timeout=5)
    except TransferError as e:
        out["send_error"] = e
    th.join()
    return out.get("send_error"), out.get("recv_error"), out.get("transfer")


def _with_holes(tables, first_rid=500):
    """Requests added and every other one freed, so a later request's pages are scattered."""
    for rid in range(first_rid, first_rid + 6):
        tables.add(rid, 9)
    for rid in range(first_rid, first_rid + 6, 2):
        tables.free(rid)


def _grow(tables, rid, num_tokens, slide_to=None):
    """A request of ``num_tokens`` tokens; with ``slide_to``, grown there one call later, so
    its window and chunk groups dropped the pages its next queries no longer see."""
    tables.add(rid, num_tokens)
    if slide_to is not None:
        tables.append_tokens(rid, slide_to - num_tokens)


def _snapshot(pool, tables):
    """Per request and per group, its pages and their bytes; the pool's counts."""
    requests = {}
    for rid in range(1000):
        if rid in tables:
            requests[rid] = (
                table_shapes(tables, rid),
                [ids.tolist() for ids in group_ids(tables, rid)],
                group_bytes(tables, rid),
                tables.next_query(rid),
            )
    return (pool.num_free, pool.num_used, pool.num_evictable), requests


def _unchanged(before, pool, tables, endpoint):
    """Every page of every group back where it was, no lease left, the invariants hold."""
    endpoint.check_invariants()
    assert endpoint.leases.live() == [] and endpoint.leases.in_flight == 0
    counts, requests = _snapshot(pool, tables)
    assert counts == before[0]
    assert requests.keys() == before[1].keys()
    for rid, (shapes, ids, data, next_query) in requests.items():
        was = before[1][rid]
        assert (shapes, ids, next_query) == (was[0], was[1], was[3]), rid
        assert all(np.array_equal(a, b) for a, b in zip(data, was[2])), rid


@pytest.mark.parametrize("mode", [STAGED, GROUPED, AUTO])
@pytest.mark.parametrize("num_tokens,slide_to", [(1, None), (37, None), (100, 101), (90, 161)])
def test_a_mixed_request_lands_byte_exact_per_group(mode, num_tokens, slide_to):
    src_pool, src = side()
    dst_pool, dst = side()
    dst.add(99, 40)  # the receiver's ids differ from the sender's
    _with_holes(src)
    _grow(src, 7, num_tokens, slide_to)
    fill_groups(src, 7, seed=7)
    want, shapes, next_query = group_bytes(src, 7), table_shapes(src, 7), src.next_query(7)
    src_ids = src.request_pages(7)[:, 2]
    a, b = fake_transport_pair()
    sender = KvSender(src, a, mode=mode, chunk_bytes=3 * PAGE_BYTES)
    receiver = KvReceiver(dst, b)
    send_err, recv_err, _ = _run(sender, receiver, 7)
    assert send_err is None and recv_err is None
    assert table_shapes(dst, 7) == shapes and dst.next_query(7) == next_query
    got = group_bytes(dst, 7)
    for group, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"group {group}")
    assert not np.array_equal(dst.request_pages(7)[:, 2], src_ids)  # its own ids
    assert 7 not in src and src_pool.num_used == 3 * 5 + 6  # the 3 kept requests of 9 tokens
    sender.check_invariants()
    receiver.check_invariants()


def test_a_window_that_slid_moves_only_its_live_pages():
    src_pool, src = side()
    dst_pool, dst = side()
    _grow(src, 3, 100, slide_to=101)
    src.append_tokens(3, 20)  # next_query 101, 121 tokens
    fill_groups(src, 3, seed=3)
    # Window 24 over 8-token pages: the queries from 101 on see tokens 78.., pages 9..15;
    # chunks of 32: the chunk of 101 starts at 96, page 3 only.
    assert src.table(3, 0)[0] == 9 and len(src.table(3, 0)[1]) == 7
    assert src.table(3, 4)[0] == 3 and len(src.table(3, 4)[1]) == 1
    offers = []
    a, b = fake_transport_pair()
    send_control = a.send_control
    a.send_control = lambda m: (offers.append(m), send_control(m))[1]  # type: ignore[method-assign]
    want = group_bytes(src, 3)
    held = src.num_pages(3)
    send_err, recv_err, _ = _run(KvSender(src, a), KvReceiver(dst, b), 3)
    assert send_err is None and recv_err is None
    (offer,) = [m for m in offers if m["kind"] == "offer"]
    assert offer["next_query"] == 101 and offer["num_tokens"] == 121
    assert [g["first_page"] for g in offer["groups"]] == [9, 0, 0, 0, 3]
    assert sum(len(g["page_ids"]) for g in offer["groups"]) == held == dst_pool.num_used
    assert dst.table(3, 0)[0] == 9 and len(dst.table(3, 0)[1]) == 7
    assert dst.next_query(3) == 101
    assert same_per_group(group_bytes(dst, 3), want)
    # The receiver's request goes on as the sender's would have: the next step (queries
    # from 121 on: keys from 98, page 12) slides it as it would have slid there.
    twin_pool, twin = side()
    _grow(twin, 3, 100, slide_to=101)
    twin.append_tokens(3, 20)
    for tables in (dst, twin):
        tables.append_tokens(3, 8)
    assert table_shapes(dst, 3) == table_shapes(twin, 3) and dst.table(3, 0)[0] == 12
    dst.check_invariants()


def test_a_page_of_one_group_landing_in_another_is_caught_by_the_per_group_check(monkeypatch):
    # The mutation: the receiver lists its full group's first page where the MLA group's
    # first page goes and back. Every page still arrives (the request's bytes as a set are
    # the same), so only a check per group sees it.
    src_pool, src = side()
    dst_pool, dst = side()
    _grow(src, 4, 60)
    fill_groups(src, 4, seed=4)
    want = group_bytes(src, 4)
    add = HybridRequests.add

    def swapped_add(self, offer):
        ids = add(self, offer).copy()
        counts = [n for _, n in offer.group_pages]
        full, mla = sum(counts[:1]), sum(counts[:3])  # group 1's first page, group 3's
        ids[[full, mla]] = ids[[mla, full]]
        return ids

    monkeypatch.setattr(HybridRequests, "add", swapped_add)
    a, b = fake_transport_pair()
    send_err, recv_err, _ = _run(KvSender(src, a), KvReceiver(dst, b), 4)
    assert send_err is None and recv_err is None
    got = group_bytes(dst, 4)
    assert sorted(p.tobytes() for g in got for p in g) == sorted(
        p.tobytes() for g in want for p in g
    )
    assert not same_per_group(got, want)  # what the round trip above checks
    assert not np.array_equal(got[1], want[1]) and not np.array_equal(got[3], want[3])
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[2], want[2])


@pytest.mark.parametrize(
    "receiver_spec,words",
    [
        (mixed_spec(window=16), "group 0 window 24 (sender) != 16 (receiver)"),
        (mixed_spec(head_dim=32), "group 1 head_dim 64 (sender) != 32 (receiver)"),
        (mixed_spec(state_bytes=6000), "group 2 bytes_per_layer 5000 (sender) != 6000"),
        (
            kvpool.ModelKvSpec(mixed_spec().groups, 2 * PAGE_BYTES),
            "page_bytes 4096 (sender) != 8192 (receiver)",
        ),
        (
            kvpool.ModelKvSpec(
                [
                    *mixed_spec().groups[:3],
                    kvpool.KvGroup.mla_latent([3], 64, 16, "bfloat16"),
                    mixed_spec().groups[4],
                ],
                PAGE_BYTES,
            ),
            "group 3 dtype 'float16' (sender) != 'bfloat16' (receiver)",
        ),
        (
            kvpool.ModelKvSpec(
                [kvpool.KvGroup.full([0, 5], 1, 64), *mixed_spec().groups[1:]], PAGE_BYTES
            ),
            "group 0 kind 'sliding_window' (sender) != 'full' (receiver)",
        ),
        (
            kvpool.ModelKvSpec(
                [kvpool.KvGroup.sliding_window([0, 4, 5], 24, 1, 64), *mixed_spec().groups[1:4]],
                PAGE_BYTES,
            ),
            "num_groups 5 (sender) != 4 (receiver)",
        ),
    ],
)
def test_a_spec_mismatch_is_refused_naming_the_field_before_anything_moves(receiver_spec, words):
    src_pool, src = side()
    dst_pool, dst = side(spec=receiver_spec)
    _grow(src, 3, 50)
    fill_groups(src, 3, seed=3)
    before_src, before_dst = _snapshot(src_pool, src), _snapshot(dst_pool, dst)
    a, b = fake_transport_pair()
    sender, receiver = KvSender(src, a), KvReceiver(dst, b)
    send_err, recv_err, _ = _run(sender, receiver, 3)
    assert isinstance(send_err, TransferError) and isinstance(recv_err, TransferError)
    assert "spec mismatch" in str(recv_err) and words in str(send_err), str(send_err)
    assert a.num_data_calls == 0 and b.num_data_calls == 0
    _unchanged(before_src, src_pool, src, sender)
    _unchanged(before_dst, dst_pool, dst, receiver)


def test_uniform_and_hybrid_tables_refuse_each_others_offers():
    layout = kvpool.KvLayout(2, 2, 64, 8)
    uniform_pool = kvpool.Pool(layout, 32, device="host")
    uniform = kvpool.BlockTables(uniform_pool, 8, 16)
    hybrid_pool, hybrid = side()
    uniform.add(1, 20)
    _grow(hybrid, 2, 20)
    for src, dst, rid, words in (
        (uniform, hybrid, 1, "uniform layout (one block list); this receiver's tables are Hybrid"),
        (hybrid, uniform, 2, "hybrid model (a spec of groups); this receiver's tables are unif"),
    ):
        a, b = fake_transport_pair()
        send_err, recv_err, _ = _run(KvSender(src, a), KvReceiver(dst, b), rid)
        assert words in str(send_err) and words in str(recv_err)
        assert rid in src and rid not in dst
    assert uniform_pool.num_used == 3 and hybrid_pool.num_used == hybrid.num_pages(2)
    with pytest.raises(TypeError, match="BlockTables or HybridTables"):
        KvSender(uniform_pool, fake_transport_pair()[0])  # type: ignore[arg-type]


def test_a_receiver_out_of_pages_and_a_duplicate_id_are_refused_with_nothing_allocated():
    src_pool, src = side()
    dst_pool, dst = side(num_blocks=24)
    _grow(dst, 5, 30)
    _grow(src, 5, 30)  # an id the receiver holds
    _grow(src, 6, 160)  # more pages than the receiver has free
    for rid in (5, 6):
        fill_groups(src, rid, seed=rid)
    before_src, before_dst = _snapshot(src_pool, src), _snapshot(dst_pool, dst)
    a, b = fake_transport_pair()
    sender, receiver = KvSender(src, a), KvReceiver(dst, b)
    for rid, words in ((5, "DuplicateRequestError"), (6, "OutOfBlocksError")):
        send_err, recv_err, _ = _run(sender, receiver, rid)
        assert words in str(send_err) and words in str(recv_err), (send_err, recv_err)
        _unchanged(before_src, src_pool, src, sender)
        _unchanged(before_dst, dst_pool, dst, receiver)
    assert a.num_data_calls == 0


@pytest.mark.parametrize("mode", [STAGED, GROUPED])
@pytest.mark.parametrize("fail_after", [0, 1, 3])
def test_a_sender_dying_mid_transfer_returns_every_group_on_both_sides(mode, fail_after):
    src_pool, src = side()
    dst_pool, dst = side()
    _grow(dst, 1, 20)
    _with_holes(src)
    _grow(src, 4, 90, slide_to=161)
    fill_groups(src, 4, seed=4)
    ids = src.request_pages(4)[:, 2]
    assert len(kvpool.transfer.plan_pieces(GROUPED, ids, ids, 1)) > 3  # several runs
    before_src, before_dst = _snapshot(src_pool, src), _snapshot(dst_pool, dst)
    a, b = fake_transport_pair(fail_after_sends=fail_after)
    sender = KvSender(src, a, mode=mode, chunk_bytes=2 * PAGE_BYTES)
    receiver = KvReceiver(dst, b)
    send_err, recv_err, _ = _run(sender, receiver, 4)
    assert isinstance(send_err, TransferError) and isinstance(recv_err, TransferError)
    _unchanged(before_src, src_pool, src, sender)  # the sender keeps its request, bytes intact
    _unchanged(before_dst, dst_pool, dst, receiver)  # the receiver freed every group's pages


def _receiver_with_a_silent_peer(timeout_s=5.0):
    pool, tables = side()
    clock = FakeClock()
    a, b = fake_transport_pair(clock=clock)
    b.on_idle = lambda end: setattr(clock, "now", clock.now + 1.0)  # silence: time passes
    return pool, tables, KvReceiver(tables, b, timeout_s=timeout_s, clock=clock), a, clock


def _answers(sender_end):
    out = []
    while True:
        try:
            out.append(sender_end.recv_control(timeout=0))
        except (TimeoutError, kvpool.transfer.PeerGone):
            return out


def _offer_of(rid=7, tokens=100, slide_to=101, **changes):
    """A valid offer of a mixed request, as a sender with those pages would make it, with
    ``changes`` to its fields."""
    pool, tables = side()
    _with_holes(tables)
    _grow(tables, rid, tokens, slide_to)
    fields, _ = HybridRequests(tables).describe(rid)
    offer = {
        "kind": "offer",
        "version": PROTOCOL_VERSION,
        "request_id": rid,
        **fields,
        "mode": STAGED,
        "chunk_blocks": 2,
        "timeout_s": 5.0,
    }
    offer.update(changes)
    return offer


def test_a_sender_silent_after_the_accept_meets_the_deadline_and_every_group_is_returned():
    pool, tables, receiver, sender_end, _ = _receiver_with_a_silent_peer()
    before = _snapshot(pool, tables)
    sender_end.send_control(_offer_of())
    with pytest.raises(TransferError, match="deadline"):
        receiver.recv(timeout=1)
    _unchanged(before, pool, tables, receiver)
    accept, abort = _answers(sender_end)
    assert accept["kind"] == "accept" and len(accept["dst_ids"]) > 5
    assert abort["kind"] == "abort" and "deadline" in abort["reason"]


def test_an_abort_returns_every_group_on_both_sides():
    # (A passed deadline: the silent sender above. `reap_expired` does not give up a transfer
    # whose completion is ready, as a host pool's is at once.)
    clock = FakeClock()
    src_pool, src = side()
    dst_pool, dst = side()
    _grow(src, 2, 70, slide_to=75)
    fill_groups(src, 2, seed=2)
    before_src, before_dst = _snapshot(src_pool, src), _snapshot(dst_pool, dst)
    a, b = fake_transport_pair(clock=clock)
    sender = KvSender(src, a, timeout_s=5.0, clock=clock)
    receiver = KvReceiver(dst, b, timeout_s=5.0, clock=clock)
    out: dict[str, Any] = {}

    def receive() -> None:
        try:
            out["transfer"] = receiver.recv(timeout=5)
        except TransferError as e:
            out["error"] = e

    th = threading.Thread(target=receive)
    th.start()
    sent = sender.send(2, free_after=False)
    th.join()
    assert "transfer" in out, out
    landed = out["transfer"]  # its bytes are in, its completion not yet seen: in flight
    assert receiver.leases.in_flight == dst.num_pages(2) == src.num_pages(2)
    receiver.check_invariants()
    landed.abort()
    sent.wait()  # the sender's sends completed: it keeps the request (free_after=False)
    _unchanged(before_src, src_pool, src, sender)
    _unchanged(before_dst, dst_pool, dst, receiver)
    assert _answers(a)[-1]["kind"] == "abort"


def test_a_forked_request_moves_and_its_parent_keeps_the_shared_pages():
    src_pool, src = side()
    dst_pool, dst = side()
    _grow(src, 1, 64)
    fill_groups(src, 1, seed=1)
    src.fork(1, 2)  # every page of 2 shared with 1
    want = group_bytes(src, 2)
    a, b = fake_transport_pair()
    sender = KvSender(src, a)
    send_err, recv_err, _ = _run(sender, KvReceiver(dst, b), 2)
    assert send_err is None and recv_err is None
    assert same_per_group(group_bytes(dst, 2), want)
    assert 2 not in src and same_per_group(group_bytes(src, 1), want)
    sender.check_invariants()
    src.check_invariants()


def test_a_prefix_cached_senders_pages_go_evictable_after_the_send():
    spec = mixed_spec()
    src_pool = kvpool.Pool.for_spec(spec, 96, device="host", enable_prefix_caching=True)
    src = kvpool.HybridTables(src_pool, spec)
    dst_pool, dst = side()
    src.add_request(1, list(range(70)))
    src.append_tokens(1, 1, [70])  # the prompt's pages are cached now
    fill_groups(src, 1, seed=1)
    want, shapes = group_bytes(src, 1), table_shapes(src, 1)
    a, b = fake_transport_pair()
    sender = KvSender(src, a)
    send_err, recv_err, _ = _run(sender, KvReceiver(dst, b), 1)
    assert send_err is None and recv_err is None
    assert table_shapes(dst, 1) == shapes
    assert same_per_group(group_bytes(dst, 1), want)
    assert src_pool.num_evictable > 0 and src_pool.num_used == 0
    sender.check_invariants()  # free + evictable + used + in_flight == total


# Malformed hybrid offers, each with the words its refusal must name.
def _group_edit(group, **entry):
    offer = _offer_of()
    offer["groups"][group].update(entry)
    return offer


def _malformed():
    good = _offer_of()
    full_ids = good["groups"][1]["page_ids"]
    return [
        (_group_edit(0, page_ids=good["groups"][0]["page_ids"][:-1]), "group 0: 3 pages"),
        (_group_edit(0, first_page=0), "group 0: 4 pages from page 0 offered"),
        (_group_edit(2, page_ids=[1, 2, 3]), "group 2: 3 pages from page 0"),
        (_group_edit(1, page_ids=[*full_ids[:-1], 2**31]), "group 1's page_ids must be int32"),
        (_group_edit(1, page_ids=[*full_ids[:-1], -1]), "group 1's page_ids must be int32"),
        (_group_edit(1, page_ids=[*full_ids[:-1], 1.0]), "group 1's page_ids must be int32"),
        (_group_edit(1, page_ids=[*full_ids[:-1], True]), "group 1's page_ids must be int32"),
        (_group_edit(3, page_ids=[full_ids[0], *good["groups"][3]["page_ids"][1:]]), "repeat"),
        (_group_edit(1, page_ids="0,1"), "page_ids of type str"),
        (_offer_of(next_query=102), "0 <= next_query <= num_tokens"),
        (_offer_of(next_query=None), "0 <= next_query <= num_tokens"),
        (_offer_of(num_tokens=2**63), "num_tokens 9223372036854775808 is out of range"),
        (_offer_of(groups=good["groups"][:4]), "a list of 5 entries, got 4"),
        (_offer_of(groups={"0": []}), "a list of 5 entries, got dict"),
        (_offer_of(spec="mixed"), "the offer's spec must be an object"),
        (_offer_of(spec={**good["spec"], "groups": None}), "groups of type NoneType"),
        (_offer_of(request_id=-1), "request_id"),
        (_offer_of(mode="scatter"), "unknown mode"),
    ]


def test_malformed_hybrid_offers_are_refused_before_anything_is_allocated():
    for message, words in _malformed():
        pool, tables, receiver, sender_end, _ = _receiver_with_a_silent_peer()
        before = _snapshot(pool, tables)
        sender_end.send_control(message)
        with pytest.raises(TransferError, match="refused") as raised:
            receiver.recv(timeout=1)
        assert words in str(raised.value), (words, str(raised.value))
        _unchanged(before, pool, tables, receiver)
        (answer,) = _answers(sender_end)
        assert answer["kind"] == "refuse" and words in answer["reason"]


def test_num_tokens_past_the_cores_range_is_refused():
    offer = _offer_of(num_tokens=2**63, next_query=2**63)
    reason = decode_hybrid_offer(offer, mixed_spec())
    assert isinstance(reason, str) and "out of range" in reason


# Any JSON value, with the shapes a hybrid offer's fields take over-represented.
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)
_FIELDS = ["kind", "version", "request_id", "num_tokens", "next_query", "spec", "groups", "mode"]


@st.composite
def _messages(draw):
    shape = draw(st.sampled_from(["valid", "field", "drop", "group", "page", "anything"]))
    if shape == "anything":
        return draw(_json)
    num_tokens = draw(st.integers(1, 60))
    offer = _offer_of(tokens=num_tokens, slide_to=num_tokens + draw(st.integers(0, 40)))
    if shape == "field":
        offer[draw(st.sampled_from(_FIELDS))] = draw(_json)
    elif shape == "drop":
        del offer[draw(st.sampled_from(_FIELDS))]
    elif shape == "group":
        group = draw(st.integers(0, 4))
        offer["groups"][group][draw(st.sampled_from(["first_page", "page_ids"]))] = draw(_json)
    elif shape == "page":
        group = offer["groups"][draw(st.integers(0, 4))]
        if group["page_ids"]:
            i = draw(st.integers(0, len(group["page_ids"]) - 1))
            group["page_ids"][i] = draw(
                _json | st.integers(0, 40) | st.integers(2**31 - 2, 2**31 + 2)
            )
    return offer


@given(_messages())
def test_no_hybrid_message_leaves_a_page_held_and_the_sender_always_gets_an_answer(message):
    pool, tables, receiver, sender_end, _ = _receiver_with_a_silent_peer(timeout_s=3.0)
    sender_end.send_control(message)  # and then nothing: no data ever arrives
    with pytest.raises(TransferError):
        receiver.recv(timeout=1)
    assert pool.num_used == 0 and len(tables) == 0 and receiver.leases.in_flight == 0
    receiver.check_invariants()
    answers = _answers(sender_end)
    assert answers and answers[0]["kind"] in ("refuse", "accept")
    if answers[0]["kind"] == "accept":
        assert answers[1]["kind"] == "abort"


@given(_json | _messages())
def test_decode_hybrid_offer_never_raises_and_a_decoded_offer_is_well_typed(message):
    spec = mixed_spec()
    decoded = decode_hybrid_offer(message, spec, spec_fingerprint(spec))
    if isinstance(decoded, str):
        return
    assert isinstance(decoded, Offer) and decoded.src_ids.dtype == np.int32
    flat = [p for g in message["groups"] for p in g["page_ids"]]
    assert np.array_equal(decoded.src_ids, np.asarray(flat, dtype=np.int64))
    assert len(set(flat)) == len(flat) and len(decoded.group_pages) == spec.num_groups
    assert type(decoded.next_query) is int and 0 <= decoded.next_query <= decoded.num_tokens


def test_a_prefix_caching_receiver_evicts_cached_pages_to_make_room():
    spec = mixed_spec()
    dst_pool = kvpool.Pool.for_spec(spec, 32, device="host", enable_prefix_caching=True)
    dst = kvpool.HybridTables(dst_pool, spec)
    dst.add_request(1, list(range(90)))
    dst.append_tokens(1, 1, [90])
    dst.cache_computed(1)
    dst.free(1)  # its pages are evictable now
    src_pool, src = side()
    _grow(src, 2, 100, slide_to=101)
    fill_groups(src, 2, seed=2)
    want = group_bytes(src, 2)
    assert dst_pool.num_free < src.num_pages(2) <= dst_pool.num_free + dst_pool.num_evictable
    a, b = fake_transport_pair()
    receiver = KvReceiver(dst, b)
    send_err, recv_err, _ = _run(KvSender(src, a), receiver, 2)
    assert send_err is None and recv_err is None
    assert same_per_group(group_bytes(dst, 2), want)
    receiver.check_invariants()  # free + evictable + used + in_flight == total
