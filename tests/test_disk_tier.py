"""The disk tier (kvpool.tier.DiskTier, NIXL's POSIX plugin): blocks round-trip byte-exact by
content hash, a flipped byte or a truncated file is a miss (never wrong KV), the capacity
evicts least recently used first, events say medium "disk", nothing leaks (slots, file
descriptors, NIXL registrations), and bad arguments raise without changing anything."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import kvpool
import nixl_required  # noqa: F401  (loads NIXL, or skips this module)
import numpy as np
import pytest
from disk_fixtures import BB, LAYOUT, block, key, make_pool, raw
from kvpool import InvalidArgumentError
from kvpool.events import event_to_wire
from kvpool.tier import DiskTier


@pytest.fixture(params=["inline", "beside"])
def checksums_on(request, monkeypatch):
    """Where a move's checksums run: on the calling thread after the post ("inline", what a
    small move does) or on the tier's worker beside NIXL's copy ("beside", what a move of
    ``OVERLAP_MIN_BYTES`` or more does): every test of the tier's reads and writes runs both."""
    import kvpool.tier.disk as disk

    monkeypatch.setattr(disk, "OVERLAP_MIN_BYTES", 1 << 62 if request.param == "inline" else 0)
    return request.param


@pytest.fixture
def tier(tmp_path: Path, checksums_on):
    with DiskTier(tmp_path, LAYOUT, 16) as t:
        yield t


def test_close_joins_the_checksum_worker(tmp_path, checksums_on):
    src = make_pool(seed=1)
    before = {t.name for t in threading.enumerate()}
    tier = DiskTier(tmp_path, LAYOUT, 16)
    tier.put(src, [0, 1], [key(0), key(1)])
    assert tier.get(src, [2, 3], [key(0), key(1)]) == [True, True]
    workers = [t for t in threading.enumerate() if t.name.startswith("kvpool-disk-crc")]
    assert len(workers) == (1 if checksums_on == "beside" else 0)
    tier.close()
    assert all(not t.is_alive() for t in workers)
    assert {t.name for t in threading.enumerate()} <= before


def test_blocks_round_trip_byte_exact_into_other_blocks(tier):
    src, dst = make_pool(seed=1), make_pool(seed=2)
    src_ids = [3, 4, 5, 9, 10, 40, 41, 42, 43, 7]  # runs and holes
    dst_ids = [0, 1, 2, 3, 20, 21, 22, 50, 51, 63]
    keys = [key(i) for i in range(len(src_ids))]
    assert tier.put(src, src_ids, keys) == len(keys)
    untouched = {b: block(dst, b) for b in range(64) if b not in dst_ids}
    assert tier.get(dst, dst_ids, keys) == [True] * len(keys)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert block(dst, d) == block(src, s), (s, d)
    assert all(block(dst, b) == want for b, want in untouched.items())  # nothing else written
    # One descriptor per run contiguous in the pool and the file, not one per block.
    assert tier.descriptor_counts == [4, 4]
    tier.check_invariants()


def test_a_flipped_byte_is_a_miss_and_the_block_leaves_the_tier(tier):
    src, dst = make_pool(seed=1), make_pool(seed=2)
    keys = [key(i) for i in range(4)]
    tier.put(src, [0, 1, 2, 3], keys)
    tier.take_kv_events()
    with open(tier.path, "r+b") as f:  # block 2 sits in slot 2 (a fresh tier fills in order)
        f.seek(2 * BB + 1234)
        byte = f.read(1)
        f.seek(2 * BB + 1234)
        f.write(bytes([byte[0] ^ 0x10]))
    assert tier.get(dst, [10, 11, 12, 13], keys) == [True, True, False, True]
    assert [block(dst, 10 + i) == block(src, i) for i in (0, 1, 3)] == [True] * 3
    assert keys[2] not in tier and len(tier) == 3
    (removed,) = tier.take_kv_events()
    assert isinstance(removed, kvpool.BlockRemoved) and removed.block_hashes == [keys[2]]
    assert removed.medium == "disk"
    assert tier.stats["corrupt"] == 1
    assert tier.get(dst, [12], [keys[2]]) == [False]  # gone, not read again
    tier.check_invariants()


def test_a_truncated_file_is_a_miss_for_the_blocks_it_cut(tier):
    src, dst = make_pool(seed=1), make_pool(seed=2)
    keys = [key(i) for i in range(6)]
    tier.put(src, [8, 9, 10, 11, 12, 13], keys)
    os.truncate(tier.path, 3 * BB + 100)  # slot 3 cut short, 4 and 5 gone
    assert tier.get(dst, [0, 1, 2, 3, 4, 5], keys) == [True, True, True, False, False, False]
    assert [block(dst, i) == block(src, 8 + i) for i in range(3)] == [True] * 3
    assert len(tier) == 3 and tier.stats["corrupt"] == 3
    tier.check_invariants()


