"""A Hypothesis state machine drives a Pool and a plain-Python model side by side.

The model is a dict `held: id -> ref count` and a set `free`. Every rule either succeeds on
both or fails on the pool with the expected error and changes nothing; the invariants compare
the two after every step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvpool import DoubleFreeError, InvalidBlockError, KvError, KvLayout, OutOfBlocksError, Pool

LAYOUT = KvLayout(1, 1, 64, 4, dtype="float32")  # 2 KiB blocks: pools stay tiny
ID_CONTAINERS = ("list", "tuple", "int32", "int64", "generator")


def pack(ids: list[int], container: str) -> Any:
    if container == "list":
        return list(ids)
    if container == "tuple":
        return tuple(ids)
    if container == "int32":
        return np.asarray(ids, dtype=np.int32)
    if container == "int64":
        return np.asarray(ids, dtype=np.int64)
    return (i for i in ids)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: Pool
        self.other: Pool
        self.held: dict[int, int] = {}
        self.free_ids: set[int] = set()

    @initialize(num_blocks=st.integers(1, 48))
    def make_pool(self, num_blocks: int) -> None:
        self.pool = Pool(LAYOUT, num_blocks, device="host")
        # A second, larger pool: its ids may be out of this pool's range.
        self.other = Pool(LAYOUT, num_blocks + 16, device="host")
        self.free_ids = set(range(num_blocks))
        self.high_water = 0

    # --- helpers --------------------------------------------------------------------------

    def took(self, ids: list[int]) -> None:
        assert len(set(ids)) == len(ids), f"duplicate ids in one allocation: {ids}"
        for i in ids:
            assert 0 <= i < self.pool.num_blocks, i
            assert i in self.free_ids, (
                f"block {i} handed out while held (ref count {self.held.get(i)})"
            )
            assert i not in self.held
            self.free_ids.remove(i)
            self.held[i] = 1
        self.high_water = max(self.high_water, len(self.held))

    def released(self, ids: list[int]) -> None:
        for i in ids:
            self.held[i] -= 1
            if self.held[i] == 0:
                del self.held[i]
                self.free_ids.add(i)

    def state(self) -> tuple[dict[str, int | str], list[int]]:
        return self.pool.stats(), [self.pool.ref_cnt(i) for i in range(self.pool.num_blocks)]

    def expect_failure(self, error: type[KvError], call: object, *args: object) -> KvError:
        before = self.state()
        try:
            call(*args)  # type: ignore[operator]
        except error as e:
            assert self.state() == before, "a failed call changed the pool"
            return e
        raise AssertionError(f"{call} did not raise {error.__name__}")

    # --- rules ----------------------------------------------------------------------------

    @precondition(lambda self: self.free_ids)
    @rule()
    def alloc(self) -> None:
        self.took([self.pool.alloc()])

    @rule(data=st.data())
    def alloc_many(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, len(self.free_ids)), label="n")
        ids = self.pool.alloc_many(n)
        assert ids.dtype == np.int32 and ids.shape == (n,)
        self.took(ids.tolist())

    @rule(extra=st.integers(1, 70))
    def exhaustion(self, extra: int) -> None:
        n = len(self.free_ids) + extra
        e: Any = self.expect_failure(OutOfBlocksError, self.pool.alloc_many, n)
        assert (e.requested, e.free, e.num_blocks) == (n, len(self.free_ids), self.pool.num_blocks)
        if not self.free_ids:
            e = self.expect_failure(OutOfBlocksError, self.pool.alloc)
            assert (e.requested, e.free) == (1, 0)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(self.held)), label="id")
        self.pool.free(i)
        self.released([i])

    @precondition(lambda self: self.held)
    @rule(data=st.data(), container=st.sampled_from(ID_CONTAINERS))
    def free_many(self, data: st.DataObject, container: str) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), unique=True), label="ids")
        self.pool.free_many(pack(ids, container))
        self.released(ids)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), container=st.sampled_from(ID_CONTAINERS))
    def free_many_with_repeats(self, data: st.DataObject, container: str) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1), label="ids")
        repeat = data.draw(st.sampled_from(ids), label="repeated id")
        ids.insert(data.draw(st.integers(0, len(ids)), label="at"), repeat)
        self.expect_failure(InvalidBlockError, self.pool.free_many, pack(ids, container))

    @precondition(lambda self: self.free_ids)
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(self.free_ids)), label="free id")
        self.expect_failure(DoubleFreeError, self.pool.free, i)

    @precondition(lambda self: self.free_ids and self.held)
    @rule(data=st.data(), container=st.sampled_from(ID_CONTAINERS))
    def free_many_with_one_free(self, data: st.DataObject, container: str) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), unique=True), label="held ids")
        bad = data.draw(st.sampled_from(sorted(self.free_ids)), label="free id")
        at = data.draw(st.integers(0, len(ids)), label="at")
        ids.insert(at, bad)
        self.expect_failure(DoubleFreeError, self.pool.free_many, pack(ids, container))

    @rule(data=st.data())
    def foreign_id(self, data: st.DataObject) -> None:
        """An id allocated from another pool: out of range here, or (indistinguishably) one
        of ours, which is then judged by our own state."""
        i = self.other.alloc()
        try:
            if i >= self.pool.num_blocks:
                self.expect_failure(InvalidBlockError, self.pool.free, i)
            elif i in self.free_ids:
                self.expect_failure(DoubleFreeError, self.pool.free, i)
            elif data.draw(st.booleans(), label="free it"):
                self.pool.free(i)
                self.released([i])
        finally:
            self.other.free(i)

    @rule(
        data=st.data(),
        bad=st.one_of(
            st.integers(max_value=-1),
            st.integers(min_value=2**31),
            st.sampled_from(["num_blocks", "2**64", "2**200"]),
        ),
        container=st.sampled_from(ID_CONTAINERS + ("single",)),
    )
    def out_of_range_id(self, data: st.DataObject, bad: int | str, container: str) -> None:
        n = self.pool.num_blocks
        value = (
            bad
            if isinstance(bad, int)
            else {"num_blocks": n, "2**64": 2**64, "2**200": 2**200}[bad]
        )
        if container == "single":
            self.expect_failure(InvalidBlockError, self.pool.free, value)
            self.expect_failure(InvalidBlockError, self.pool.ref_cnt, value)
            return
        fits = {"int32": -(2**31) <= value < 2**31, "int64": -(2**63) <= value < 2**63}
        if not fits.get(container, True):
            container = "list"
        ids: list[int] = []
        if self.held:
            ids = data.draw(
                st.lists(st.sampled_from(sorted(self.held)), unique=True), label="held ids"
            )
        ids.insert(data.draw(st.integers(0, len(ids)), label="at"), value)
        self.expect_failure(InvalidBlockError, self.pool.free_many, pack(ids, container))

    # --- invariants -----------------------------------------------------------------------

    @invariant()
    def counts_match_the_model(self) -> None:
        assert self.pool.num_free == len(self.free_ids)
        assert self.pool.num_used == len(self.held)
        assert self.pool.high_water == self.high_water

    @invariant()
    def pool_invariants_hold(self) -> None:
        self.pool.check_invariants()

    @invariant()
    def held_and_free_partition_the_ids(self) -> None:
        # Nothing lost and nothing in two places.
        assert not (self.free_ids & self.held.keys())
        assert self.free_ids | self.held.keys() == set(range(self.pool.num_blocks))
        for i, refs in self.held.items():
            assert self.pool.ref_cnt(i) == refs > 0
        for i in self.free_ids:
            assert self.pool.ref_cnt(i) == 0

    def teardown(self) -> None:
        if hasattr(self, "pool"):
            note(f"held={sorted(self.held)}")
            if self.held:
                self.pool.free_many(sorted(self.held))
            assert self.pool.num_free == self.pool.num_blocks
            self.pool.check_invariants()
            self.other.check_invariants()
            assert self.other.num_free == self.other.num_blocks


TestPoolMachine = PoolMachine.TestCase
