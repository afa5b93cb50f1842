"""The core's own evictions reach the disk tier: a host pool too small for its workload evicts
cached blocks (from the pool, or from its host tier), the pool's eviction stage hands them to
``PrefixDiskCache`` with their hashes before their memory is reused, and a later request gets
them back from disk byte-exact; a flipped byte or a truncated file is a miss; the pool, its
stage and the tier stay conserved; the disk's events join the pool's one ordered stream and
its snapshot."""

from __future__ import annotations

import os
from pathlib import Path

import kvpool
import nixl_required  # noqa: F401  (loads NIXL, or skips this module)
import numpy as np
import pytest
from disk_fixtures import BB, LAYOUT, block, raw
from kvpool import InvalidArgumentError
from kvpool.tier import DiskTier, PrefixDiskCache

PROMPT = list(range(1000, 1000 + 16 * 6 + 5))  # 6 full blocks and 5 tokens


def check_conserved(cache: PrefixDiskCache) -> None:
    pool = cache.pool
    pool.check_invariants()
    assert pool.num_free + pool.num_evictable + pool.num_used == pool.num_blocks
    cache.stage.check_invariants()
    assert cache.stage.stats()["num_taken"] == 0, "every taken slot was given back"
    cache.tier.check_invariants()


def churn(cache: PrefixDiskCache, request_id: int) -> None:
    """A request over every block of the pool, then freed: the cache's blocks are evicted."""
    cache.add_request(request_id, list(range(100_000 * request_id, 100_000 * request_id + 128)))
    cache.free(request_id)


def first_request(cache: PrefixDiskCache) -> tuple[list[bytes], list[bytes]]:
    """Request 1 computes PROMPT's KV and finishes; returns its 6 blocks' bytes and hashes."""
    pool, tables = cache.pool, cache.tables
    _, ready = cache.add_request(1, PROMPT)
    assert ready == 0
    ids = [int(b) for b in tables.blocks(1)]
    kv = np.random.default_rng(5).integers(0, 256, (len(ids), BB), dtype=np.uint8)
    for b, row in zip(ids, kv, strict=True):  # "compute" the request's KV
        raw(pool)[b * BB : (b + 1) * BB] = row
    chain = cache.block_hashes(1)
    assert chain is not None and len(chain) == 6
    assert cache.free(1) == 0, "no write-through: nothing is written on release"
    return [row.tobytes() for row in kv[:6]], chain


@pytest.fixture(params=[0, 2], ids=["no-host-tier", "host-tier-2"])
def cache(request, tmp_path: Path):
    host_blocks = request.param or None
    pool = kvpool.Pool(
        LAYOUT,
        8,
        device="host",
        enable_prefix_caching=True,
        prefix_cache_host_blocks=host_blocks,
    )
    tables = kvpool.BlockTables(pool, 8, 8)
    with DiskTier(tmp_path, LAYOUT, 32) as tier:
        yield PrefixDiskCache(tables, tier, write_through=False)


def test_blocks_the_core_evicts_come_back_from_disk_byte_exact(cache):
    pool, tier = cache.pool, cache.tier
    kv, chain = first_request(cache)
    assert not any(h in tier for h in chain), "nothing evicted yet, nothing on disk"
    churn(cache, 2)  # evicts request 1's blocks (from the pool; the host keeps two)
    churn(cache, 3)  # and the host tier's, if any
    cache.write_evicted()
    assert all(h in tier for h in chain), "every evicted block reached the disk"
    assert cache.stage.stats()["dropped"] == 0
    raw(pool)[:] = 0
    result, ready = cache.add_request(4, PROMPT)
    assert result.num_cached_tokens == 0 and ready == 16 * 6
    assert [block(pool, int(b)) for b in cache.tables.blocks(4)[:6]] == kv
    assert cache.disk_hit_blocks == 6
    cache.free(4)
    check_conserved(cache)


