"""Heterogeneous tensor parallelism, without NIXL: the descriptors that address head ranges and
layer ranges inside blocks (regions.py), applied here as plain memmoves between host pools
(what a NIXL READ does with them), gather two TP-2 shards into a TP-1 pool and split a TP-1
pool into two shards byte-exact; and an offer whose TP shard does not fit the receiver is
refused, naming why, before anything is allocated (offers.py); a split send settles the stream
it is given (tp_legs.py)."""

from __future__ import annotations

import ctypes

import kvpool
import numpy as np
import pytest
from kvpool.transfer.offers import Offer, decode_offer, layout_fingerprint
from kvpool.transfer.pieces import GROUPED, plan_pieces
from kvpool.transfer.protocol import PROTOCOL_VERSION
from kvpool.transfer.regions import Side, TpShard, kv_descriptors, tp_shard

FULL = kvpool.KvLayout(3, 4, 8, 16)  # 3 layers, 4 KV heads


def full_kv(num_blocks: int, seed: int) -> list[np.ndarray]:
    """Per (layer, K|V) the full model's KV of ``num_blocks`` blocks."""
    rng = np.random.default_rng(seed)
    shape = (num_blocks, FULL.block_size, FULL.num_kv_heads, FULL.head_dim)
    return [rng.standard_normal(shape).astype(np.float16) for _ in range(2 * FULL.num_layers)]


def views(pool: kvpool.Pool) -> list:
    return [
        v
        for layer in range(pool.layout.num_layers)
        for v in (pool.k_view(layer), pool.v_view(layer))
    ]


def write(pool: kvpool.Pool, ids: np.ndarray, kv: list[np.ndarray], heads: tuple[int, int]) -> None:
    for view, full in zip(views(pool), kv):
        view[ids] = full[:, :, heads[0] : heads[1]]


def read(
    local: Side, remote: Side, pieces: list, layers: tuple[int, int], heads: tuple[int, int]
) -> int:
    """A NIXL READ of the descriptors, done by memmove; the descriptor count."""
    dst, src = kv_descriptors(local, remote, pieces, layers, heads)
    assert dst.shape == src.shape and (dst[:, 1] == src[:, 1]).all()
    for (to, nbytes, _), (frm, _, _) in zip(dst.tolist(), src.tolist()):
        ctypes.memmove(to, frm, nbytes)
    return len(dst)


def side(pool: kvpool.Pool, shard: TpShard, ids: np.ndarray) -> Side:
    return Side(pool.base_ptr, pool.layout, shard.first_head, ids)


def test_two_tp2_shards_gather_into_a_tp1_pool_byte_exact():
    kv = full_kv(5, seed=1)
    src_ids = np.array([9, 3, 4, 5, 11], np.int32)
    dst_ids = np.array([0, 1, 2, 3, 7], np.int32)
    receiver = kvpool.Pool(FULL, 16, device="host")
    whole = TpShard(0, 1, 4)
    counts = []
    for rank in range(2):
        shard = tp_shard(FULL.tp_shard(2), (rank, 2))
        assert shard.heads == FULL.tp_head_range(2, rank)
        sender = kvpool.Pool(FULL.tp_shard(2), 16, device="host")
        write(sender, src_ids, kv, shard.heads)
        pieces = plan_pieces(GROUPED, src_ids, dst_ids, 5)
        counts.append(
            read(
                side(receiver, whole, dst_ids),
                side(sender, shard, src_ids),
                pieces,
                (0, 3),
                shard.heads,
            )
        )
    for view, full in zip(views(receiver), kv):
        np.testing.assert_array_equal(view[dst_ids], full)
    # One row per (block, layer, K|V, token): a head range of a token row is what is contiguous.
    assert counts == [5 * 3 * 2 * 16] * 2


class _NoAgent:
    """A NIXL agent's registration calls, for a staging buffer used without NIXL."""

    def register_memory(self, *args: object) -> None:
        return None

    def deregister_memory(self, registration: object) -> None:
        pass


