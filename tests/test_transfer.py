"""The KV transfer protocol on host pools over the in-process fake transport: byte-exact
moves into the receiver's own block ids, refusals before anything moves, interruptions that
leave both pools consistent, nothing leaked."""

from __future__ import annotations

import threading

import kvpool
import numpy as np
import pytest
from kvpool.transfer import (
    AUTO,
    GROUPED,
    STAGED,
    KvReceiver,
    KvSender,
    TransferError,
    plan_pieces,
)
from kvpool.transfer.testing import fake_transport_pair

LAYOUT = kvpool.KvLayout(2, 2, 64, 4)


def _side(layout=LAYOUT, num_blocks=64):
    pool = kvpool.Pool(layout, num_blocks, device="host")
    return pool, kvpool.BlockTables(pool, 32, 32)


def _slab(pool):
    views = [
        f(layer) for layer in range(pool.layout.num_layers) for f in (pool.k_view, pool.v_view)
    ]
    return views


def _fill(pool, tables, rid, num_tokens, rng):
    tables.add(rid, num_tokens)
    for view in _slab(pool):
        ids = tables.blocks(rid)
        view[ids] = rng.standard_normal(view[ids].shape).astype(view.dtype)


def _blocks_bytes(pool, ids):
    return [np.array(v[ids]) for v in _slab(pool)]


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
        t = sender.send(rid, **send_kw)
        t.wait(timeout=5)
    except TransferError as e:
        out["send_error"] = e
    th.join()
    return out.get("send_error"), out.get("recv_error"), out.get("transfer")


@pytest.mark.parametrize("mode", [STAGED, GROUPED])
@pytest.mark.parametrize("num_tokens", [1, 4, 27, 128])
def test_blocks_arrive_byte_exact_in_the_receivers_own_ids(mode, num_tokens):
    rng = np.random.default_rng(num_tokens)
    src_pool, src_tables = _side()
    dst_pool, dst_tables = _side()
    dst_tables.add(99, 4 * 7)  # the receiver's ids differ from the sender's
    src_tables.add(50, 3)
    _fill(src_pool, src_tables, 7, num_tokens, rng)
    src_tables.free(50)
    src_ids = src_tables.blocks(7)
    want = _blocks_bytes(src_pool, src_ids)
    a, b = fake_transport_pair()
    send_err, recv_err, _ = _run(
        KvSender(src_tables, a, mode=mode, chunk_bytes=3 * LAYOUT.block_bytes),
        KvReceiver(dst_tables, b),
        7,
    )
    assert send_err is None and recv_err is None
    dst_ids = dst_tables.blocks(7)
    assert not np.array_equal(dst_ids, src_ids[: len(dst_ids)]) or len(dst_ids) == 0
    for w, g in zip(want, _blocks_bytes(dst_pool, dst_ids)):
        np.testing.assert_array_equal(w.view(np.uint8), g.view(np.uint8))
    assert dst_tables.num_tokens(7) == num_tokens
    assert 7 not in src_tables and src_pool.num_used == 0  # freed after the send completed
    src_tables.check_invariants()
    dst_tables.check_invariants()


def test_pieces_batch_blocks_not_one_call_per_block():
    src = np.array([4, 5, 6, 9, 10, 2], np.int32)
    dst = np.array([0, 1, 3, 4, 5, 6], np.int32)
    assert plan_pieces(GROUPED, src, dst, 100) == [(0, 2), (2, 1), (3, 2), (5, 1)]
    assert plan_pieces(STAGED, src, dst, 4) == [(0, 4), (4, 2)]
    src_pool, src_tables = _side()
    dst_pool, dst_tables = _side()
    _fill(src_pool, src_tables, 1, 4 * 30, np.random.default_rng(0))
    a, b = fake_transport_pair()
    _run(
        KvSender(src_tables, a, mode=STAGED, chunk_bytes=16 * LAYOUT.block_bytes),
        KvReceiver(dst_tables, b),
        1,
    )
    assert a.num_data_calls == 2 and b.num_data_calls == 2  # 30 blocks in two staged chunks