def test_a_read_that_fails_in_nixl_is_a_miss_too(tier, monkeypatch):
    # The file shrinks between the size check and the READ: NIXL's POSIX plugin fails the
    # whole batch (a short read); the tier reads block by block and keeps what reads whole.
    src, dst = make_pool(seed=1), make_pool(seed=2)
    keys = [key(i) for i in range(4)]
    tier.put(src, [0, 1, 2, 3], keys)
    real_fstat = os.fstat

    def stale_fstat(fd):
        stat = real_fstat(fd)
        os.truncate(tier.path, 2 * BB)  # after the tier looked
        return stat

    monkeypatch.setattr(os, "fstat", stale_fstat)
    hits = tier.get(dst, [4, 5, 6, 7], keys)
    monkeypatch.undo()
    assert hits == [True, True, False, False]
    assert [block(dst, 4 + i) == block(src, i) for i in (0, 1)] == [True, True]
    tier.check_invariants()


def test_capacity_evicts_the_least_recently_used(tmp_path):
    src, dst = make_pool(seed=1), make_pool(seed=2)
    with DiskTier(tmp_path, LAYOUT, 4) as tier:
        a, b, c, d, e, f = (key(i) for i in range(6))
        tier.put(src, [0, 1, 2, 3], [a, b, c, d])
        assert tier.get(dst, [10], [a]) == [True]  # a is now the most recent
        tier.put(src, [1], [b])  # so is b, put again (not written twice)
        assert tier.hashes() == [c, d, a, b]
        tier.take_kv_events()
        assert tier.put(src, [4, 5], [e, f]) == 2  # c and d go
        assert tier.hashes() == [a, b, e, f]
        removed, stored = tier.take_kv_events()
        assert isinstance(removed, kvpool.BlockRemoved) and removed.block_hashes == [c, d]
        assert isinstance(stored, kvpool.BlockStored) and stored.block_hashes == [e, f]
        assert stored.seq == removed.seq + 1 and stored.medium == "disk"
        assert tier.get(dst, [20, 21, 22, 23], [a, b, c, e]) == [True, True, False, True]
        assert block(dst, 23) == block(src, 4) and block(dst, 20) == block(src, 0)
        assert tier.stats["evicted"] == 2
        # A batch larger than the capacity keeps its last blocks.
        keys = [key(100 + i) for i in range(6)]
        assert tier.put(src, list(range(10, 16)), keys) == 4
        assert tier.hashes() == keys[2:]
        tier.check_invariants()


def test_events_have_the_wire_form_of_vllm_offloading_with_medium_disk(tier):
    src = make_pool(seed=1)
    tier.put(src, [0, 1], [key(0), key(1)])
    tier.remove(key(0))
    stored, removed = tier.take_kv_events()
    assert event_to_wire(stored) == {
        "type": "BlockStored",
        "block_hashes": [key(0), key(1)],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 16,
        "lora_id": None,
        "medium": "disk",
        "lora_name": None,
        "group_idx": 0,
    }
    assert event_to_wire(removed)["medium"] == "disk" and removed.seq == stored.seq + 1
    assert tier.take_kv_events() == []


def test_the_event_queue_is_bounded(tmp_path):
    src = make_pool(seed=1)
    with DiskTier(tmp_path, LAYOUT, 2, max_queued_events=3) as tier:
        for i in range(5):
            tier.put(src, [i], [key(i)])
        events = tier.take_kv_events()
    assert len(events) == 3 and [e.seq for e in events] == [6, 7, 8]  # a gap: 1-5 dropped


def test_many_cycles_leak_no_slot_descriptor_or_pool_block(tmp_path):
    fds_before = len(os.listdir("/proc/self/fd"))
    src, dst = make_pool(seed=1), make_pool(seed=2)
    free_src, free_dst = src.num_free, dst.num_free
    rng = np.random.default_rng(7)
    model: dict[bytes, int] = {}  # hash -> the source block it was put from
    with DiskTier(tmp_path, LAYOUT, 8) as tier:
        for step in range(60):
            ids = [int(b) for b in rng.choice(64, size=int(rng.integers(1, 6)), replace=False)]
            keys = [key(int(k)) for k in rng.integers(0, 20, size=len(ids))]
            if len(set(keys)) != len(keys):
                continue
            if step % 2 == 0:
                tier.put(src, ids, keys)
                for k, b in zip(keys, ids, strict=True):
                    model.setdefault(k, b)  # a hash already held keeps its first bytes
                model = {k: v for k, v in model.items() if k in tier}
            else:
                for k, b, hit in zip(keys, ids, tier.get(dst, ids, keys), strict=True):
                    assert hit == (k in model)
                    if hit:
                        assert block(dst, b) == block(src, model[k])
            tier.check_invariants()
            assert len(tier) <= 8
    assert len(os.listdir("/proc/self/fd")) == fds_before  # the data file is closed
    assert (src.num_free, dst.num_free) == (free_src, free_dst)  # the tier takes no pool block
    src.check_invariants()
    with pytest.raises(InvalidArgumentError, match="closed"):
        tier.get(dst, [0], [key(0)])