def test_a_flipped_byte_or_a_truncated_file_is_a_miss(cache):
    pool, tier = cache.pool, cache.tier
    kv, chain = first_request(cache)
    churn(cache, 2)
    churn(cache, 3)
    cache.write_evicted()
    with open(tier.path, "r+b") as f:  # a flipped byte in the disk copy of block 3
        f.seek(tier._index[chain[3]].slot * BB + 9)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    raw(pool)[:] = 0
    _, ready = cache.add_request(4, PROMPT)
    assert ready == 16 * 3, "the prefix read from disk stops before the corrupt block"
    assert [block(pool, int(b)) for b in cache.tables.blocks(4)[:3]] == kv[:3]
    assert chain[3] not in tier
    cache.free(4)
    churn(cache, 5)
    churn(cache, 6)
    cache.write_evicted()
    # Cut the file short under one block of the chain: it and every block in a later slot
    # are misses; the prefix read from disk stops at the first of them.
    assert all(h in tier for h in chain), "request 4's recomputed blocks were evicted too"
    slots = [tier._index[h].slot for h in chain]
    cut_slot = max(slots)  # the chain is staged tail first: a later block, lower slots
    os.truncate(tier.path, cut_slot * BB + 100)
    lead = next(i for i, slot in enumerate(slots) if slot >= cut_slot)
    raw(pool)[:] = 0
    _, ready = cache.add_request(7, PROMPT)
    assert ready == 16 * lead
    assert lead > 0, "some of the prefix is still read before the cut"
    assert [block(pool, int(b)) for b in cache.tables.blocks(7)[: min(lead, 3)]] == kv[
        : min(lead, 3)
    ]
    assert not any(h in tier for h, slot in zip(chain, slots, strict=True) if slot >= cut_slot)
    cache.free(7)
    check_conserved(cache)


def test_disk_events_join_the_pool_stream_and_its_snapshot(cache):
    pool, tier = cache.pool, cache.tier
    _, chain = first_request(cache)
    churn(cache, 2)
    churn(cache, 3)
    events = cache.take_kv_events()
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), "one ordered stream"
    removed_at = {}
    for e in events:
        if type(e).__name__ == "BlockRemoved" and e.medium != "disk":
            for h in e.block_hashes:
                removed_at.setdefault(h, e.seq)
    stored_on_disk = {
        h: e.seq
        for e in events
        if type(e).__name__ == "BlockStored" and e.medium == "disk"
        for h in e.block_hashes
    }
    assert set(chain) <= set(stored_on_disk)
    # Each block reached the disk after it left memory.
    assert all(removed_at[h] < stored_on_disk[h] for h in chain)
    snap = pool.kv_cache_snapshot()
    on_disk = {b.block_hash for b in snap.blocks if b.medium == "disk"}
    assert on_disk == set(tier.hashes())
    assert snap.seq == seqs[-1]
    # A reset empties the disk with the pool: one AllBlocksCleared covers both.
    cache.reset_prefix_cache()
    after = cache.take_kv_events()
    assert [type(e).__name__ for e in after] == ["AllBlocksCleared"]
    assert len(tier) == 0
    assert not [b for b in pool.kv_cache_snapshot().blocks if b.medium == "disk"]
    check_conserved(cache)


