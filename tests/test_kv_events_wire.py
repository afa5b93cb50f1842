"""KV events for routers: sequence numbers, the bounded queue, snapshots, pickling, and
vLLM's msgpack wire format checked field by field against vLLM's declarations."""

import pickle

import kvpool
import msgpack
import numpy as np
import pytest
from kvpool import AllBlocksCleared, BlockRemoved, BlockStored, BlockTables, KvLayout, Pool
from kvpool.events import encode_event_batch, zmq_frames

BS = 4
LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=BS, dtype="float16")


def pool_and_tables(num_blocks=8, **kwargs):
    pool = Pool(LAYOUT, num_blocks, device="host", enable_prefix_caching=True, **kwargs)
    pool.enable_kv_cache_events()
    return pool, BlockTables(pool, 16, 8)


def test_events_carry_increasing_seq_and_group():
    pool, tables = pool_and_tables(4)
    tables.add_request(1, range(9))
    tables.free(1)
    tables.add_request(2, range(100, 116))  # evicts the first prompt's blocks
    batch = pool.take_kv_event_batch()
    seqs = [e.seq for e in batch.events]
    assert seqs == list(range(1, len(seqs) + 1))
    assert batch.last_seq == seqs[-1] and batch.batch_seq == 1 and not batch.resync_needed
    assert {type(e) for e in batch.events} == {BlockStored, BlockRemoved}
    assert all(e.group == 0 for e in batch.events)
    assert pool.take_kv_event_batch().batch_seq == 2


def test_a_consumer_that_stops_reading_costs_a_bounded_queue_and_learns_the_gap():
    pool, tables = pool_and_tables(64)
    pool.enable_kv_cache_events(max_queued_events=50)
    for r in range(2000):
        tables.add_request(r, np.arange(8) + 8 * r)
        tables.free(r)
    batch = pool.take_kv_event_batch()
    assert len(batch.events) == 50
    assert batch.resync_needed
    assert batch.dropped + 50 == batch.last_seq
    assert not pool.take_kv_event_batch().resync_needed
    with pytest.raises(kvpool.InvalidArgumentError):
        pool.enable_kv_cache_events(max_queued_events=0)


def test_snapshot_then_later_events_rebuild_the_cache():
    pool, tables = pool_and_tables(6)
    tables.add_request(1, range(9))
    tables.free(1)
    snap = pool.kv_cache_snapshot()
    assert len(snap.blocks) == 2 and snap.block_size == BS
    roots = [b for b in snap.blocks if b.parent_block_hash is None]
    assert len(roots) == 1
    assert any(b.parent_block_hash == roots[0].block_hash for b in snap.blocks)
    assert all(b.medium == "CPU" and b.group == 0 for b in snap.blocks)
    tables.add_request(2, range(100, 116))
    held = {b.block_hash for b in snap.blocks}
    for e in pool.take_kv_events():
        if e.seq <= snap.seq:
            continue
        if isinstance(e, BlockStored):
            held |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            held -= set(e.block_hashes)
    assert held == {b.block_hash for b in pool.kv_cache_snapshot().blocks}
    with pytest.raises(kvpool.InvalidArgumentError):
        Pool(LAYOUT, 4, device="host").kv_cache_snapshot()


def test_events_pickle_and_compare():
    pool, tables = pool_and_tables()
    tables.add_request(1, range(9))
    events = pool.take_kv_events()
    tables.free(1)
    pool.reset_prefix_cache()
    events += pool.take_kv_events()
    assert any(isinstance(e, AllBlocksCleared) for e in events)
    for e in events:
        again = pickle.loads(pickle.dumps(e))
        assert again == e and type(again) is type(e) and again.seq == e.seq
    removed = BlockRemoved([b"\x01" * 32], "GPU", group=2, seq=9)
    assert pickle.loads(pickle.dumps(removed)).group == 2
    with pytest.raises(kvpool.InvalidArgumentError, match="32 bytes"):
        BlockRemoved([b"short"], "GPU")


# vLLM's declarations, written down from vllm-project/vllm at commit
# 0181ea3173e53eea8cf04a86891488e3dc89bb34, vllm/distributed/kv_events.py: every event
# struct is `msgspec.Struct, omit_defaults=True, gc=False, tag=True` (a map tagged "type"
# with the class name); (name, has_default) in declaration order.
VLLM_BLOCK_STORED = [
    ("block_hashes", False),
    ("parent_block_hash", False),
    ("token_ids", False),
    ("block_size", False),
    ("lora_id", False),
    ("medium", False),
    ("lora_name", False),
    ("extra_keys", True),
    ("group_idx", True),
    ("kv_cache_spec_kind", True),
    ("kv_cache_spec_sliding_window", True),
]
VLLM_BLOCK_REMOVED = [("block_hashes", False), ("medium", False), ("group_idx", True)]
# EventBatch: ts, events, data_parallel_rank (default None).


def vllm_struct(tag, fields, values):
    """What msgspec writes for a tagged struct with omit_defaults (defaults are None)."""
    out = {"type": tag}
    for name, has_default in fields:
        if has_default and values.get(name) is None:
            continue
        out[name] = values[name]
    return out


def test_msgpack_matches_vllms_kv_event_batch_field_by_field():
    pool, tables = pool_and_tables(4)
    tables.add_request(1, [128000, 9125, 0, 70000, 1, 2, 3, 4, 5], lora_id=7)
    tables.free(1)
    tables.add_request(2, range(100, 116))
    tables.free(2)
    pool.reset_prefix_cache()
    batch = pool.take_kv_event_batch()
    stored, removed = batch.events[0], next(e for e in batch.events if isinstance(e, BlockRemoved))
    assert isinstance(batch.events[-1], AllBlocksCleared)
    expected_events = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            values = {
                "block_hashes": e.block_hashes,
                "parent_block_hash": e.parent_block_hash,
                "token_ids": e.token_ids,
                "block_size": BS,
                "lora_id": e.lora_id,
                "medium": "CPU",
                "lora_name": None,
                "group_idx": 0,
            }
            expected_events.append(vllm_struct("BlockStored", VLLM_BLOCK_STORED, values))
        elif isinstance(e, BlockRemoved):
            values = {"block_hashes": e.block_hashes, "medium": "CPU", "group_idx": 0}
            expected_events.append(vllm_struct("BlockRemoved", VLLM_BLOCK_REMOVED, values))
        else:
            expected_events.append({"type": "AllBlocksCleared"})
    assert stored.lora_id == 7 and stored.token_ids[:4] == [128000, 9125, 0, 70000]
    assert len(removed.block_hashes[0]) == 32

    payload = encode_event_batch(batch, 1757500000.25)
    decoded = msgpack.unpackb(payload, raw=False)
    assert decoded == [1757500000.25, expected_events]
    # Keys in declaration order (msgspec decodes by name, but order shows the schema).
    assert list(decoded[1][0]) == ["type"] + [n for n, d in VLLM_BLOCK_STORED if not d] + [
        "group_idx"
    ]
    assert msgpack.unpackb(encode_event_batch(batch, 2.0, data_parallel_rank=3))[2] == 3
    as_map = msgpack.unpackb(encode_event_batch(batch, 2.0, batch_array_like=False))
    assert as_map == {"ts": 2.0, "events": expected_events}
    # Hashes travel as msgpack bin, timestamps as float64, as msgspec writes them.
    assert b"\xc4\x20" + stored.block_hashes[0] in payload
    assert payload[1] == 0xCB
    topic, seq, body = zmq_frames(batch, payload, topic="kv")
    assert (topic, int.from_bytes(seq, "big"), body) == (b"kv", batch.batch_seq, payload)