def test_a_closed_tier_kept_alive_holds_no_nixl_agent(tmp_path):
    # Each agent's POSIX backend holds an AIO context (256 of fs.aio-max-nr's events, 65536 by
    # default): closed tiers that kept theirs exhausted it after 256, and every later tier
    # failed to start. close() lets the agent go at once.
    tier = DiskTier(tmp_path, LAYOUT, 4)
    tier.close()
    assert tier._agent is None


def test_bad_arguments_raise_and_change_nothing(tier):
    src = make_pool(seed=1)
    tier.put(src, [0], [key(0)])
    before = (tier.hashes(), list(tier._free_slots), dict(tier.stats))
    cases = [
        (TypeError, "bytes", dict(hashes=["x" * 32])),
        (InvalidArgumentError, "32 bytes", dict(hashes=[b"short"])),
        (InvalidArgumentError, "outside the pool", dict(block_ids=[64])),
        (InvalidArgumentError, "outside the pool", dict(block_ids=[-1])),
        (TypeError, "block id must be an int", dict(block_ids=[1.0])),
        (InvalidArgumentError, "2 block ids for 1 hashes", dict(block_ids=[1, 2])),
        (InvalidArgumentError, "repeat", dict(block_ids=[1, 1], hashes=[key(1), key(2)])),
        (TypeError, "sequence", dict(hashes=b"x" * 32)),
    ]
    for error, words, override in cases:
        args = {"block_ids": [1], "hashes": [key(1)], **override}
        for call in (tier.put, tier.get):
            with pytest.raises(error, match=words):
                call(src, args["block_ids"], args["hashes"])
    with pytest.raises(TypeError, match="kvpool.Pool"):
        tier.put(object(), [1], [key(1)])
    other = kvpool.Pool(kvpool.KvLayout(2, 2, 32, 16), 8, device="host")
    with pytest.raises(InvalidArgumentError, match="bytes, the tier's"):
        tier.put(other, [1], [key(1)])
    assert (tier.hashes(), list(tier._free_slots), dict(tier.stats)) == before
    with pytest.raises(InvalidArgumentError, match="capacity_blocks must be >= 1"):
        DiskTier(tier.path.parent / "x", LAYOUT, 0)
    with pytest.raises(TypeError, match="layout"):
        DiskTier(tier.path.parent, "layout", 4)  # type: ignore[arg-type]


def aligned_pool(num_blocks: int, seed: int) -> tuple[kvpool.Pool, object]:
    """A host pool over page-aligned memory (what O_DIRECT needs), random bytes in it."""
    import mmap

    memory = mmap.mmap(-1, num_blocks * BB)
    array = np.frombuffer(memory, np.uint8)
    array[:] = np.random.default_rng(seed).integers(0, 256, array.size, dtype=np.uint8)
    return kvpool.Pool.from_external(LAYOUT, array, num_blocks=num_blocks, device="host"), array


def test_direct_io_round_trips_and_still_catches_a_flipped_byte(tmp_path):
    (src, _keep_src), (dst, _keep_dst) = aligned_pool(16, 1), aligned_pool(16, 2)
    keys = [key(i) for i in range(5)]
    with DiskTier(tmp_path, LAYOUT, 8, direct=True) as tier:
        tier.put(src, [1, 2, 3, 8, 9], keys)
        with open(tier.path, "r+b") as f:  # slot 4 holds block 9
            f.seek(4 * BB + 5)
            f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
        assert tier.get(dst, [0, 1, 2, 3, 4], keys) == [True, True, True, True, False]
        assert [block(dst, i) == block(src, s) for i, s in enumerate([1, 2, 3, 8])] == [True] * 4
        import mmap

        memory = mmap.mmap(-1, 5 * BB)
        off_by_256 = np.frombuffer(memory, np.uint8)[256 : 256 + 4 * BB]
        misaligned = kvpool.Pool.from_external(LAYOUT, off_by_256, num_blocks=4, device="host")
        with pytest.raises(InvalidArgumentError, match="aligned to 4096"):
            tier.put(misaligned, [0], [key(9)])  # as a kvpool slab may be: 256-byte aligned
        del misaligned, off_by_256
        tier.check_invariants()
    small = kvpool.KvLayout(1, 1, 4, 16)  # 256-byte blocks
    with pytest.raises(InvalidArgumentError, match="multiple of 4096"):
        DiskTier(tmp_path, small, 4, direct=True)


