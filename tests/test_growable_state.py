"""A Hypothesis state machine drives a growable host pool and a plain-Python model.

The model knows which blocks are held (and the bytes written into each through the host K
and V views), how many chunks are mapped, and from that how many blocks exist. Rules: alloc,
alloc_many (growing on demand or failing at the maximum), free, free_many, grow, shrink,
double free and freeing an id past the end. Invariants after every step: the pool's
counts (free + used = num_blocks), mapped chunks cover every held block (so no chunk with a
live block was unmapped), and every held block still holds its bytes, byte for byte, across every growth and shrink.
"""

from __future__ import annotations

import numpy as np
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from kvpool import DoubleFreeError, InvalidBlockError, KvLayout, OutOfBlocksError, Pool

LAYOUT = KvLayout(1, 2, 96, 2)  # 1536-byte blocks (768 K + 768 V): they straddle 4 KiB chunks
BLOCK = LAYOUT.block_bytes
CHUNK = 4096


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class GrowableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: Pool
        self.held: dict[int, int] = {}  # id -> the seed its bytes were written from
        self.mapped_chunks = 0
        self.max_num_blocks = 0
        self.next_seed = 0

    @initialize(max_num_blocks=st.integers(1, 40), initial=st.integers(0, 40))
    def make_pool(self, max_num_blocks: int, initial: int) -> None:
        initial = min(initial, max_num_blocks)
        self.max_num_blocks = max_num_blocks
        self.pool = Pool(
            LAYOUT,
            growable=True,
            max_num_blocks=max_num_blocks,
            initial_num_blocks=initial,
            chunk_bytes=CHUNK,
            device="host",
        )
        self.mapped_chunks = ceil_div(initial * BLOCK, CHUNK)

    # --- model ----------------------------------------------------------------------------

    def num_blocks(self) -> int:
        return min(self.mapped_chunks * CHUNK // BLOCK, self.max_num_blocks)

    def num_free(self) -> int:
        return self.num_blocks() - len(self.held)

    def chunks_for(self, num_blocks: int) -> int:
        return ceil_div(num_blocks * BLOCK, CHUNK)

    def pattern(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        shape = self.pool.k_view(0).shape[1:]
        return rng.standard_normal(shape).astype(np.float16), rng.standard_normal(shape).astype(
            np.float16
        )

    def write(self, block_id: int) -> None:
        self.next_seed += 1
        k, v = self.pattern(self.next_seed)
        self.pool.k_view(0)[block_id] = k
        self.pool.v_view(0)[block_id] = v
        self.held[block_id] = self.next_seed

    def took(self, ids: list[int], grew: bool) -> None:
        free_before = set(range(self.num_blocks())) - set(self.held)
        assert len(set(ids)) == len(ids)
        if grew:
            self.mapped_chunks = max(self.mapped_chunks, self.chunks_for(len(self.held) + len(ids)))
            # A growth pushes old and new free ids sorted: the lowest come out first.
            free_after = set(range(self.num_blocks())) - set(self.held)
            assert ids == sorted(free_after)[: len(ids)], (ids, sorted(free_after))
        else:
            assert set(ids) <= free_before, (ids, free_before)
        for i in ids:
            assert 0 <= i < self.num_blocks()
            self.write(i)

    def expect_alloc(self, n: int) -> bool | None:
        """True: succeeds by growing, False: succeeds without, None: fails at the maximum."""
        if n <= self.num_free():
            return False
        return True if len(self.held) + n <= self.max_num_blocks else None

    # --- rules ----------------------------------------------------------------------------

    @rule(n=st.integers(0, 12))
    def alloc_many(self, n: int) -> None:
        outcome = self.expect_alloc(n)
        if outcome is None:
            before = (self.pool.num_blocks, self.pool.num_free, self.pool.stats()["mapped_bytes"])
            try:
                self.pool.alloc_many(n)
            except OutOfBlocksError as e:
                assert (e.requested, e.free, e.max_num_blocks) == (
                    n,
                    self.num_free(),
                    self.max_num_blocks,
                )
            else:
                raise AssertionError(f"alloc_many({n}) succeeded past max_num_blocks")
            assert (
                self.pool.num_blocks,
                self.pool.num_free,
                self.pool.stats()["mapped_bytes"],
            ) == before
            return
        ids = self.pool.alloc_many(n).tolist()
        note(f"alloc_many({n}) -> {ids}")
        self.took(ids, grew=outcome)

    @rule()
    def alloc(self) -> None:
        outcome = self.expect_alloc(1)
        if outcome is None:
            try:
                self.pool.alloc()
            except OutOfBlocksError:
                return
            raise AssertionError("alloc succeeded past max_num_blocks")
        self.took([self.pool.alloc()], grew=outcome)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(sorted(self.held)))
        self.pool.free(block_id)
        del self.held[block_id]

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_many(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), unique=True, min_size=1))
        self.pool.free_many(np.asarray(ids, dtype=np.int64))
        for i in ids:
            del self.held[i]

    @rule(num_blocks=st.integers(0, 44))
    def grow(self, num_blocks: int) -> None:
        target = num_blocks
        if target > self.max_num_blocks:
            try:
                self.pool.grow(target)
            except OutOfBlocksError as e:
                assert e.max_num_blocks == self.max_num_blocks
                return
            raise AssertionError(f"grow({target}) succeeded past max_num_blocks")
        old = self.mapped_chunks
        if target > self.num_blocks():
            self.mapped_chunks = self.chunks_for(target)
        assert self.pool.grow(target) == (self.mapped_chunks - old) * CHUNK

    @rule()
    def shrink(self) -> None:
        live_end = max(self.held, default=-1) + 1
        keep = max(self.chunks_for(live_end), 0)
        released = max(self.mapped_chunks - keep, 0) * CHUNK
        self.mapped_chunks = min(self.mapped_chunks, keep)
        assert self.pool.shrink() == released

    @precondition(lambda self: self.num_free() > 0)
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        block_id = data.draw(
            st.sampled_from(sorted(set(range(self.num_blocks())) - set(self.held)))
        )
        try:
            self.pool.free(block_id)
        except DoubleFreeError:
            return
        raise AssertionError(f"freeing free block {block_id} succeeded")

    @rule(offset=st.integers(0, 8))
    def free_past_the_end(self, offset: int) -> None:
        try:
            self.pool.free(self.num_blocks() + offset)
        except InvalidBlockError:
            return
        raise AssertionError("freeing an id past num_blocks succeeded")

    # --- invariants -----------------------------------------------------------------------

    @invariant()
    def counts_match_the_model(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        stats = self.pool.stats()
        assert stats["num_blocks"] == self.num_blocks()
        assert stats["num_free"] == self.num_free()
        assert stats["num_used"] == len(self.held)
        assert stats["mapped_bytes"] == self.mapped_chunks * CHUNK
        assert stats["num_chunks"] == self.mapped_chunks
        assert self.num_blocks() * BLOCK <= stats["mapped_bytes"] <= stats["reserved_bytes"]
        for i in range(self.num_blocks()):
            assert self.pool.ref_cnt(i) == (1 if i in self.held else 0)

    @invariant()
    def mapped_chunks_cover_every_held_block(self) -> None:
        if not hasattr(self, "pool"):
            return
        mapped = self.pool.stats()["mapped_bytes"]
        assert isinstance(mapped, int)
        for i in self.held:
            assert (i + 1) * BLOCK <= mapped, f"block {i} is held but its chunk is unmapped"

    @invariant()
    def held_blocks_keep_their_bytes(self) -> None:
        if not hasattr(self, "pool"):
            return
        k_view, v_view = self.pool.k_view(0), self.pool.v_view(0)
        assert k_view.shape[0] == self.num_blocks()
        for i, seed in self.held.items():
            k, v = self.pattern(seed)
            assert k_view[i].tobytes() == k.tobytes(), f"K of block {i} changed"
            assert v_view[i].tobytes() == v.tobytes(), f"V of block {i} changed"


TestGrowableMachine = GrowableMachine.TestCase
