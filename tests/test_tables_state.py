"""BlockTables against a plain-Python model, driven by a Hypothesis state machine.

The model knows, per request, its blocks and token count, its row (the dense row order that
`free` reshuffles) and its fork family; per block, its ref count. The pool picks the block
ids, so the model learns new ids from the tables, but only after checking that they were free.
Every rule that must fail checks the exception class and then (through the invariants) that
nothing changed. Settings come from the profile tests/conftest.py loads.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvpool import (
    BlockTables,
    CapacityError,
    DuplicateRequestError,
    InvalidArgumentError,
    KvError,
    KvLayout,
    OutOfBlocksError,
    Pool,
    UnknownRequestError,
)

BS = 4
LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=BS)
NUM_BLOCKS = 32
MAX_SEQS = 6
MAX_BLOCKS = 12

REQUEST_IDS = st.sampled_from([*range(8), 2**63, 2**64 - 1])
TOKENS = st.integers(0, 3 * BS + 1)
BATCH_COUNTS = st.one_of(st.integers(0, 3), st.integers(0, 40))


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BS)


@dataclass
class Request:
    blocks: list[int]
    num_tokens: int
    family: int


@dataclass
class Model:
    requests: dict[int, Request] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)  # request ids in row order
    ref_cnt: Counter[int] = field(default_factory=Counter)
    next_family: int = 0

    @property
    def num_free(self) -> int:
        return NUM_BLOCKS - sum(1 for c in self.ref_cnt.values() if c > 0)

    def take_fresh(self, blocks: list[int]) -> None:
        """Records blocks the pool just handed out; they must have been free and distinct."""
        assert len(set(blocks)) == len(blocks), f"one block handed out twice: {blocks}"
        for b in blocks:
            assert 0 <= b < NUM_BLOCKS and self.ref_cnt[b] == 0, f"block {b} was not free"
            self.ref_cnt[b] = 1

    def drop(self, block: int) -> None:
        self.ref_cnt[block] -= 1
        assert self.ref_cnt[block] >= 0
        if self.ref_cnt[block] == 0:
            del self.ref_cnt[block]


def check_slots(slots: list[int], blocks: list[int], start: int) -> None:
    """Each new token's slot lies in the request's own block for its position."""
    for i, slot in enumerate(slots):
        p = start + i
        assert slot == blocks[p // BS] * BS + p % BS


class BlockTablesMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool(LAYOUT, NUM_BLOCKS, device="host")
        self.tables = BlockTables(self.pool, MAX_SEQS, MAX_BLOCKS)
        self.model = Model()
        self.counter = 0  # alternates single appends between the two entry points

    # --- helpers --------------------------------------------------------------------------------

    def expected_add_error(self, request_id: int, num_tokens: int) -> type[KvError] | None:
        """The error `add` must raise, in the order the tables check: id, rows, width, blocks."""
        m = self.model
        if request_id in m.requests:
            return DuplicateRequestError
        if len(m.requests) == MAX_SEQS:
            return CapacityError
        if blocks_for(num_tokens) > MAX_BLOCKS:
            return CapacityError
        if blocks_for(num_tokens) > m.num_free:
            return OutOfBlocksError
        return None

    def plan_append(
        self, request_ids: list[int], counts: list[int]
    ) -> tuple[type[KvError] | None, set[int]]:
        """The error a batched append must raise (or None) and the requests that must copy
        their last block: a shared, partly filled last block is copied while someone else
        still holds it, so when all its holders append in one call, the last keeps it."""
        m = self.model
        unshared: Counter[int] = Counter()
        copying: set[int] = set()
        needed = 0
        for rid, count in zip(request_ids, counts):
            req = m.requests[rid]
            if blocks_for(req.num_tokens + count) > MAX_BLOCKS:
                return CapacityError, set()
            needed += blocks_for(req.num_tokens + count) - blocks_for(req.num_tokens)
            if count > 0 and req.num_tokens % BS != 0:
                last = req.blocks[-1]
                if m.ref_cnt[last] - unshared[last] > 1:
                    unshared[last] += 1
                    copying.add(rid)
                    needed += 1
        return (OutOfBlocksError if needed > m.num_free else None), copying

    def do_append(self, request_ids: list[int], counts: list[int]) -> None:
        m = self.model
        error, copying = self.plan_append(request_ids, counts)
        event(f"append: {error.__name__ if error else 'ok'}")
        if error is not None:
            with pytest.raises(error):
                self.tables.append_tokens_many(request_ids, counts)
            return
        if len(request_ids) == 1 and self.counter % 2 == 0:
            slots, copies = self.tables.append_tokens(request_ids[0], counts[0])
        else:
            slots, copies = self.tables.append_tokens_many(request_ids, counts)
        self.counter += 1
        assert slots.dtype == np.int64 and copies.dtype == np.int32 and copies.shape[1:] == (2,)
        expected_copies: list[list[int]] = []
        fresh: list[int] = []
        offset = 0
        for rid, count in zip(request_ids, counts):
            req = m.requests[rid]
            now = self.tables.blocks(rid).tolist()
            old_blocks = len(req.blocks)
            assert len(now) == blocks_for(req.num_tokens + count)
            if rid in copying:
                # copy-on-write: exactly the last block changed
                assert now[: old_blocks - 1] == req.blocks[:-1]
                src, dst = req.blocks[-1], now[old_blocks - 1]
                expected_copies.append([src, dst])
                fresh.append(dst)
                m.drop(src)
                assert m.ref_cnt[src] >= 1, "the copied-from block must still be shared"
            else:
                assert now[:old_blocks] == req.blocks
            fresh.extend(now[old_blocks:])
            check_slots(slots[offset : offset + count].tolist(), now, req.num_tokens)
            offset += count
            req.blocks, req.num_tokens = now, req.num_tokens + count
        assert offset == len(slots)
        assert copies.tolist() == expected_copies
        event(f"append: {min(len(expected_copies), 2)} copies")
        m.take_fresh(fresh)

    def existing(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.model.requests)))

    def shared_partial(self) -> list[int]:
        """Requests whose partly filled last block someone else also holds."""
        m = self.model
        return sorted(
            rid
            for rid, req in m.requests.items()
            if req.num_tokens % BS != 0 and m.ref_cnt[req.blocks[-1]] > 1
        )

    # --- rules ------------------------------------------------------------------------------------

    @initialize(num_tokens=st.integers(1, 3 * BS))
    def first_request(self, num_tokens: int) -> None:
        self.add(0, num_tokens)

    @precondition(lambda self: self.shared_partial())
    @rule(data=st.data())
    def write_shared(self, data: st.DataObject) -> None:
        """Copy-on-write: some of the holders of a shared partial block append, in any order."""
        rid = data.draw(st.sampled_from(self.shared_partial()))
        last = self.model.requests[rid].blocks[-1]
        holders = [r for r, req in self.model.requests.items() if last in req.blocks]
        ids = data.draw(st.lists(st.sampled_from(holders), min_size=1, unique=True))
        counts = data.draw(st.lists(st.integers(0, BS + 1), min_size=len(ids), max_size=len(ids)))
        self.do_append(ids, counts)

    @rule(request_id=REQUEST_IDS, num_tokens=TOKENS)
    def add(self, request_id: int, num_tokens: int) -> None:
        m = self.model
        error = self.expected_add_error(request_id, num_tokens)
        event(f"add: {error.__name__ if error else 'ok'}")
        if error is not None:
            with pytest.raises(error):
                self.tables.add(request_id, num_tokens)
            return
        slots = self.tables.add(request_id, num_tokens).tolist()
        blocks = self.tables.blocks(request_id).tolist()
        assert len(blocks) == blocks_for(num_tokens)
        m.take_fresh(blocks)
        check_slots(slots, blocks, 0)
        m.requests[request_id] = Request(blocks, num_tokens, m.next_family)
        m.next_family += 1
        m.rows.append(request_id)

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data(), count=st.integers(0, 2 * BS + 1))
    def append_one(self, data: st.DataObject, count: int) -> None:
        self.do_append([self.existing(data)], [count])

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data())
    def append_many(self, data: st.DataObject) -> None:
        ids = data.draw(st.permutations(sorted(self.model.requests)))
        ids = ids[: data.draw(st.integers(0, len(ids)))]
        counts = data.draw(st.lists(BATCH_COUNTS, min_size=len(ids), max_size=len(ids)))
        self.do_append(ids, counts)

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data())
    def decode_step(self, data: st.DataObject) -> None:
        """What a scheduler does every step: every request grows by one token."""
        self.do_append(list(self.model.rows), [1] * len(self.model.rows))

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data(), child=REQUEST_IDS)
    def fork(self, data: st.DataObject, child: int) -> None:
        m = self.model
        parent = self.existing(data)
        if child in m.requests:
            with pytest.raises(DuplicateRequestError):
                self.tables.fork(parent, child)
            return
        if len(m.requests) == MAX_SEQS:
            with pytest.raises(CapacityError):
                self.tables.fork(parent, child)
            return
        self.tables.fork(parent, child)
        p = m.requests[parent]
        m.requests[child] = Request(list(p.blocks), p.num_tokens, p.family)
        m.rows.append(child)
        for b in p.blocks:
            m.ref_cnt[b] += 1

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        m = self.model
        rid = self.existing(data)
        self.tables.free(rid)
        for b in m.requests.pop(rid).blocks:
            m.drop(b)
        hole = m.rows.index(rid)
        m.rows[hole] = m.rows[-1]
        m.rows.pop()

    @precondition(
        lambda self: len(self.model.requests) < MAX_SEQS and self.model.num_free < MAX_BLOCKS
    )
    @rule()
    def add_exhausts(self) -> None:
        rid = next(r for r in range(100) if r not in self.model.requests)
        with pytest.raises(OutOfBlocksError) as excinfo:
            self.tables.add(rid, self.model.num_free * BS + 1)
        assert (excinfo.value.requested, excinfo.value.free) == (
            self.model.num_free + 1,
            self.model.num_free,
        )

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data())
    def append_exhausts(self, data: st.DataObject) -> None:
        """The whole batch asks for more blocks than are free: nobody grows."""
        m = self.model
        ids = sorted(m.requests)
        if sum(MAX_BLOCKS - len(m.requests[r].blocks) for r in ids) <= m.num_free:
            return  # cannot exhaust the pool within the tables' capacity
        counts = [(MAX_BLOCKS * BS) - m.requests[i].num_tokens for i in ids]  # fill every row
        assert self.plan_append(ids, counts)[0] is OutOfBlocksError
        with pytest.raises(OutOfBlocksError):
            self.tables.append_tokens_many(ids, counts)

    @rule(request_id=REQUEST_IDS, data=st.data())
    def unknown_id(self, request_id: int, data: st.DataObject) -> None:
        if request_id in self.model.requests:
            return
        op = data.draw(
            st.sampled_from(
                ["num_tokens", "blocks", "append", "append_many", "fork", "free", "csr"]
            )
        )
        known = sorted(self.model.requests)
        with pytest.raises(UnknownRequestError):
            if op == "num_tokens":
                self.tables.num_tokens(request_id)
            elif op == "blocks":
                self.tables.blocks(request_id)
            elif op == "append":
                self.tables.append_tokens(request_id, 1)
            elif op == "append_many":
                self.tables.append_tokens_many([*known, request_id], [0] * len(known) + [1])
            elif op == "fork":
                self.tables.fork(request_id, 10**6)
            elif op == "free":
                self.tables.free(request_id)
            else:
                self.tables.csr([*known, request_id])

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data())
    def repeated_id(self, data: st.DataObject) -> None:
        rid = self.existing(data)
        with pytest.raises(InvalidArgumentError):
            self.tables.append_tokens_many([rid, *self.model.requests], 0)

    # --- invariants --------------------------------------------------------------------------------

    @invariant()
    def checks_pass(self) -> None:
        self.tables.check_invariants()
        self.pool.check_invariants(exact_refs=True)

    @invariant()
    def no_leak_and_exact_ref_counts(self) -> None:
        m = self.model
        held = {b for r in m.requests.values() for b in r.blocks}
        assert self.pool.num_free == NUM_BLOCKS - len(held) == m.num_free
        assert [self.pool.ref_cnt(b) for b in range(NUM_BLOCKS)] == [
            m.ref_cnt[b] for b in range(NUM_BLOCKS)
        ]
        refs = Counter(b for r in m.requests.values() for b in r.blocks)
        assert refs == +m.ref_cnt

    @invariant()
    def rows_equal_the_model(self) -> None:
        m = self.model
        assert self.tables.request_ids() == m.rows
        assert len(self.tables) == len(m.rows)
        table, seq_lens = self.tables.sync()
        assert seq_lens.tolist() == [m.requests[r].num_tokens for r in m.rows]
        expected = [
            m.requests[r].blocks + [-1] * (MAX_BLOCKS - len(m.requests[r].blocks)) for r in m.rows
        ]
        assert table.tolist() == expected
        for r in m.rows:
            assert self.tables.num_tokens(r) == m.requests[r].num_tokens

    @invariant()
    def blocks_shared_only_within_a_fork_family(self) -> None:
        family_of: dict[int, int] = {}
        for req in self.model.requests.values():
            for b in req.blocks:
                assert family_of.setdefault(b, req.family) == req.family, (
                    f"block {b} shared across families"
                )


test_block_tables_state = BlockTablesMachine.TestCase