def test_a_read_of_many_chunks_checks_every_block(tmp_path, monkeypatch, checksums_on):
    # Reads are pipelined in chunks (the next one in flight while one is checked): with
    # chunks of two blocks, a corrupt block in the middle chunk is the only miss.
    import kvpool.tier.disk as disk

    monkeypatch.setattr(disk, "READ_CHUNK_BYTES", 2 * BB)
    monkeypatch.setattr(disk, "MIN_READ_CHUNK_BYTES", 2 * BB)
    src, dst = make_pool(seed=1), make_pool(seed=2)
    keys = [key(i) for i in range(7)]
    with DiskTier(tmp_path, LAYOUT, 8) as tier:
        tier.put(src, list(range(7)), keys)
        with open(tier.path, "r+b") as f:
            f.seek(3 * BB + 77)
            f.write(b"\x01" if f.read(1) != b"\x01" else b"\x02")
        count = len(tier.descriptor_counts)
        assert tier.get(dst, list(range(20, 27)), keys) == [True] * 3 + [False] + [True] * 3
        # 4 chunks, one READ each, when the worker checks one while the next is read; on the
        # calling thread a buffered READ is one (its copy is done within the post anyway).
        assert len(tier.descriptor_counts) - count == (4 if checksums_on == "beside" else 1)
        assert all(block(dst, 20 + i) == block(src, i) for i in (0, 1, 2, 4, 5, 6))


def test_a_prefix_evicted_from_the_pool_comes_back_from_disk_by_hash(tmp_path):
    # Request 1 computes 6 full blocks and finishes (written through to disk); other requests
    # then take every block, so the pool's cache evicts them; request 2 with the same prompt
    # misses in the pool and gets its KV back from disk, byte-exact, up to a corrupt block.
    from kvpool.tier import PrefixDiskCache

    pool = kvpool.Pool(LAYOUT, 8, device="host", enable_prefix_caching=True)
    tables = kvpool.BlockTables(pool, 8, 8)
    prompt = list(range(1000, 1000 + 16 * 6 + 5))  # 6 full blocks and 5 tokens
    with DiskTier(tmp_path, LAYOUT, 32) as tier:
        cache = PrefixDiskCache(tables, tier)
        _, ready = cache.add_request(1, prompt)
        assert ready == 0
        ids = [int(b) for b in tables.blocks(1)]
        kv = np.random.default_rng(5).integers(0, 256, (len(ids), BB), dtype=np.uint8)
        for b, row in zip(ids, kv, strict=True):  # "compute" the request's KV
            raw(pool)[b * BB : (b + 1) * BB] = row
        assert cache.free(1) == 6  # the full blocks, not the partial one
        assert pool.num_evictable == 6
        cache.add_request(2, list(range(5000, 5000 + 16 * 8)))  # every block: evicts them all
        assert pool.num_evictable == 0
        assert cache.free(2) == 8
        cache.tables.add(9, 16 * 8)  # the pool's cache is churned again, its blocks reused
        tables.free(9)
        raw(pool)[:] = 0
        # The second request: no pool hit (its blocks were evicted), six disk hits.
        result, ready = cache.add_request(3, prompt)
        assert result.num_cached_tokens == 0 and ready == 16 * 6
        got = [block(pool, int(b)) for b in tables.blocks(3)[:6]]
        assert got == [row.tobytes() for row in kv[:6]]
        chain = cache.block_hashes(3)
        assert chain is not None and len(chain) == 6 and all(h in tier for h in chain)
        cache.free(3)
        disk = [e for e in cache.take_kv_events() if e.medium == "disk"]
        assert [type(e).__name__ for e in disk] == ["BlockStored"] * 2  # requests 1 and 2
        # A flipped byte in the disk copy of block 3: the prefix read from disk stops before it.
        cache.add_request(4, list(range(7000, 7000 + 16 * 8)))  # evicts request 3's blocks
        cache.free(4)
        raw(pool)[:] = 0
        with open(tier.path, "r+b") as f:
            f.seek(tier._index[chain[3]].slot * BB + 9)
            f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
        _, ready = cache.add_request(5, prompt)
        assert ready == 16 * 3
        assert [block(pool, int(b)) for b in tables.blocks(5)[:3]] == got[:3]
        assert chain[3] not in tier  # the corrupt copy is gone
        cache.free(5)
        pool.check_invariants()
        tier.check_invariants()