def test_stage_and_append_refuse_what_they_cannot_take(tmp_path: Path):
    pool = kvpool.Pool(LAYOUT, 4, device="host", enable_prefix_caching=True)
    with pytest.raises(InvalidArgumentError):
        kvpool.Pool(LAYOUT, 4, device="host").attach_eviction_stage(4)  # no prefix cache
    with pytest.raises(InvalidArgumentError):
        pool.attach_eviction_stage(0)
    with pytest.raises(TypeError):
        pool.attach_eviction_stage("4")  # type: ignore[arg-type]
    assert pool.eviction_stage is None
    stage = pool.attach_eviction_stage(4)
    assert stage.base_ptr % 4096 == 0 and stage.block_bytes == BB and stage.num_slots == 4
    with pytest.raises(InvalidArgumentError):
        pool.attach_eviction_stage(4)  # one per pool
    with pytest.raises(InvalidArgumentError):
        stage.release(1, [0])  # not taken
    with pytest.raises(InvalidArgumentError):
        stage.checksums([0])
    with pytest.raises(InvalidArgumentError):
        stage.release(1, [4])  # not a slot
    assert len(stage.take()) == 0
    stage.check_invariants()
    with pytest.raises(InvalidArgumentError):
        pool.append_kv_event(kvpool.BlockRemoved([b"\x01" * 32], "CPU"))  # the core's own
    with pytest.raises(TypeError):
        pool.append_kv_event("BlockRemoved")  # type: ignore[arg-type]
    assert pool.append_kv_event(kvpool.BlockRemoved([b"\x01" * 32], "disk")) == 0  # events off
    with pytest.raises(kvpool.InvalidBlockError):
        pool.block_checksums([4])
    sums = pool.block_checksums([0, 1])
    assert sums.dtype == np.uint32 and len(sums) == 2
    assert crc32c_reference(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
    raw(pool)[:BB] = np.random.default_rng(1).integers(0, 256, BB, dtype=np.uint8)
    assert int(pool.block_checksums([0])[0]) == crc32c_reference(block(pool, 0))
    pool.check_invariants()


def crc32c_reference(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), one byte at a time."""
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    crc = 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def test_with_write_through_an_eviction_only_refreshes_what_is_on_disk(tmp_path: Path):
    pool = kvpool.Pool(LAYOUT, 8, device="host", enable_prefix_caching=True)
    tables = kvpool.BlockTables(pool, 8, 8)
    with DiskTier(tmp_path, LAYOUT, 32) as tier:
        cache = PrefixDiskCache(tables, tier)  # write_through=True
        cache.add_request(1, PROMPT)
        assert cache.free(1) == 6
        stored = tier.stats["stored"]
        cache.add_request(2, list(range(5000, 5000 + 16 * 8)))  # evicts request 1's blocks
        assert cache.stage.stats()["taken"] == 6, "the evicted blocks were handed over"
        assert tier.stats["stored"] == stored, "already on disk: refreshed, not written again"
        cache.free(2)
        check_conserved(cache)


def test_put_staged_refuses_what_is_not_a_matching_stage(tmp_path: Path):
    other = kvpool.KvLayout(2, 2, 32, 16)
    pool = kvpool.Pool(other, 4, device="host", enable_prefix_caching=True)
    stage = pool.attach_eviction_stage(2)
    with DiskTier(tmp_path, LAYOUT, 4) as tier:
        with pytest.raises(TypeError):
            tier.put_staged(pool)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            tier.put_staged(stage)  # 4 KiB blocks into a tier of 8 KiB ones
        assert len(tier) == 0
        tier.check_invariants()
    stage.check_invariants()


def test_blocks_swapped_in_from_the_host_tier_then_the_rest_from_disk(tmp_path: Path):
    # The host tier keeps the head of the prompt, the disk has all of it: the add swaps the
    # head in and stores it again, so the blocks this call stored begin with the swapped-in
    # ones; the disk must fill the blocks after them, each with its own KV.
    pool = kvpool.Pool(
        LAYOUT, 8, device="host", enable_prefix_caching=True, prefix_cache_host_blocks=2
    )
    tables = kvpool.BlockTables(pool, 8, 8)
    with DiskTier(tmp_path, LAYOUT, 32) as tier:
        cache = PrefixDiskCache(tables, tier)  # write-through: the disk has all six
        cache.add_request(1, PROMPT)
        ids = [int(b) for b in tables.blocks(1)]
        kv = np.random.default_rng(9).integers(0, 256, (len(ids), BB), dtype=np.uint8)
        for b, row in zip(ids, kv, strict=True):
            raw(pool)[b * BB : (b + 1) * BB] = row
        assert cache.free(1) == 6
        churn(cache, 2)  # the pool evicts all six; the host keeps the head two
        assert pool.prefix_cache_stats()["host_num_cached_blocks"] == 2
        raw(pool)[:] = 0
        result, ready = cache.add_request(3, PROMPT)
        assert result.num_cached_tokens == 32, "two blocks swapped in from the host tier"
        assert ready == 16 * 6 and cache.disk_hit_blocks == 4
        got = [block(pool, int(b)) for b in tables.blocks(3)[:6]]
        assert got == [row.tobytes() for row in kv[:6]]
        cache.free(3)
        check_conserved(cache)


def test_a_hybrid_pool_refuses_disk_events_and_changes_nothing():
    # A hybrid pool's cache names pages by internal tags and its events chunks per group
    # (HybridTables): a disk block of group 0 there is one no router can place, so the pool
    # refuses it, numbering nothing and keeping no disk set.
    spec = kvpool.ModelKvSpec(
        [kvpool.KvGroup.full([0], 1, 8), kvpool.KvGroup.sliding_window([1], 40, 1, 8)],
        page_bytes=1024,
    )
    pool = kvpool.Pool.for_spec(spec, 16, device="host", enable_prefix_caching=True)
    pool.enable_kv_cache_events(True)
    tables = kvpool.HybridTables(pool, spec)
    tables.add_request(0, list(range(64)))
    tables.cache_computed(0)
    before = pool.take_kv_events()
    assert before, "the hybrid pool numbers its own events"
    for event in (
        kvpool.BlockStored([b"\x02" * 32], None, [], 16, None, "disk", 0, 0),
        kvpool.BlockRemoved([b"\x02" * 32], "disk"),
    ):
        with pytest.raises(InvalidArgumentError, match="hybrid pages"):
            pool.append_kv_event(event)
    assert pool.take_kv_events() == []  # nothing queued
    tables.add_request(1, list(range(100, 164)))
    tables.cache_computed(1)
    after = pool.take_kv_events()
    assert after[0].seq == before[-1].seq + 1  # no seq taken by the refused calls
    assert all(e.medium != "disk" for e in after)
    pool.check_invariants()


def failing_writes(tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Makes every disk WRITE of ``tier`` fail as NIXL's would; reads still work. Returns
    the list of the ops that failed."""
    failed: list[str] = []
    move = tier._move

    def fail_writes(source: object, pairs: object, op: str, during: object = None) -> None:
        if op == "WRITE":
            failed.append(op)
            raise kvpool.TransferError("injected: the disk write failed")
        move(source, pairs, op, during)

    monkeypatch.setattr(tier, "_move", fail_writes)
    return failed


@pytest.mark.parametrize("write_through", [False, True])
def test_a_failed_disk_write_fails_no_call_and_leaks_no_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_through: bool
):
    # Before: a TransferError from the stage's write escaped add_request / append_tokens after
    # the tables had added the request (the caller never got its result, the blocks stayed
    # allocated), and one from free() left the request allocated.
    pool = kvpool.Pool(LAYOUT, 8, device="host", enable_prefix_caching=True)
    tables = kvpool.BlockTables(pool, 8, 8)
    with DiskTier(tmp_path, LAYOUT, 32) as tier:
        cache = PrefixDiskCache(tables, tier, write_through=write_through)
        cache.add_request(1, PROMPT)
        failed = failing_writes(tier, monkeypatch)
        assert cache.free(1) == 0, "write-through (if on) failed: nothing written"
        assert pool.num_used == 0, "cached, unreferenced: the next request evicts them"
        assert len(failed) == int(write_through)
        result, ready = cache.add_request(2, list(range(5000, 5000 + 16 * 7)))
        assert result.num_cached_tokens == 0 and ready == 0
        assert len(tables.blocks(2)) == 7, "the request was added in full"
        assert failed and cache.disk_write_failures == len(failed)
        assert isinstance(cache.last_disk_error, kvpool.TransferError)
        assert cache.stage.stats()["num_taken"] == 0, "the stage's slots were given back"
        cache.append_tokens(2, 16, list(range(9000, 9016)))  # fills block 8: evicts again
        assert len(tables.blocks(2)) == 8
        cache.free(2)
        assert pool.num_used == 0, "the request was freed"
        assert cache.block_hashes(2) is None, "its chain forgotten"
        assert cache.disk_write_failures == len(failed) >= 2
        assert len(tier) == 0, "nothing reached the disk"
        check_conserved(cache)
        monkeypatch.undo()  # the disk works again: later evictions reach it
        cache.add_request(3, PROMPT)
        assert cache.free(3) == (6 if write_through else 0)
        check_conserved(cache)


