"""Staging buffers of the NIXL transport (two processes on loopback, host pools, UCX): a request
whose blocks are scattered on the sender is packed into the sender's buffer and offered
``staged_at``; one whose blocks land scattered on the receiver is READ into the receiver's
buffer and scattered from it; either way one descriptor moves it, byte-exact. A request larger
than a buffer moves run by run. An offer staged outside the sender's buffer is refused before
anything is allocated; a refused offer leaves the sender's buffer free for the next request; a
sender killed before the READ, or a deadline passing during it, leaves every buffer free.

Host pools get a buffer only when asked (``staging_bytes``; a CUDA pool has one by default), so
these run in CI; tests/test_nixl_gpu.py moves CUDA pools through their buffers. The test
process is the receiver; this file, run as a script, is the sender (tests/nixl_peers.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from typing import Any

import kvpool
import numpy as np
import pytest
from kvpool import InvalidArgumentError, TransferError
from kvpool.transfer import KvReceiver, KvSender
from kvpool.transfer.nixl_staging import (
    DEFAULT_CUDA_STAGING_BYTES,
    StagingCost,
    runs,
    staging_blocks,
)
from nixl_peers import (
    PEER_WAIT_S,
    STAGE_ALWAYS,
    NixlTransport,
    conserved,
    fill,
    request_bytes,
    spawn,
)
from test_nixl_faults import Clock, deadline_passes_during_the_read

LAYOUT = kvpool.KvLayout(2, 2, 64, 16)  # 16 KiB blocks, 16 tokens each
NUM_BLOCKS = 96
STAGING_BLOCKS = 24
STAGING_BYTES = STAGING_BLOCKS * LAYOUT.block_bytes
REQUESTS = {7: 16 * 20 + 5, 8: 16 * 30}  # 21 blocks (fit the buffer), 30 (do not)


def holed_tables(pool: kvpool.Pool, holes: bool) -> kvpool.BlockTables:
    """Tables whose next requests get scattered ids (``holes``: every other 2-block request of
    the first 48 blocks freed) or one run (a fresh pool)."""
    tables = kvpool.BlockTables(pool, 32, 64)
    if holes:
        for rid in range(100, 124):
            tables.add(rid, 16 * 2)
        for rid in range(100, 124, 2):
            tables.free(rid)
    return tables


def connect(rendezvous: str, pool: kvpool.Pool) -> NixlTransport:
    """The peer's transport (agent 0) with a buffer of ``STAGING_BLOCKS``, staging always."""
    transport = NixlTransport.connect(
        0, rendezvous, pool, timeout=PEER_WAIT_S, staging_bytes=STAGING_BYTES
    )
    transport.staging_cost = STAGE_ALWAYS
    return transport


def sender(rendezvous: str, case: str) -> dict:
    """The peer: sends requests 7 and 8 (``scattered`` / ``fresh`` source), or for ``refused``
    request 7 twice (the receiver refuses the second: it holds 7) then request 8."""
    pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="host")
    tables = holed_tables(pool, holes=case != "fresh")
    for rid, num_tokens in REQUESTS.items():
        fill(pool, tables, rid, num_tokens)
    transport = connect(rendezvous, pool)
    kv_sender = KvSender(tables, transport, timeout_s=PEER_WAIT_S)
    report: dict = {"runs": {rid: runs(tables.blocks(rid)) for rid in REQUESTS}}
    if case == "deadline":  # the receiver gives the transfer up: 7 is kept here
        try:
            kv_sender.send(7)
        except TransferError as e:
            report["error"] = str(e)
        report["kept"] = 7 in tables
    elif case == "refused":
        kv_sender.send(7, free_after=False).wait()
        try:
            kv_sender.send(7)
        except TransferError as e:
            report["refused"] = str(e)
        report["holder_after_refusal"] = transport.staging.holder
        kv_sender.send(8).wait()
    else:
        for rid in REQUESTS:
            kv_sender.send(rid).wait()
            report.setdefault("sent", []).append(rid)
    kv_sender.check_invariants()
    report["holder"] = transport.staging.holder
    transport.close()
    return report


def sender_forged(rendezvous: str, staged_at: str) -> dict:
    """The peer: offers request 7 saying it is staged at ``staged_at`` (JSON) without packing
    anything, and reports how the send ended."""
    pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="host")
    tables = holed_tables(pool, holes=True)
    fill(pool, tables, 7, REQUESTS[7])
    transport = connect(rendezvous, pool)
    transport.stage_source = lambda request_id, ids: {"staged_at": json.loads(staged_at)}
    try:
        KvSender(tables, transport, timeout_s=PEER_WAIT_S).send(7)
        outcome = "sent"
    except TransferError as e:
        outcome = str(e)
    transport.close()
    return {"outcome": outcome, "kept": 7 in tables}


