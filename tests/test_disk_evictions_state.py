"""PrefixDiskCache over a pool too small for its prompts, driven by a Hypothesis state machine:
requests of a few prompts are added (their KV "computed" as a code unique to prompt and
block), freed, and the disk copy of a block corrupted or the file cut short, in any order.
Whatever a request finds cached, in the pool, its host tier or on disk, must hold exactly the
bytes computed for it; a corrupt or cut block is never a hit. After every rule the pool, its
eviction stage and the disk tier are conserved and the pool's snapshot lists exactly the
disk's blocks. Settings come from the profile tests/conftest.py loads.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import kvpool
import nixl_required  # noqa: F401  (loads NIXL, or skips this module)
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvpool import OutOfBlocksError
from kvpool.tier import DiskTier, PrefixDiskCache

LAYOUT = kvpool.KvLayout(1, 1, 128, 16)  # 4 KiB blocks
BB = LAYOUT.block_bytes
FULL = 3  # full blocks per prompt, then one token
PROMPTS = 5
POOL_BLOCKS = 8
DISK_BLOCKS = 9  # fewer than the prompts' 15 blocks: the disk evicts too


def prompt(p: int) -> list[int]:
    return [1000 * (p + 1) + t for t in range(FULL * 16 + 1)]


def code(p: int, k: int) -> bytes:
    """The KV of block k of prompt p: a pattern no other block has."""
    return bytes([p + 1, k + 1]) * (BB // 2)


class DiskEvictionMachine(RuleBasedStateMachine):
    @initialize(host_blocks=st.sampled_from([0, 2]), write_through=st.booleans())
    def setup(self, host_blocks: int, write_through: bool) -> None:
        self.pool = kvpool.Pool(
            LAYOUT,
            POOL_BLOCKS,
            device="host",
            enable_prefix_caching=True,
            prefix_cache_host_blocks=host_blocks or None,
        )
        self.tables = kvpool.BlockTables(self.pool, 4, 8)
        self.dir = tempfile.mkdtemp(prefix="kvpool-disk-state-")
        self.tier = DiskTier(self.dir, LAYOUT, DISK_BLOCKS)
        self.cache = PrefixDiskCache(self.tables, self.tier, write_through=write_through)
        self.active: dict[int, int] = {}  # request -> prompt
        self.next_id = 1

    def teardown(self) -> None:
        if hasattr(self, "tier"):
            self.tier.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def slab(self) -> np.ndarray:
        import ctypes

        buf = (ctypes.c_uint8 * (POOL_BLOCKS * BB)).from_address(self.pool.base_ptr)
        return np.ctypeslib.as_array(buf)

    @precondition(lambda self: len(self.active) < 2)
    @rule(p=st.integers(0, PROMPTS - 1))
    def add(self, p: int) -> None:
        rid = self.next_id
        self.next_id += 1
        try:
            _, ready = self.cache.add_request(rid, prompt(p))
        except OutOfBlocksError:
            return
        assert ready % 16 == 0 and ready <= FULL * 16
        blocks = [int(b) for b in self.tables.blocks(rid)]
        slab = self.slab()
        for k in range(ready // 16):  # found: the pool's, the host tier's or the disk's
            got = slab[blocks[k] * BB : (blocks[k] + 1) * BB].tobytes()
            assert got == code(p, k), f"prompt {p} block {k}: wrong KV found"
        for k in range(ready // 16, FULL):  # computed
            slab[blocks[k] * BB : (blocks[k] + 1) * BB] = np.frombuffer(code(p, k), np.uint8)
        self.active[rid] = p

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def free(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.active)))
        self.cache.free(rid)
        del self.active[rid]

    @precondition(lambda self: len(self.tier) > 0)
    @rule(data=st.data(), cut=st.booleans())
    def damage_the_disk(self, data, cut: bool) -> None:
        victim = data.draw(st.sampled_from(self.tier.hashes()))
        slot = self.tier._index[victim].slot
        if cut:  # the file ends inside this block: it and every later slot are gone (a
            # later write past it leaves a hole of zeros, wrong KV too)
            os.truncate(self.tier.path, slot * BB + 7)
        else:
            with open(self.tier.path, "r+b") as f:
                f.seek(slot * BB + 5)
                f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")

    @rule()
    def write_evicted(self) -> None:
        self.cache.write_evicted()

    @invariant()
    def conserved(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.check_invariants()
        assert pool.num_free + pool.num_evictable + pool.num_used == pool.num_blocks
        self.cache.stage.check_invariants()
        assert self.cache.stage.stats()["num_taken"] == 0
        self.tier.check_invariants()
        self.cache.take_kv_events()  # moves the disk's events into the pool's queue
        disk = {b.block_hash for b in pool.kv_cache_snapshot().blocks if b.medium == "disk"}
        assert disk == set(self.tier.hashes())


TestDiskEvictionMachine = DiskEvictionMachine.TestCase