def test_free_frees_the_request_even_when_the_disk_raises(tmp_path: Path):
    pool = kvpool.Pool(LAYOUT, 8, device="host", enable_prefix_caching=True)
    tables = kvpool.BlockTables(pool, 8, 8)
    tier = DiskTier(tmp_path, LAYOUT, 32)
    cache = PrefixDiskCache(tables, tier)
    cache.add_request(1, PROMPT)
    tier.close()
    with pytest.raises(InvalidArgumentError):
        cache.free(1)  # the closed tier raises; the request is freed all the same
    assert pool.num_used == 0 and cache.block_hashes(1) is None
    with pytest.raises(InvalidArgumentError):
        cache.add_request(2, PROMPT)  # refused before the tables change
    with pytest.raises(kvpool.KvError):
        tables.blocks(2)
    assert pool.num_used == 0
    pool.check_invariants()


def test_a_refused_cache_attaches_no_stage_and_the_default_stage_is_bounded(tmp_path: Path):
    pool = kvpool.Pool(LAYOUT, 8, device="host", enable_prefix_caching=True)
    tables = kvpool.BlockTables(pool, 8, 8)
    other = kvpool.KvLayout(2, 2, 32, 16)
    with DiskTier(tmp_path / "a", other, 4) as small, pytest.raises(InvalidArgumentError):
        PrefixDiskCache(tables, small)  # blocks half the size of the pool's
    assert pool.eviction_stage is None, "the refused call attached nothing"
    with DiskTier(tmp_path / "b", LAYOUT, 4) as tier:
        cache = PrefixDiskCache(tables, tier, stage_slots=3)
        assert cache.stage.num_slots == 3
        with pytest.raises(InvalidArgumentError):
            PrefixDiskCache(tables, tier, stage_slots=5)  # the pool's stage has 3
        assert PrefixDiskCache(tables, tier, stage_slots=3).stage.num_slots == 3
        assert PrefixDiskCache(tables, tier).stage.num_slots == 3
    from kvpool.tier.spill import default_stage_slots

    assert default_stage_slots(8, BB) == 8
    assert default_stage_slots(100_000, BB) == 1024
    assert default_stage_slots(100_000, 5 << 20) == 51, "256 MiB of 5 MiB blocks"
    assert default_stage_slots(100_000, 1 << 30) == 1, "never none"