@pytest.mark.parametrize("layer_ranges", [[(0, 3)], [(0, 1), (1, 3)]])
def test_two_tp2_shards_gather_through_a_staging_buffer_byte_exact(layer_ranges):
    """``gather_rows``: each shard's blocks whole (a descriptor per run of blocks for every
    layer, per block for a layer range) into a staging buffer, then ``scatter_rows`` puts each
    (layer, K|V, token) row at its heads in the wider blocks."""
    from kvpool.transfer.nixl_staging import StagingBuffer
    from kvpool.transfer.regions import gather_rows

    kv = full_kv(5, seed=3)
    src_ids = np.array([9, 3, 4, 5, 11], np.int32)  # three runs
    dst_ids = np.array([0, 6, 2, 3, 7], np.int32)
    receiver = kvpool.Pool(FULL, 16, device="host")
    staging = StagingBuffer(receiver, 5, _NoAgent(), "DRAM", 0)
    whole = TpShard(0, 1, 4)
    counts = []
    for rank in range(2):
        shard = tp_shard(FULL.tp_shard(2), (rank, 2))
        sender = kvpool.Pool(FULL.tp_shard(2), 16, device="host")
        write(sender, src_ids, kv, shard.heads)
        for layers in layer_ranges:
            plan = gather_rows(
                side(receiver, whole, dst_ids),
                side(sender, shard, src_ids),
                layers,
                shard.heads,
                staging.base_ptr,
            )
            assert plan is not None
            dst, src, rows = plan
            assert (dst[:, 1] == src[:, 1]).all()
            for (to, nbytes, _), (frm, _, _) in zip(dst.tolist(), src.tolist()):
                ctypes.memmove(to, frm, nbytes)  # the READ
            staging.scatter_rows(dst_ids, rows)
            counts.append(len(dst))
    for view, full in zip(views(receiver), kv):
        np.testing.assert_array_equal(view[dst_ids], full)
    assert counts == ([3, 3] if layer_ranges == [(0, 3)] else [5, 5, 5, 5])
    # Not a gather (the same heads on both sides, or this side narrower): None.
    shard = tp_shard(FULL.tp_shard(2), (0, 2))
    narrow = kvpool.Pool(FULL.tp_shard(2), 16, device="host")
    assert (
        gather_rows(
            side(narrow, shard, src_ids), side(narrow, shard, src_ids), (0, 3), shard.heads, 0
        )
        is None
    )
    assert (
        gather_rows(
            side(narrow, shard, src_ids), side(receiver, whole, dst_ids), (0, 3), shard.heads, 0
        )
        is None
    )
    staging.close()


def test_a_tp1_pool_splits_into_two_shards_byte_exact_and_by_layer_range():
    kv = full_kv(4, seed=2)
    src_ids = np.array([2, 3, 4, 5], np.int32)
    dst_ids = np.array([6, 7, 1, 0], np.int32)
    sender = kvpool.Pool(FULL, 16, device="host")
    write(sender, src_ids, kv, (0, 4))
    whole = TpShard(0, 1, 4)
    pieces = plan_pieces(GROUPED, src_ids, dst_ids, 4)
    for rank in range(2):
        shard = tp_shard(FULL.tp_shard(2), (rank, 2))
        receiver = kvpool.Pool(FULL.tp_shard(2), 16, device="host")
        read(
            side(receiver, shard, dst_ids),
            side(sender, whole, src_ids),
            pieces,
            (0, 1),
            shard.heads,
        )
        got = views(receiver)
        for i, full in enumerate(kv):
            want = full[:, :, shard.heads[0] : shard.heads[1]]
            if i < 2:  # layer 0's K and V
                np.testing.assert_array_equal(got[i][dst_ids], want)
            else:
                assert not got[i][dst_ids].any(), f"plane {i} was written before its layer range"
        read(
            side(receiver, shard, dst_ids),
            side(sender, whole, src_ids),
            pieces,
            (1, 3),
            shard.heads,
        )
        for view, full in zip(got, kv):
            np.testing.assert_array_equal(
                view[dst_ids], full[:, :, shard.heads[0] : shard.heads[1]]
            )


def test_same_heads_on_both_sides_coalesce_runs_and_layer_ranges():
    ids = np.array([0, 1, 2, 5], np.int32)
    pool = kvpool.Pool(FULL, 8, device="host")
    whole = Side(pool.base_ptr, FULL, 0, ids)
    pieces = plan_pieces(GROUPED, ids, ids, 4)
    dst, _ = kv_descriptors(whole, whole, pieces, (0, 3), (0, 4))
    assert dst[:, 1].tolist() == [3 * FULL.block_bytes, FULL.block_bytes]  # two runs
    dst, _ = kv_descriptors(whole, whole, pieces, (1, 3), (0, 4))
    layer = FULL.strides()["layer"]
    assert dst[:, 1].tolist() == [2 * layer] * 4  # one row per block
    assert dst[0, 0] == pool.base_ptr + layer


def offer(tp: dict | None, layout: kvpool.KvLayout, **fields) -> dict:
    message = {
        "kind": "offer",
        "version": PROTOCOL_VERSION,
        "request_id": 3,
        "num_tokens": 20,
        "layout": layout_fingerprint(layout),
        "src_ids": [0, 1],
        "mode": "auto",
        "chunk_blocks": 8,
        **fields,
    }
    if tp is not None:
        message["tp"] = tp
    return message


def rank(r: int, size: int = 2, heads: int = 4) -> dict:
    return TpShard(r, size, heads).wire()


def test_an_offer_of_a_fitting_shard_is_decoded_with_it():
    got = decode_offer(offer(rank(1), FULL.tp_shard(2)), FULL, None, gather=True)
    assert isinstance(got, Offer) and got.tp == TpShard(1, 2, 4)
    assert got.sender_layout == FULL.tp_shard(2)
    # A TP-2 receiver rank takes its heads from a TP-1 sender (the split).
    got = decode_offer(offer(None, FULL), FULL.tp_shard(2), TpShard(1, 2, 4))
    assert isinstance(got, Offer) and got.tp == TpShard(0, 1, 4)