def expected_bytes() -> dict[int, list[bytes]]:
    """Each request's bytes as ``fill`` writes them, from a pool of its own."""
    pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="host")
    tables = kvpool.BlockTables(pool, 16, 64)
    out = {}
    for rid, num_tokens in REQUESTS.items():
        fill(pool, tables, rid, num_tokens)
        out[rid] = request_bytes(pool, tables, rid)
    return out


@pytest.mark.parametrize(
    "source, destination",
    [("scattered", "fresh"), ("fresh", "scattered"), ("scattered", "scattered")],
)
def test_scattered_requests_move_as_one_descriptor_through_the_staging_buffers(
    tmp_path, source, destination
):
    pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="host")
    tables = holed_tables(pool, holes=destination == "scattered")
    free_before = pool.num_free
    want = expected_bytes()
    with spawn(__file__, "sender", source, tmp_path=tmp_path) as other:
        transport = other.connect(pool, staging_bytes=STAGING_BYTES)
        transport.staging_cost = STAGE_ALWAYS
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S)
        for _ in REQUESTS:
            receiver.recv(timeout=PEER_WAIT_S).wait()
        report = other.finish()
    receiver.check_invariants()
    for rid in REQUESTS:
        assert request_bytes(pool, tables, rid) == want[rid], rid
    assert runs(tables.blocks(7)) > 1 if destination == "scattered" else True
    # Request 7 fits a buffer: one descriptor. Request 8 does not: a descriptor per run of
    # blocks contiguous on both sides, as without staging.
    counts = transport.descriptor_counts
    assert counts[0] == 1, counts
    assert counts[1] > 1 and counts[1] >= max(report["runs"]["8"], runs(tables.blocks(8)))
    assert report["holder"] is None and transport.staging.holder is None
    for rid in REQUESTS:
        tables.free(rid)
    conserved(receiver, pool, free_before)


def test_a_refused_offer_gives_the_senders_buffer_back_for_the_next_request(tmp_path):
    pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="host")
    tables = holed_tables(pool, holes=False)
    want = expected_bytes()
    with spawn(__file__, "sender", "refused", tmp_path=tmp_path) as other:
        transport = other.connect(pool, staging_bytes=STAGING_BYTES)
        transport.staging_cost = STAGE_ALWAYS
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S)
        receiver.recv(timeout=PEER_WAIT_S).wait()
        with pytest.raises(TransferError, match="request 7"):
            receiver.recv(timeout=PEER_WAIT_S)  # 7 again: tables.add refuses a duplicate id
        receiver.recv(timeout=PEER_WAIT_S).wait()
        report = other.finish()
    assert "refused" in report and report["holder_after_refusal"] is None
    assert transport.descriptor_counts[0] == 1  # request 7, staged
    assert request_bytes(pool, tables, 7) == want[7]
    assert request_bytes(pool, tables, 8) == want[8]
    receiver.check_invariants()


def test_a_sender_killed_before_a_staged_read_frees_the_receivers_blocks_and_buffer(tmp_path):
    class KillTheSenderFirst(NixlTransport):
        victim: subprocess.Popen

        def move(self, *args: Any, **kwargs: Any) -> None:
            self.victim.kill()  # after the accept, before the READ into the buffer is posted
            self.victim.wait()
            super().move(*args, **kwargs)

    pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="host")
    tables = holed_tables(pool, holes=True)  # request 7 lands scattered: through the buffer
    free_before = pool.num_free
    with spawn(__file__, "sender", "scattered", tmp_path=tmp_path) as other:
        transport = other.connect(pool, KillTheSenderFirst, staging_bytes=STAGING_BYTES)
        transport.staging_cost = STAGE_ALWAYS
        transport.victim = other.process
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S)
        with pytest.raises(TransferError, match="receiving request 7 failed.*died"):
            receiver.recv(timeout=PEER_WAIT_S)
        assert 7 not in tables and transport.staging.holder is None
        conserved(receiver, pool, free_before)
    assert other.process.returncode == -signal.SIGKILL