@pytest.mark.parametrize(
    "field,value",
    [
        ("head_dim", 128),
        ("block_size", 8),
        ("num_kv_heads", 4),
        ("dtype", "bfloat16"),
        ("num_layers", 3),
    ],
)
def test_a_layout_mismatch_is_refused_before_anything_moves(field, value):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=4, dtype="float16")
    args[field] = value
    src_pool, src_tables = _side()
    dst_pool, dst_tables = _side(kvpool.KvLayout(**args))
    _fill(src_pool, src_tables, 3, 10, np.random.default_rng(1))
    a, b = fake_transport_pair()
    send_err, recv_err, _ = _run(KvSender(src_tables, a), KvReceiver(dst_tables, b), 3)
    assert isinstance(send_err, TransferError) and isinstance(recv_err, TransferError)
    assert f"{field} " in str(send_err) and "layout mismatch" in str(recv_err)
    assert send_err.request_id == 3
    assert a.num_data_calls == 0 and b.num_data_calls == 0
    assert 3 in src_tables and src_pool.num_used == 3  # the sender still owns its blocks
    assert 3 not in dst_tables and dst_pool.num_used == 0
    src_tables.check_invariants()
    dst_tables.check_invariants()


def test_a_receiver_out_of_blocks_refuses_and_changes_nothing():
    src_pool, src_tables = _side()
    dst_pool, dst_tables = _side(num_blocks=4)
    dst_tables.add(1, 8)
    _fill(src_pool, src_tables, 2, 4 * 5, np.random.default_rng(2))
    a, b = fake_transport_pair()
    send_err, recv_err, _ = _run(KvSender(src_tables, a), KvReceiver(dst_tables, b), 2)
    assert "OutOfBlocksError" in str(send_err) and isinstance(recv_err, TransferError)
    assert dst_pool.num_used == 2 and list(dst_tables.request_ids()) == [1]
    assert src_pool.num_used == 5 and 2 in src_tables


def test_a_duplicate_request_id_is_refused():
    src_pool, src_tables = _side()
    dst_pool, dst_tables = _side()
    dst_tables.add(5, 3)
    _fill(src_pool, src_tables, 5, 9, np.random.default_rng(3))
    a, b = fake_transport_pair()
    send_err, recv_err, _ = _run(KvSender(src_tables, a), KvReceiver(dst_tables, b), 5)
    assert "DuplicateRequestError" in str(send_err)
    assert dst_pool.num_used == 1 and src_pool.num_used == 3


@pytest.mark.parametrize("mode", [STAGED, GROUPED])
@pytest.mark.parametrize("fail_after", [0, 1, 2])
def test_a_sender_dying_mid_transfer_leaves_both_pools_consistent(mode, fail_after):
    src_pool, src_tables = _side()
    dst_pool, dst_tables = _side()
    dst_tables.add(1, 5)
    for rid in range(10, 18):  # leave holes, so the sender's ids are not one run
        src_tables.add(rid, 4)
    for rid in range(10, 18, 2):
        src_tables.free(rid)
    _fill(src_pool, src_tables, 4, 4 * 9, np.random.default_rng(4))
    ids = src_tables.blocks(4)
    assert len(plan_pieces(GROUPED, ids, ids, 1)) > 2
    before = src_pool.num_used
    a, b = fake_transport_pair(fail_after_sends=fail_after)
    send_err, recv_err, _ = _run(
        KvSender(src_tables, a, mode=mode, chunk_bytes=2 * LAYOUT.block_bytes),
        KvReceiver(dst_tables, b),
        4,
    )
    assert isinstance(send_err, TransferError) and isinstance(recv_err, TransferError)
    assert 4 in src_tables and src_pool.num_used == before  # the sender still owns them
    assert 4 not in dst_tables and dst_pool.num_used == 2  # the receiver freed what it took
    src_tables.check_invariants()
    dst_tables.check_invariants()
    dst_pool.check_invariants(exact_refs=True)