@pytest.mark.parametrize(
    ("tp", "sender_layout", "receiver_tp", "gather", "words"),
    [
        (rank(1, heads=8), FULL.tp_shard(2), None, True, "the model has 8 KV heads (sender) != 4"),
        (
            {**rank(1), "heads": [0, 2]},
            FULL.tp_shard(2),
            None,
            True,
            "holds heads [2, 4], the offer says [0, 2]",
        ),
        (rank(1), FULL, None, True, "the sender's pool has 4"),
        (rank(1, size=3), FULL.tp_shard(2), None, True, "no whole number of heads"),
        (rank(1), FULL.tp_shard(2), None, False, "gather every sender rank's heads"),
        (
            rank(0),
            FULL.tp_shard(2),
            TpShard(1, 2, 4),
            True,
            "needs heads [2, 4]; the sender (rank 0 of 2) holds [0, 2]",
        ),
        ({"rank": 2, "size": 2}, FULL.tp_shard(2), None, True, "bad tp"),
        ("rank 0", FULL.tp_shard(2), None, True, "tp must be an object"),
        (rank(1), kvpool.KvLayout(3, 2, 16, 16), None, True, "head_dim 16 (sender) != 8"),
    ],
)
def test_a_shard_that_does_not_fit_is_refused_naming_why(
    tp, sender_layout, receiver_tp, gather, words
):
    receiver_layout = FULL if receiver_tp is None else FULL.tp_shard(receiver_tp.size)
    got = decode_offer(offer(tp, sender_layout), receiver_layout, receiver_tp, gather)
    assert isinstance(got, str) and words in got, got


def test_offers_without_tp_between_whole_pools_are_checked_as_before():
    got = decode_offer(offer(None, FULL.tp_shard(2)), FULL)
    assert got == "layout mismatch: num_kv_heads 2 (sender) != 4 (receiver), block_bytes " + (
        f"{FULL.tp_shard(2).block_bytes} (sender) != {FULL.block_bytes} (receiver)"
    )


def test_tp_shard_checks_its_argument():
    with pytest.raises(TypeError):
        tp_shard(FULL, [0, 2])
    with pytest.raises(ValueError):
        tp_shard(FULL, (2, 2))


def test_layer_by_layer_and_tp_need_nixl_and_uniform_tables():
    from kvpool import TransferError
    from kvpool.transfer import KvReceiver, KvSender
    from kvpool.transfer.testing import fake_transport_pair

    pool = kvpool.Pool(FULL, 16, device="host")
    tables = kvpool.BlockTables(pool, 4, 8)
    tables.add(3, 20)
    a, b = fake_transport_pair()
    sender = KvSender(tables, a)
    with pytest.raises(TransferError, match="needs a one-sided transport"):
        sender.send(3, layers_ready=0)  # refused before offering: nothing sent
    with pytest.raises(TypeError):
        sender.send(3, layers_ready=1.0)
    assert 3 in tables and sender.leases.live() == []
    # A receiver over a two-sided transport refuses a layered offer before allocating.
    receiver_pool = kvpool.Pool(FULL, 16, device="host")
    receiver = KvReceiver(kvpool.BlockTables(receiver_pool, 4, 8), b)
    a.send_control(offer(None, FULL, layers_ready=1))
    with pytest.raises(TransferError, match="need a one-sided transport"):
        receiver.recv(timeout=5)
    assert receiver_pool.num_free == 16 and a.recv_control(5)["kind"] == "refuse"
    spec = kvpool.ModelKvSpec.uniform(FULL)
    hybrid = kvpool.HybridTables(kvpool.Pool.for_spec(spec, 16, device="host"), spec)
    with pytest.raises(TransferError, match="uniform BlockTables"):
        KvSender(hybrid, a, tp=(0, 2))


def test_a_split_send_settles_the_stream_it_is_given(monkeypatch):
    """KvSplitSender.send waits for the caller's ``stream`` (the one that wrote the KV), the
    pool's own only by default, before any receiver may READ: observed through the call it
    makes (on a host pool ``settle_source`` has nothing to wait for). Legs that are gone
    fail the offer; the request stays."""
    from kvpool import TransferError
    from kvpool.transfer import tp_legs
    from kvpool.transfer.transport import PeerGone

    class GoneLeg:
        one_sided = True

        def send_control(self, message: dict) -> None:
            raise PeerGone("the receiver is gone")

    settled: list = []
    monkeypatch.setattr(tp_legs, "settle_source", lambda pool, stream=None: settled.append(stream))
    pool = kvpool.Pool(FULL, 16, device="host")
    tables = kvpool.BlockTables(pool, 4, 8)
    tables.add(3, 20)
    sender = tp_legs.KvSplitSender(tables, [GoneLeg(), GoneLeg()])
    writer_stream = object()
    for stream in (writer_stream, None):
        with pytest.raises(TransferError, match="the receiver is gone"):
            sender.send(3, stream=stream)
    assert settled == [writer_stream, None]
    assert 3 in tables and sender.leases.live() == []