def test_a_deadline_passing_during_a_staged_read_frees_both_sides_and_their_buffers(tmp_path):
    clock = Clock()
    DeadlinePassesDuringTheRead = deadline_passes_during_the_read(clock)
    pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="host")
    tables = holed_tables(pool, holes=True)  # into this side's buffer, from the sender's
    free_before = pool.num_free
    with spawn(__file__, "sender", "deadline", tmp_path=tmp_path) as other:
        transport = other.connect(pool, DeadlinePassesDuringTheRead, staging_bytes=STAGING_BYTES)
        transport.staging_cost = STAGE_ALWAYS
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S, clock=clock)
        with pytest.raises(TransferError, match="request 7 passed its deadline"):
            receiver.recv(timeout=PEER_WAIT_S)
        assert transport.descriptor_counts == [1]  # staged on both sides
        assert 7 not in tables and transport.staging.holder is None
        conserved(receiver, pool, free_before)
        report = other.finish()
    assert "receiver gave the transfer up" in report["error"], report
    assert report["kept"] and report["holder"] is None, report


@pytest.mark.parametrize(
    "staged_at, reason",
    [
        ("1000", "staged at block 1000 lie outside the sender's staging buffer of 24 blocks"),
        ("4", "staged at block 4 lie outside"),  # 4 + 21 blocks > 24
        ("-1", "staged_at must be an int32 block offset >= 0, got -1"),
        ('"0"', "staged_at must be an int32 block offset >= 0, got '0'"),
    ],
)
def test_an_offer_staged_outside_the_senders_buffer_is_refused_before_allocating(
    tmp_path, staged_at, reason
):
    pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="host")
    tables = kvpool.BlockTables(pool, 16, 64)
    free_before = pool.num_free
    with spawn(__file__, "sender_forged", staged_at, tmp_path=tmp_path) as other:
        transport = other.connect(pool, staging_bytes=STAGING_BYTES)
        transport.staging_cost = STAGE_ALWAYS
        receiver = KvReceiver(tables, transport, timeout_s=PEER_WAIT_S)
        with pytest.raises(TransferError) as refused:
            receiver.recv(timeout=PEER_WAIT_S)
        report = other.finish()
    assert reason in str(refused.value), refused.value
    assert reason in report["outcome"] and report["kept"]
    assert 7 not in tables
    conserved(receiver, pool, free_before)


def test_the_buffers_size_and_what_is_worth_staging():
    pool = kvpool.Pool(LAYOUT, NUM_BLOCKS, device="host")
    bb = LAYOUT.block_bytes
    assert staging_blocks(pool, None, "DRAM") == 0  # host pools: only when asked
    assert staging_blocks(pool, None, "VRAM") == min(DEFAULT_CUDA_STAGING_BYTES // bb, NUM_BLOCKS)
    assert staging_blocks(pool, 5 * bb + 1, "DRAM") == 5
    assert staging_blocks(pool, 10**12, "VRAM") == NUM_BLOCKS  # at most the pool
    assert staging_blocks(pool, 0, "VRAM") == 0
    with pytest.raises(TypeError, match="staging_bytes must be an int"):
        staging_blocks(pool, "1", "VRAM")
    with pytest.raises(InvalidArgumentError, match="staging_bytes must be >= 0"):
        staging_blocks(pool, -1, "VRAM")
    assert [runs(np.array(x, np.int32)) for x in ([], [3], [3, 4, 5], [3, 5, 6], [5, 4])] == [
        0,
        1,
        1,
        2,
        2,
    ]


# (block bytes, blocks) of one H200's run (bench/results/2026-12-04_7b88e0e_h200), with
# whether the staged case beat the scattered one there (one descriptor per block).
MEASURED = [
    ((64 << 10, 4), False),  # staged 378 us, scattered 78
    ((64 << 10, 16), False),  # 367, 200
    ((64 << 10, 64), True),  # 387, 871
    ((64 << 10, 1024), True),  # 509, 14189
    ((2 << 20, 4), False),  # 319, 69
    ((2 << 20, 16), False),  # 353, 147
    ((2 << 20, 64), True),  # 453, 570
    ((2 << 20, 4096), True),  # 8939, 44804
]


@pytest.mark.parametrize("shape, staged_won", MEASURED)
def test_the_default_costs_choose_as_measured(shape, staged_won):
    block_bytes, blocks = shape
    assert StagingCost().worth(blocks, blocks * block_bytes) == staged_won
    assert not StagingCost().worth(1, blocks * block_bytes)  # one run: nothing to save


if __name__ == "__main__":
    role = {"sender": sender, "sender_forged": sender_forged}[sys.argv[1]]
    print("RESULT " + json.dumps(role(sys.argv[-1], sys.argv[2])), flush=True)