def test_a_receiver_gone_before_answering_fails_the_send_keeping_the_blocks():
    src_pool, src_tables = _side()
    _fill(src_pool, src_tables, 1, 9, np.random.default_rng(6))
    a, b = fake_transport_pair()
    b.close()
    with pytest.raises(TransferError):
        KvSender(src_tables, a, timeout_s=1).send(1)
    assert 1 in src_tables and src_pool.num_used == 3


def test_no_offer_within_the_timeout_raises_with_nothing_allocated():
    dst_pool, dst_tables = _side()
    a, b = fake_transport_pair()
    with pytest.raises(TransferError, match="offer"):
        KvReceiver(dst_tables, b).recv(timeout=0.05)
    assert dst_pool.num_used == 0


def test_a_bad_mode_is_refused():
    _, tables = _side()
    with pytest.raises(ValueError, match="mode"):
        KvSender(tables, fake_transport_pair()[0], mode="scatter")


def test_many_transfers_in_a_row_leak_nothing():
    rng = np.random.default_rng(7)
    src_pool, src_tables = _side()
    dst_pool, dst_tables = _side()
    a, b = fake_transport_pair()
    sender, receiver = KvSender(src_tables, a), KvReceiver(dst_tables, b)
    for rid in range(20):
        _fill(src_pool, src_tables, rid, int(rng.integers(1, 60)), rng)
        want = _blocks_bytes(src_pool, src_tables.blocks(rid))
        send_err, recv_err, _ = _run(sender, receiver, rid)
        assert send_err is None and recv_err is None
        for w, g in zip(want, _blocks_bytes(dst_pool, dst_tables.blocks(rid))):
            np.testing.assert_array_equal(w, g)
        dst_tables.free(rid)
    assert src_pool.num_used == 0 and dst_pool.num_used == 0
    src_tables.check_invariants()
    dst_tables.check_invariants()


def test_auto_sends_few_runs_grouped_and_scattered_blocks_staged():
    rng = np.random.default_rng(8)
    src_pool, src_tables = _side()
    dst_pool, dst_tables = _side()
    a, b = fake_transport_pair()
    sender = KvSender(src_tables, a, mode=AUTO, chunk_bytes=64 * LAYOUT.block_bytes)
    _fill(src_pool, src_tables, 1, 4 * 6, rng)  # fresh pools: one run on both sides
    _run(sender, KvReceiver(dst_tables, b), 1)
    assert a.num_data_calls == 1  # one grouped send of the run, no staging
    for rid in range(10, 30):
        src_tables.add(rid, 4)
    for rid in range(10, 30, 2):
        src_tables.free(rid)
    _fill(src_pool, src_tables, 2, 4 * 12, rng)
    want = _blocks_bytes(src_pool, src_tables.blocks(2))
    before = a.num_data_calls
    _run(sender, KvReceiver(dst_tables, b), 2)
    assert a.num_data_calls - before == 1  # 12 scattered blocks: one staged chunk
    for w, g in zip(want, _blocks_bytes(dst_pool, dst_tables.blocks(2))):
        np.testing.assert_array_equal(w, g)


@pytest.mark.parametrize("request_id", ["5", None, 1.5, True, -1, 2**64])
def test_an_offer_with_a_bad_request_id_is_refused(request_id):
    # The peer is untrusted: a wrong type (a TypeError from tables.add) is refused like a
    # wrong value, with nothing allocated and the sender told.
    from kvpool.transfer.protocol import PROTOCOL_VERSION

    dst_pool, dst_tables = _side()
    a, b = fake_transport_pair()
    a.send_control(
        {
            "kind": "offer",
            "version": PROTOCOL_VERSION,
            "request_id": request_id,
            "num_tokens": 4,
            "layout": kvpool.transfer.layout_fingerprint(LAYOUT),
            "src_ids": [0],
            "mode": STAGED,
            "chunk_blocks": 1,
        }
    )
    with pytest.raises(TransferError, match="refused|Error"):
        KvReceiver(dst_tables, b).recv(timeout=5)
    assert dst_pool.num_used == 0 and len(dst_tables) == 0
    assert a.recv_control(timeout=5)["kind"] != "accept"
