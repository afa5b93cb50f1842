"""A persistent disk tier (``DiskTier(..., persistent=True)``) across restarts: the index
written beside the data file on close is reloaded by a tier of another process, which finds
the blocks by content hash byte-exact, in the same LRU order and capacity; after reopening, a
flipped byte or a truncated file is still a miss (the checksums are verified on read, as
always), as is an entry made stale by writes after the last flush; an index that is garbled,
of another layout or capacity, or of a data file changed since is discarded with a
DiskIndexWarning, never an exception; the reloaded blocks reach a pool's event stream and
snapshot with medium "disk", and a restarted prefix cache reads its prompt's KV from them.

The writers run in another process (this file run as a script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import disk_fixtures
import kvpool
import nixl_required  # noqa: F401  (loads NIXL, or skips this module)
import numpy as np
import pytest
from disk_fixtures import BB, LAYOUT, block, key, raw
from kvpool import InvalidArgumentError
from kvpool.tier import DiskIndexWarning, DiskTier, PrefixDiskCache
from kvpool.tier.disk import INDEX_NAME

CAPACITY = 8
HASH_KEY = bytes(range(32))  # one key for both processes: their pools hash alike
PROMPT = list(range(1000, 1000 + 16 * 6 + 5))  # 6 full blocks and 5 tokens


def make_pool(seed: int = 0) -> kvpool.Pool:
    """A host pool of 16 blocks of fresh random bytes."""
    return disk_fixtures.make_pool(16, seed)


# -- the other process ------------------------------------------------------------------------


def write_blocks(directory: str) -> dict:
    """Stores blocks 0..5 of a seed-1 pool under key(0..5), reads key(1) (most recently used
    now), closes."""
    pool = make_pool(seed=1)
    with DiskTier(directory, LAYOUT, CAPACITY, persistent=True) as tier:
        tier.put(pool, list(range(6)), [key(i) for i in range(6)])
        assert tier.get(pool, [10], [key(1)]) == [True]
        order = [tier.hashes().index(key(i)) for i in range(6)]
    return {"order": order}


def write_then_crash(directory: str) -> dict:
    """Stores key(0..3), flushes, then overwrites slot 0 (key(0) removed, key(9) stored in its
    slot) and dies without closing: the index on disk is stale for slot 0."""
    pool = make_pool(seed=1)
    tier = DiskTier(directory, LAYOUT, 4, persistent=True)
    tier.put(pool, [0, 1, 2, 3], [key(i) for i in range(4)])
    tier.flush()
    mtime_ns_at_flush = os.stat(Path(directory) / "blocks.kv").st_mtime_ns
    tier.remove(key(0))
    tier.put(pool, [9], [key(9)])
    assert tier._index[key(9)].slot == 0
    print("RESULT " + json.dumps({"mtime_ns_at_flush": mtime_ns_at_flush}), flush=True)
    os._exit(0)  # no close, no flush: a crash


def serve_prompt(directory: str) -> dict:
    """A prefix-caching pool computes PROMPT's KV (seed 5), frees it (written through to a
    persistent tier), closes."""
    pool = kvpool.Pool(
        LAYOUT, 8, device="host", enable_prefix_caching=True, prefix_hash_key=HASH_KEY
    )
    tables = kvpool.BlockTables(pool, 8, 8)
    with DiskTier(directory, LAYOUT, 32, persistent=True) as tier:
        cache = PrefixDiskCache(tables, tier)
        cache.add_request(1, PROMPT)
        ids = [int(b) for b in tables.blocks(1)]
        kv = np.random.default_rng(5).integers(0, 256, (len(ids), BB), dtype=np.uint8)
        for b, row in zip(ids, kv, strict=True):
            raw(pool)[b * BB : (b + 1) * BB] = row
        written = cache.free(1)
        hashes = tier.hashes()
    return {"written": written, "hashes": [h.hex() for h in hashes]}


def run_peer(role: str, directory: Path) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, role, str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout + done.stderr
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


# -- the tests --------------------------------------------------------------------------------


def reopen(directory: Path, capacity: int = CAPACITY, **kwargs) -> DiskTier:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiskIndexWarning)  # a test that expects one says so
        return DiskTier(directory, LAYOUT, capacity, persistent=True, **kwargs)


def test_blocks_written_by_another_process_come_back_by_hash_in_lru_order(tmp_path):
    seen = run_peer("write_blocks", tmp_path)
    want = make_pool(seed=1)
    with reopen(tmp_path) as tier:
        assert tier.stats["reloaded"] == 6 and len(tier) == 6
        lru = [key(i) for i in (0, 2, 3, 4, 5, 1)]  # key(1) was read last
        assert tier.hashes() == lru
        assert [lru.index(key(i)) for i in range(6)] == seen["order"]
        (stored,) = tier.take_kv_events()
        assert isinstance(stored, kvpool.BlockStored) and stored.medium == "disk"
        assert stored.block_hashes == lru and stored.seq == 1
        dst = make_pool(seed=2)
        assert tier.get(dst, [7, 8, 9], [key(4), key(0), key(5)]) == [True] * 3
        assert [block(dst, 7), block(dst, 8), block(dst, 9)] == [
            block(want, 4),
            block(want, 0),
            block(want, 5),
        ]
        tier.check_invariants()
        # The capacity holds: 3 more blocks fill 8 slots and evict the least recently used
        # (key(2), the oldest reloaded one not read since).
        tier.take_kv_events()
        tier.put(want, [10, 11, 12], [key(10), key(11), key(12)])
        assert len(tier) == CAPACITY and key(2) not in tier and key(3) in tier
        (removed, _) = tier.take_kv_events()
        assert removed.block_hashes == [key(2)]
        tier.check_invariants()
    with reopen(tmp_path) as tier:  # a second restart sees the first one's changes
        assert tier.hashes()[-3:] == [key(10), key(11), key(12)] and key(2) not in tier
        assert tier.get(make_pool(seed=3), [0], [key(11)]) == [True]


def test_a_flipped_byte_after_reopening_is_a_miss(tmp_path):
    run_peer("write_blocks", tmp_path)
    with reopen(tmp_path) as tier:
        slot = tier._index[key(3)].slot
        with open(tier.path, "r+b") as f:
            f.seek(slot * BB + 777)
            byte = f.read(1)
            f.seek(slot * BB + 777)
            f.write(bytes([byte[0] ^ 0x01]))
        dst = make_pool(seed=2)
        assert tier.get(dst, [0, 1, 2], [key(2), key(3), key(4)]) == [True, False, True]
        assert key(3) not in tier and tier.stats["corrupt"] == 1
        tier.check_invariants()


def test_a_truncated_file_after_reopening_is_a_miss_for_what_it_cut(tmp_path):
    run_peer("write_blocks", tmp_path)
    with reopen(tmp_path) as tier:
        slots = {i: tier._index[key(i)].slot for i in range(6)}
        cut = 3 * BB + 10  # slot 3 cut short, 4 and up gone
        os.truncate(tier.path, cut)
        hits = tier.get(make_pool(seed=2), list(range(6)), [key(i) for i in range(6)])
        assert hits == [slots[i] < 3 for i in range(6)]
        assert sum(hits) == 3
        tier.check_invariants()


def test_a_file_changed_while_closed_discards_the_index_with_a_warning(tmp_path):
    run_peer("write_blocks", tmp_path)
    with open(tmp_path / "blocks.kv", "r+b") as f:  # one flipped byte, the index unchanged
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x80]))
    with pytest.warns(DiskIndexWarning, match="blocks.kv changed since the index was written"):
        tier = DiskTier(tmp_path, LAYOUT, CAPACITY, persistent=True)
    with tier:
        assert len(tier) == 0 and tier.stats["reloaded"] == 0 and tier.take_kv_events() == []
        assert tier.get(make_pool(), [0], [key(0)]) == [False]
        assert os.path.getsize(tier.path) == CAPACITY * BB  # emptied, then sized again
        assert not raw_file(tier.path).any()
        tier.check_invariants()


def raw_file(path: Path) -> np.ndarray:
    return np.fromfile(path, np.uint8)


def test_an_entry_rewritten_after_the_last_flush_is_a_miss(tmp_path):
    # The crash after writes that the data file's timestamp cannot show (the same tick as the
    # flush; set back here to make it so): the index loads, and slot 0's entry is stale.
    seen = run_peer("write_then_crash", tmp_path)
    path = tmp_path / "blocks.kv"
    os.utime(path, ns=(os.stat(path).st_atime_ns, seen["mtime_ns_at_flush"]))
    with reopen(tmp_path, capacity=4) as tier:
        assert tier.hashes() == [key(i) for i in range(4)]  # as flushed: key(9) unknown
        want = make_pool(seed=1)
        dst = make_pool(seed=2)
        assert tier.get(dst, [0, 1, 2, 3], [key(i) for i in range(4)]) == [False, True, True, True]
        assert [block(dst, i) == block(want, i) for i in (1, 2, 3)] == [True] * 3
        assert key(0) not in tier and key(9) not in tier
        tier.check_invariants()


@pytest.mark.parametrize(
    ("spoil", "words"),
    [
        (lambda raw: b"garbage" * 20, "not a kvpool disk index"),
        (lambda raw: raw[: len(raw) // 2], "CRC-32 does not match"),
        (lambda raw: raw[:-5] + bytes([raw[-5] ^ 1]) + raw[-4:], "CRC-32 does not match"),
        (lambda raw: b"", "not a kvpool disk index"),
    ],
)
def test_a_garbled_index_is_discarded_with_a_warning(tmp_path, spoil, words):
    run_peer("write_blocks", tmp_path)
    index = tmp_path / INDEX_NAME
    index.write_bytes(spoil(index.read_bytes()))
    with pytest.warns(DiskIndexWarning, match=words):
        tier = DiskTier(tmp_path, LAYOUT, CAPACITY, persistent=True)
    with tier:
        assert len(tier) == 0
        src = make_pool(seed=4)
        tier.put(src, [0], [key(0)])  # it works as a fresh tier
        assert tier.get(make_pool(seed=5), [1], [key(0)]) == [True]
    with reopen(tmp_path) as tier:  # and its close wrote a good index again
        assert tier.hashes() == [key(0)]


@pytest.mark.parametrize(
    ("layout", "capacity", "words"),
    [
        (kvpool.KvLayout(2, 2, 32, 16), CAPACITY, "layout"),
        (LAYOUT, CAPACITY + 1, "capacity_blocks 8, the tier's 9"),
    ],
)
def test_an_index_of_another_layout_or_capacity_is_discarded(tmp_path, layout, capacity, words):
    run_peer("write_blocks", tmp_path)
    with pytest.warns(DiskIndexWarning, match=words):
        tier = DiskTier(tmp_path, layout, capacity, persistent=True)
    with tier:
        assert len(tier) == 0


def test_a_tier_that_is_not_persistent_starts_empty_and_removes_an_old_index(tmp_path):
    run_peer("write_blocks", tmp_path)
    with DiskTier(tmp_path, LAYOUT, CAPACITY) as tier:
        assert len(tier) == 0 and not (tmp_path / INDEX_NAME).exists()
        with pytest.raises(InvalidArgumentError, match="not persistent"):
            tier.flush()
    assert not (tmp_path / INDEX_NAME).exists()  # its close wrote none
    with pytest.raises(TypeError, match="persistent must be a bool"):
        DiskTier(tmp_path, LAYOUT, CAPACITY, persistent=1)  # type: ignore[arg-type]


def test_a_restarted_prefix_cache_reads_its_prompt_from_the_reloaded_tier(tmp_path):
    seen = run_peer("serve_prompt", tmp_path)
    assert seen["written"] == 6
    pool = kvpool.Pool(
        LAYOUT, 8, device="host", enable_prefix_caching=True, prefix_hash_key=HASH_KEY
    )
    tables = kvpool.BlockTables(pool, 8, 8)
    with reopen(tmp_path, capacity=32) as tier:
        cache = PrefixDiskCache(tables, tier)
        reloaded = [bytes.fromhex(h) for h in seen["hashes"]]
        # Attaching the cache put the reloaded blocks in the pool's snapshot and stream.
        snapshot = pool.kv_cache_snapshot()
        assert sorted(b.block_hash for b in snapshot.blocks if b.medium == "disk") == sorted(
            reloaded
        )
        events = cache.take_kv_events()
        (stored,) = [e for e in events if e.medium == "disk"]
        assert isinstance(stored, kvpool.BlockStored) and stored.block_hashes == reloaded
        result, ready = cache.add_request(2, PROMPT)
        assert result.num_cached_tokens == 0 and ready == 16 * 6
        kv = np.random.default_rng(5).integers(0, 256, (7, BB), dtype=np.uint8)
        got = [block(pool, int(b)) for b in tables.blocks(2)[:6]]
        assert got == [row.tobytes() for row in kv[:6]]
        cache.free(2)
        pool.check_invariants()
        tier.check_invariants()


if __name__ == "__main__":
    roles = {"write_blocks": write_blocks, "write_then_crash": write_then_crash}
    roles["serve_prompt"] = serve_prompt
    print("RESULT " + json.dumps(roles[sys.argv[1]](sys.argv[2])), flush=True)
