"""Two GPUs: tensor-parallel decode against one device, and KV transfers between two processes
over NCCL (byte-exact, the receiver's decode against the reference, an interrupted transfer).
Marked gpu2: skipped with fewer than two GPUs."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile

import kvpool
import multigpu_workers as workers
import numpy as np
import pytest
from attention_check import assert_attention_close

pytestmark = pytest.mark.gpu2
os.environ.update(workers.MULTICAST_OFF)


def _run_pair(targets: list, expected_messages: int, timeout_s: float = 240) -> list:
    """Start one spawned process per target (fn, args), collect their messages, join them;
    a process still running at the end is killed and the test fails."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, results)) for fn, args in targets]
    for p in procs:
        p.start()
    messages = []
    try:
        while len(messages) < expected_messages:
            try:
                msg = results.get(timeout=timeout_s)
            except queue.Empty:
                break
            messages.append(msg)
            if msg[0] == "error":
                break
    finally:
        for p in procs:
            p.join(timeout=30)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
    errors = [m for m in messages if m[0] == "error"]
    assert not errors, "\n".join(f"{m[1]}: {m[2]}" for m in errors)
    assert not alive, f"{len(alive)} process(es) hung and were killed"
    assert len(messages) == expected_messages, messages
    return messages


SIZES = [1, 7, 64, 1024]
MODES = ["staged", "grouped"]


def test_transfers_between_two_processes_are_byte_exact_and_decode_matches():
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous.json")
        count = len(SIZES) * len(MODES)
        messages = _run_pair(
            [(workers.sender, (rendezvous, SIZES, MODES)), (workers.receiver, (rendezvous, count))],
            2 * count + 2,
        )
    sent = {m[2]: m for m in messages if m[0] == "sent"}
    received = {m[1]: m for m in messages if m[0] == "received"}
    assert sorted(sent) == sorted(received) == list(range(1, count + 1))
    for rid, (_, mode, _, digests, still_held) in sent.items():
        _, _, got, decode_error = received[rid]
        assert len(digests) == SIZES[(rid - 1) % len(SIZES)], (mode, rid)
        assert got == digests, f"{mode} request {rid}: blocks differ"
        assert decode_error is None, decode_error
        assert not still_held  # the sender freed the request after its send completed
    done = {m[0]: m[1] for m in messages if m[0].endswith("_done")}
    assert done == {"sender_done": 0, "receiver_done": 0}


def test_mutated_digests_would_fail_the_comparison():
    """The byte check above compares per-block SHA-256 digests: one flipped byte changes one."""
    import hashlib

    block = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    flipped = block.copy()
    flipped[1234] ^= 1
    assert (
        hashlib.sha256(block.tobytes()).hexdigest() != hashlib.sha256(flipped.tobytes()).hexdigest()
    )


def test_a_sender_exiting_mid_transfer_leaves_the_receiver_consistent():
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous.json")
        messages = _run_pair(
            [(workers.dying_sender, (rendezvous,)), (workers.surviving_receiver, (rendezvous,))], 1
        )
    kind, message, consistent, _ = messages[0]
    assert kind == "interrupted" and "request 1" in message
    assert consistent


@pytest.mark.parametrize("num_splits", [1, None])
def test_tp_decode_over_two_devices_equals_one_device(num_splits):
    """Each rank decodes its 4 of 8 KV heads (and their 16 of 32 query heads) from the group's
    one table; side by side the outputs equal the one-device decode over all heads (bit for
    bit with one split, within the float64 reference's bounds with the default plan)."""
    import cupy

    full = kvpool.KvLayout(2, 8, 128, 16)
    hq, lens = 32, [1000, 37, 4096, 1]
    group = kvpool.PoolGroup(full, 2, 600, devices="cuda")
    single = kvpool.Pool(full, 600, device="cuda:0")
    tables, ref_tables = group.tables(8, 300), kvpool.BlockTables(single, 8, 300)
    rng = np.random.default_rng(5)
    for rid, n in enumerate(lens):
        slots = tables.add(rid, n)
        assert (ref_tables.add(rid, n) == slots).all()
        for layer in range(full.num_layers):
            k = rng.standard_normal((n, 8, 128)).astype(np.float16)
            v = rng.standard_normal((n, 8, 128)).astype(np.float16)
            with cupy.cuda.Device(0):
                kvpool.append_kv(
                    cupy.asarray(k), cupy.asarray(v), single, layer, cupy.asarray(slots)
                )
            for rank, pool in enumerate(group.pools):
                a, b = group.head_range(rank)
                with cupy.cuda.Device(rank):
                    kvpool.append_kv(
                        cupy.asarray(k[:, a:b]),
                        cupy.asarray(v[:, a:b]),
                        pool,
                        layer,
                        cupy.asarray(slots),
                    )
    for d in (0, 1):
        cupy.cuda.Device(d).synchronize()
    q = rng.standard_normal((len(lens), hq, 128)).astype(np.float16)
    per_rank = group.sync(tables)
    assert [bt.pool for bt, _ in per_rank] == list(group.pools)
    bt, sl = ref_tables.sync()
    max_len = max(lens)
    for layer in range(full.num_layers):
        with cupy.cuda.Device(0):
            want = kvpool.paged_attention_decode(
                cupy.asarray(q),
                single,
                layer,
                bt,
                sl,
                stream=single.stream,
                max_seq_len=max_len,
                num_splits=num_splits,
            )
            cupy.cuda.Stream.from_external(single.stream).synchronize()
            want = cupy.asnumpy(want)
        parts = []
        for rank, pool in enumerate(group.pools):
            with cupy.cuda.Device(rank):
                q_r = cupy.asarray(q[:, 16 * rank : 16 * (rank + 1)])
                out = kvpool.paged_attention_decode(
                    q_r,
                    pool,
                    layer,
                    *per_rank[rank],
                    stream=pool.stream,
                    max_seq_len=max_len,
                    num_splits=num_splits,
                )
                cupy.cuda.Stream.from_external(pool.stream).synchronize()
                parts.append(cupy.asnumpy(out))
        got = np.concatenate(parts, axis=1)
        if num_splits == 1:
            np.testing.assert_array_equal(got, want)
        k = cupy.asnumpy(cupy.asarray(single.k_view(layer)))
        v = cupy.asnumpy(cupy.asarray(single.v_view(layer)))
        ref = kvpool.reference.paged_attention_decode(
            q, k, v, ref_tables.block_table(range(4)), np.array(lens), "float16"
        )
        assert_attention_close(got, ref, "float16", f"TP decode, layer {layer}")
    group.check_invariants(tables)
