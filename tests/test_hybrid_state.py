"""HybridTables against the plain-Python model of tests/hybrid_model.py, driven by a Hypothesis
state machine over a mixed model: two sliding windows (one shorter than a page, one spanning
pages), full attention, chunked local attention, an MLA latent (12-token pages) and a
recurrent state split over pages, with a host tier that swaps whole requests out and in.

The machine plays the kernels on the host slab: it fills every new page with fresh bytes and
runs the copies each append returns, so a request swapped out and back must come back with
exactly the bytes it left with (its device pages were reused and overwritten meanwhile).

After every step: the tables equal the model's, every page a table holds has a key some
future query sees (and every such page is held), pages are conserved per group and over the
slab, reference counts match, and the core's own invariants hold. A rule that must fail checks
the exception class and that nothing changed. Settings come from the profile
tests/conftest.py loads. The mutation tests show the model catching a one-token window error.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hybrid_model import HybridModel
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kvpool import (
    DuplicateRequestError,
    HostTierFullError,
    HybridHostTier,
    HybridTables,
    InvalidArgumentError,
    KvGroup,
    KvLayout,
    ModelKvSpec,
    OutOfBlocksError,
    Pool,
    UnknownRequestError,
    WrongTierError,
)

PAGE_BYTES = 1024
NUM_BLOCKS = 72
HOST_BLOCKS = 40


def slab_pages(pool: Pool) -> np.ndarray:
    """A host pool's slab as a writable uint8 array [num_blocks, block_bytes], over its raw
    address (a test's stand-in for the kernels that read and write pages). The caller keeps
    `pool` alive while it uses the array."""
    size = pool.num_blocks * pool.block_bytes
    buffer = (ctypes.c_uint8 * size).from_address(pool.base_ptr)
    return np.frombuffer(buffer, dtype=np.uint8).reshape(pool.num_blocks, pool.block_bytes)


def mixed_spec() -> ModelKvSpec:
    # 1 KV head of 16 fp16 elements: 64 bytes a token and layer (K and V).
    return ModelKvSpec(
        [
            KvGroup.sliding_window([0, 5], 5, 1, 16),  # 128 bytes a token: 8 a page
            KvGroup.full([1], 1, 16),  # 16 a page
            KvGroup.chunked_local([2], 12, 1, 16),  # 16 a page, chunks of 12
            KvGroup.mla_latent([3], latent_dim=32, rope_dim=8),  # 80 bytes: 12 a page
            KvGroup.recurrent_state([4, 6], 1500),  # 2 pages a layer: 4 a slot
            KvGroup.sliding_window([7], 20, 1, 16),  # 16 a page, window over 2 pages
        ],
        page_bytes=PAGE_BYTES,
    )


def test_the_mixed_spec_has_the_geometry_the_machine_counts_on():
    spec = mixed_spec()
    assert [spec.block_size(g) for g in range(6)] == [8, 16, 16, 12, None, 16]
    assert spec.pages_per_slot(4) == 4 and spec.state_packing(4) == ("pages_per_layer", 2)


REQUEST_IDS = st.sampled_from([*range(6), 2**64 - 1])
TOKENS = st.one_of(st.integers(0, 24), st.integers(0, 60))
COUNTS = st.one_of(st.integers(0, 3), st.integers(0, 30))


class HybridMachine(RuleBasedStateMachine):
    window_error = 0

    def __init__(self) -> None:
        super().__init__()
        self.spec = mixed_spec()
        self.pool = Pool.for_spec(self.spec, NUM_BLOCKS, device="host")
        self.tables = HybridTables(self.pool, self.spec)
        self.tier = HybridHostTier(self.tables, HOST_BLOCKS)
        self.model = HybridModel(self.spec, NUM_BLOCKS, window_error=self.window_error)
        self.pages = slab_pages(self.pool)
        self.rng = np.random.default_rng(0)
        # A swapped-out request's page bytes, by (group, page index), as it left the device.
        self.swapped_bytes: dict[int, dict[tuple[int, int], bytes]] = {}

    def write_new(self, pages: list[int]) -> None:
        """New tokens' K/V (or a new state) in fresh pages: bytes no other page has."""
        for page in pages:
            self.pages[page] = self.rng.integers(0, 256, PAGE_BYTES, dtype=np.uint8)

    def run_copies(self, copies: np.ndarray) -> None:
        for _, src, dst in copies:
            self.pages[dst] = self.pages[src]

    def request_bytes(self, rid: int) -> dict[tuple[int, int], bytes]:
        out = {}
        for g in range(self.spec.num_groups):
            first, ids, _ = self.tables.table(rid, g)
            for i, page in enumerate(ids):
                out[(g, first + i)] = self.pages[page].tobytes()
        return out

    def snapshot(self) -> object:
        out: list[object] = [self.pool.num_free, len(self.tables), self.tier.request_ids()]
        out.append(self.tier.pool.num_free)
        for rid in sorted(self.model.requests):
            for g in range(self.spec.num_groups):
                first, ids, n = self.tables.table(rid, g)
                out.append((rid, g, first, ids.tolist(), n))
        return out

    def refused(self, error: type[Exception], call, *args: object) -> None:
        before = self.snapshot()
        with pytest.raises(error):
            call(*args)
        assert self.snapshot() == before

    def has_requests(self) -> bool:
        return bool(self.model.requests)

    def existing(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.model.requests)), label="request")

    @initialize(n=TOKENS)
    def first_request(self, n: int) -> None:
        self.tables.add(0, n)
        self.write_new(self.model.add(self.tables, 0, n))

    @rule(rid=REQUEST_IDS, n=TOKENS)
    def add(self, rid: int, n: int) -> None:
        if rid in self.model.requests or rid in self.model.swapped:
            # A swapped-out id is taken too: the tables know the tier holds it.
            self.refused(DuplicateRequestError, self.tables.add, rid, n)
        elif not self.model.add_fits(n):
            event("add out of pages")
            self.refused(OutOfBlocksError, self.tables.add, rid, n)
        else:
            self.tables.add(rid, n)
            self.write_new(self.model.add(self.tables, rid, n))

    @precondition(has_requests)
    @rule(data=st.data(), count=COUNTS)
    def append(self, data: st.DataObject, count: int) -> None:
        rid = self.existing(data)
        if not self.model.append_fits([rid], [count]):
            event("append out of pages")
            self.refused(OutOfBlocksError, self.tables.append_tokens, rid, count)
        else:
            copies = self.tables.append_tokens(rid, count)
            event("append copies pages" if len(copies) else "append copies nothing")
            self.run_copies(copies)
            self.write_new(self.model.append(self.tables, rid, count, copies))

    @precondition(has_requests)
    @rule(data=st.data())
    def append_many(self, data: st.DataObject) -> None:
        ids = st.sampled_from(sorted(self.model.requests))
        rids = data.draw(st.lists(ids, min_size=1, max_size=4, unique=True), label="requests")
        counts = data.draw(st.lists(COUNTS, min_size=len(rids), max_size=len(rids)))
        if not self.model.append_fits(rids, counts):
            event("append_many out of pages")
            self.refused(OutOfBlocksError, self.tables.append_tokens_many, rids, counts)
            return
        copies = self.tables.append_tokens_many(np.array(rids, dtype=np.uint64), counts)
        event(f"append_many of {len(rids)}, {'some' if len(copies) else 'no'} copies")
        at = 0
        for rid, count in zip(rids, counts, strict=True):
            # In call order, each request's copies as planned on the state its turn saw
            # (an earlier sibling's copy un-shares a page: the later one copies less).
            k = self.model.expected_copy_count(rid, count)
            self.run_copies(copies[at : at + k])
            self.write_new(self.model.append(self.tables, rid, count, copies[at : at + k]))
            at += k
        assert at == len(copies)

    @precondition(has_requests)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        ids = st.sampled_from(sorted(self.model.requests))
        rids = data.draw(st.lists(ids, min_size=1, max_size=3, unique=True), label="requests")
        needed = sum(self.model.num_pages(self.model.requests[r]) for r in rids)
        if self.model.host_pages_used() + needed > HOST_BLOCKS:
            event("swap_out: host tier full")
            self.refused(HostTierFullError, self.tier.swap_out, rids)
            return
        for rid in rids:
            self.swapped_bytes[rid] = self.request_bytes(rid)
        stats = self.tier.swap_out(rids)
        assert (stats["num_requests"], stats["num_blocks"]) == (len(rids), needed)
        assert self.tier.num_pending == (0, 0)  # host copies finish in the call
        self.model.swap_out(rids)
        assert all(self.tier.location(r) == "host" for r in rids)

    @precondition(lambda self: self.model.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        ids = st.sampled_from(sorted(self.model.swapped))
        rids = data.draw(st.lists(ids, min_size=1, max_size=3, unique=True), label="requests")
        needed = sum(self.model.num_pages(self.model.swapped[r]) for r in rids)
        if needed > self.model.num_free:
            event("swap_in: device pool full")
            self.refused(OutOfBlocksError, self.tier.swap_in, rids)
            return
        self.tier.swap_in(rids)
        event("swap_in")
        self.model.swap_in(self.tables, rids)
        for rid in rids:
            assert self.request_bytes(rid) == self.swapped_bytes.pop(rid), rid

    @precondition(lambda self: self.model.swapped)
    @rule(data=st.data())
    def free_swapped(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model.swapped)), label="request")
        self.tier.free(rid)
        self.model.free_swapped(rid)
        del self.swapped_bytes[rid]
        assert self.tier.location(rid) is None

    @precondition(has_requests)
    @rule(data=st.data())
    def swaps_from_the_wrong_tier_are_refused(self, data: st.DataObject) -> None:
        on_device = self.existing(data)
        self.refused(WrongTierError, self.tier.swap_in, [on_device])
        self.refused(WrongTierError, self.tier.free, on_device)
        if self.model.swapped:
            on_host = min(self.model.swapped)
            self.refused(WrongTierError, self.tier.swap_out, [on_host])

    @rule(rid=REQUEST_IDS, count=COUNTS, child=REQUEST_IDS)
    def calls_on_an_unknown_request_are_refused(self, rid: int, count: int, child: int) -> None:
        if rid in self.model.requests or rid in self.model.swapped:
            return
        self.refused(UnknownRequestError, self.tables.append_tokens, rid, count)
        self.refused(UnknownRequestError, self.tables.free, rid)
        self.refused(UnknownRequestError, self.tables.fork, rid, child)
        known = sorted(self.model.requests)[:1]
        self.refused(UnknownRequestError, self.tables.append_tokens_many, [*known, rid], count)

    @precondition(has_requests)
    @rule(data=st.data())
    def append_twice_in_one_call_is_refused(self, data: st.DataObject) -> None:
        rid = self.existing(data)
        self.refused(InvalidArgumentError, self.tables.append_tokens_many, [rid, rid], 1)

    @precondition(has_requests)
    @rule(data=st.data(), child=REQUEST_IDS)
    def fork(self, data: st.DataObject, child: int) -> None:
        parent = self.existing(data)
        if child in self.model.requests or child in self.model.swapped:
            self.refused(DuplicateRequestError, self.tables.fork, parent, child)
        else:
            self.tables.fork(parent, child)
            self.model.fork(parent, child)

    @precondition(has_requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = self.existing(data)
        self.tables.free(rid)
        self.model.free(rid)

    @rule()
    def free_everything(self) -> None:
        for rid in list(self.model.requests):
            self.tables.free(rid)
            self.model.free(rid)
        for rid in list(self.model.swapped):
            self.tier.free(rid)
            self.model.free_swapped(rid)
        self.swapped_bytes.clear()
        assert self.pool.num_used == 0 and self.pool.num_free == NUM_BLOCKS
        assert self.tier.pool.num_used == 0 and len(self.tier) == 0
        assert len(self.tables) == 0

    @invariant()
    def tables_equal_the_model(self) -> None:
        self.model.check_tables_equal(self.tables)

    @invariant()
    def pages_are_conserved(self) -> None:
        self.model.check_conservation(self.tables)

    @invariant()
    def no_page_is_held_that_no_future_query_sees(self) -> None:
        self.model.check_visibility()

    @invariant()
    def the_host_tier_holds_the_swapped_requests(self) -> None:
        self.model.check_host_tier(self.tier)

    @invariant()
    def core_invariants_hold(self) -> None:
        self.tables.check_invariants()
        self.tier.check_invariants()
        self.pool.check_invariants()

    def teardown(self) -> None:
        for rid in list(self.model.requests):
            self.tables.free(rid)
        for rid in list(self.model.swapped):
            self.tier.free(rid)
        assert self.pool.num_used == 0, "pages leaked after every request was freed"
        assert self.tier.pool.num_used == 0, "host pages leaked"
        self.tables.check_invariants()
        self.tier.check_invariants()


TestHybridTables = HybridMachine.TestCase
# Longer runs than the default 50 steps: a window moves past pages only after several appends.
TestHybridTables.settings = settings(stateful_step_count=80)


class OffByOneWindowMachine(HybridMachine):
    """The same machine over a model whose windows are one token wider than the spec's."""

    window_error = 1


def test_the_model_catches_a_one_token_window_error():
    """Group 0 (window 5, 8-token pages) at 21 tokens with queries from 20 on: the query at
    20 sees keys 16..20, so pages 0 and 1 go and page 2 (keys 16..23) stays. A model with a
    6-token window keeps key 15, page 1: it must disagree with the tables there."""
    spec = mixed_spec()
    for window_error, should_agree in [(0, True), (1, False)]:
        pool = Pool(KvLayout(1, 1, PAGE_BYTES // 4, 1), NUM_BLOCKS, device="host")
        tables = HybridTables(pool, spec)
        model = HybridModel(spec, NUM_BLOCKS, window_error=window_error)
        tables.add(0, 20)
        model.add(tables, 0, 20)
        copies = tables.append_tokens(0, 1)
        assert tables.table(0, 0)[0] == 2
        try:
            model.append(tables, 0, 1, copies)
            model.check_tables_equal(tables)
            agreed = True
        except AssertionError:
            agreed = False
        assert agreed == should_agree, window_error


def test_the_state_machine_fails_over_the_off_by_one_model():
    """The random steps reach the disagreement too: the machine over the wider-window model
    must fail (derandomized, so always on the same draws)."""
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            OffByOneWindowMachine,
            # Finding the failure is the point: shrinking it would only cost time.
            settings=settings(max_examples=60, print_blob=False, phases=[Phase.generate]),
        )
