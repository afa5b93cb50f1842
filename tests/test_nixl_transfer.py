"""The KV transfer protocol over NIXL (UCX) between two processes on loopback, host pools:
the receiver READs the sender's blocks byte-exact into its own ids, one descriptor per run of
blocks contiguous on both sides, and both pools end consistent. The test extra installs
nixl-cu13, so CI runs these; a developer's tree without NIXL skips them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import kvpool
import numpy as np
import pytest
from kvpool.transfer import KvReceiver, plan_pieces
from kvpool.transfer.pieces import GROUPED

try:
    from kvpool.transfer.nixl_transport import NixlTransport, load_nixl

    load_nixl()
except ImportError as e:  # pragma: no cover - depends on the environment
    # CI (bin/test.sh sets KVPOOL_TEST_WHEEL=1) installs nixl-cu13 with the test extra: there a
    # missing NIXL fails the run instead of skipping these tests quietly.
    if os.environ.get("KVPOOL_TEST_WHEEL") == "1":
        raise
    pytest.skip(f"NIXL is not importable ({e}); install kvpool[nixl]", allow_module_level=True)

LAYOUT_ARGS = (2, 2, 64, 16)  # 8 KiB blocks


def fill(pool, tables, rid, num_tokens, seed):
    tables.add(rid, num_tokens)
    rng = np.random.default_rng(seed)
    for layer in range(pool.layout.num_layers):
        for view in (pool.k_view(layer), pool.v_view(layer)):
            ids = tables.blocks(rid)
            view[ids] = rng.standard_normal(view[ids].shape).astype(view.dtype)


SENDER = textwrap.dedent(
    """
    import sys
    import kvpool
    from kvpool.transfer import KvSender
    from kvpool.transfer.nixl_transport import NixlTransport
    sys.path.insert(0, sys.argv[2])
    from test_nixl_transfer import LAYOUT_ARGS, fill

    pool = kvpool.Pool(kvpool.KvLayout(*LAYOUT_ARGS), 256, device="host")
    tables = kvpool.BlockTables(pool, 64, 64)
    for rid in range(100, 110):  # holes, so the request's ids form several runs
        tables.add(rid, 16 * 3)
    for rid in range(100, 110, 2):
        tables.free(rid)
    fill(pool, tables, 7, 16 * 40 + 5, seed=7)
    fill(pool, tables, 8, 16 * 64, seed=8)
    transport = NixlTransport.connect(0, sys.argv[1], pool, timeout=60)
    sender = KvSender(tables, transport, timeout_s=60)
    for rid in (7, 8):
        sender.send(rid).wait()
    sender.check_invariants()
    assert 7 not in tables and 8 not in tables and pool.num_used == 15, pool.num_used
    print("sender ok")
    transport.close()
    """
)


def test_blocks_move_byte_exact_between_two_processes_through_nixl(tmp_path):
    rendezvous = tmp_path / "rendezvous.json"
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(rendezvous), str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        pool = kvpool.Pool(kvpool.KvLayout(*LAYOUT_ARGS), 256, device="host")
        tables = kvpool.BlockTables(pool, 64, 64)
        tables.add(1, 16 * 5)  # the receiver's ids differ from the sender's
        transport = NixlTransport.connect(1, rendezvous, pool, timeout=60)
        receiver = KvReceiver(tables, transport, timeout_s=60)
        for rid, num_tokens in ((7, 16 * 40 + 5), (8, 16 * 64)):
            receiver.recv(timeout=60).wait()
            receiver.check_invariants()
            assert tables.num_tokens(rid) == num_tokens
            # What the sender wrote, made again here from the same seed.
            want_pool = kvpool.Pool(kvpool.KvLayout(*LAYOUT_ARGS), 256, device="host")
            want_tables = kvpool.BlockTables(want_pool, 64, 64)
            fill(want_pool, want_tables, rid, num_tokens, seed=rid)
            for layer in range(pool.layout.num_layers):
                for got_view, want_view in (
                    (pool.k_view(layer), want_pool.k_view(layer)),
                    (pool.v_view(layer), want_pool.v_view(layer)),
                ):
                    np.testing.assert_array_equal(
                        got_view[tables.blocks(rid)].view(np.uint8),
                        want_view[want_tables.blocks(rid)].view(np.uint8),
                    )
        out, _ = sender.communicate(timeout=60)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
    assert sender.returncode == 0, out
    assert "sender ok" in out
    # Request 7 sits in the sender's holes (several runs), request 8 in one run on both sides.
    assert transport.descriptor_counts[1] == 1
    assert transport.descriptor_counts[0] > 1
    print("NIXL descriptors per request:", transport.descriptor_counts)
    transport.close()


def test_descriptors_coalesce_runs_contiguous_on_both_sides():
    from kvpool.transfer.nixl_transport import run_descriptors

    src = np.array([4, 5, 6, 9, 10, 2], np.int32)
    dst = np.array([0, 1, 3, 4, 5, 6], np.int32)
    pieces = plan_pieces(GROUPED, src, dst, len(src))
    rows = run_descriptors(1000, 10, src, pieces)
    assert rows.tolist() == [[1040, 20, 0], [1060, 10, 0], [1090, 20, 0], [1020, 10, 0]]