def test_only_the_taker_can_release_staged_slots():
    """Two threads drain one stage: the second's release of slots the first took (as while the
    first's NIXL write reads them) is refused and changes nothing, so the next eviction cannot
    overwrite them; the taker's own release is accepted."""
    import queue
    import threading

    pool = kvpool.Pool(LAYOUT, 8, device="host", enable_prefix_caching=True)
    tables = kvpool.BlockTables(pool, 8, 8)
    stage = pool.attach_eviction_stage(6)
    tables.add_request(1, PROMPT)
    tables.free(1)
    tables.add_request(2, list(range(5000, 5000 + 16 * 8)))  # evicts request 1's 6 blocks
    tables.free(2)
    taken = stage.take()
    assert len(taken) == 6
    slots = [int(s) for s in taken.slots]
    sums = stage.checksums(slots).tolist()
    to_other: queue.Queue[list[int]] = queue.Queue()
    outcome: queue.Queue[str] = queue.Queue()

    def other_reader() -> None:
        mine = stage.take()  # nothing left: the first reader holds every staged block
        foreign = to_other.get()
        before = stage.stats()
        try:
            stage.release(mine.take_id, foreign)
            outcome.put("released")
        except InvalidArgumentError as e:
            outcome.put("refused" if stage.stats() == before else f"changed: {e}")

    thread = threading.Thread(target=other_reader)
    thread.start()
    to_other.put(slots)
    thread.join()
    assert outcome.get_nowait() == "refused"
    tables.add_request(3, list(range(9000, 9000 + 16 * 8)))  # evicts request 2's blocks
    assert stage.checksums(slots).tolist() == sums, "the taken slots were not rewritten"
    with pytest.raises(TypeError):
        stage.release("1", slots)  # type: ignore[arg-type]
    stage.release(taken.take_id, slots)
    assert stage.stats()["num_taken"] == 0
    stage.check_invariants()
