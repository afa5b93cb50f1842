"""HostTier against a plain-Python model, driven by a Hypothesis state machine.

Two host pools stand in for the tiers (the device pool is a host `Pool`; the tier's pool is
plain host memory), so the whole protocol runs without CUDA: add, append (with the
copy-on-write copies run), fork, swap out, swap in, free on either tier and evict from the
host tier. Every token's K and V in every layer carry a code unique to (request, position,
layer, part); after every rule each request's bytes are read back through the tier that holds
it. Failing calls check their exception and (through the invariants) that nothing moved.
Settings come from the profile tests/conftest.py loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kvpool import (
    BlockTables,
    CapacityError,
    DuplicateRequestError,
    HostTier,
    HostTierFullError,
    InvalidArgumentError,
    KvLayout,
    OutOfBlocksError,
    Pool,
    UnknownRequestError,
    WrongTierError,
    copy_blocks,
)

BS = 4
LAYERS = 2
LAYOUT = KvLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=16, block_size=BS)
DEVICE_BLOCKS = 24
HOST_BLOCKS = 16
MAX_SEQS = 6
MAX_BLOCKS = 8

REQUEST_IDS = st.integers(0, 7)
TOKENS = st.integers(0, 3 * BS + 1)


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BS)


def code(request_id, position, layer: int, part: int):
    return (request_id * 4099 + position * 31 + layer * 7 + part * 3 + 1) % 65521


@dataclass
class Request:
    num_tokens: int
    codes: list[int]  # per position: the code its tokens were written with
    tier: str  # "device" or "host"


class HostTierMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.pool = Pool(LAYOUT, DEVICE_BLOCKS, device="host")
        self.tables = BlockTables(self.pool, MAX_SEQS, MAX_BLOCKS)
        self.tier = HostTier(self.tables, HOST_BLOCKS)
        self.requests: dict[int, Request] = {}

    # ---- helpers -------------------------------------------------------------------------

    def _write(self, request_id: int, slots: np.ndarray, start: int) -> None:
        """Writes the tokens at `slots` (positions start, start+1, ...) with their codes."""
        for i, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, BS)
            for layer in range(LAYERS):
                for part, view in enumerate((self.pool.k_view(layer), self.pool.v_view(layer))):
                    view.view(np.uint16)[block, offset] = code(request_id, start + i, layer, part)

    def _on(self, tier: str) -> list[int]:
        return sorted(r for r, q in self.requests.items() if q.tier == tier)

    # ---- rules ---------------------------------------------------------------------------

    @rule(request_id=REQUEST_IDS, num_tokens=TOKENS)
    def add(self, request_id: int, num_tokens: int) -> None:
        if request_id in self.requests:
            try:
                self.tables.add(request_id, num_tokens)
            except DuplicateRequestError:
                return
            raise AssertionError(f"request {request_id} added twice")
        rows = len(self._on("device"))
        needed = blocks_for(num_tokens)
        try:
            slots = self.tables.add(request_id, num_tokens)
        except CapacityError:
            assert rows == MAX_SEQS
            return
        except OutOfBlocksError:
            assert needed > self.pool.num_free
            return
        self._write(request_id, slots, 0)
        self.requests[request_id] = Request(num_tokens, [request_id] * num_tokens, "device")

    @rule(data=st.data(), count=st.integers(0, BS + 1))
    def append(self, data: st.DataObject, count: int) -> None:
        if not self.requests:
            return
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        req = self.requests[request_id]
        if req.tier == "host":
            try:
                self.tables.append_tokens(request_id, count)
            except WrongTierError as e:
                assert e.tier == "host"
                return
            raise AssertionError("appended to a swapped-out request")
        try:
            slots, copies = self.tables.append_tokens(request_id, count)
        except (OutOfBlocksError, CapacityError):
            return
        copy_blocks(self.pool, copies)
        self._write(request_id, slots, req.num_tokens)
        req.num_tokens += count
        req.codes += [request_id] * count

    @rule(data=st.data(), child=REQUEST_IDS)
    def fork(self, data: st.DataObject, child: int) -> None:
        device = self._on("device")
        if not device or child in self.requests:
            return
        parent = data.draw(st.sampled_from(device))
        try:
            self.tables.fork(parent, child)
        except CapacityError:
            return
        src = self.requests[parent]
        self.requests[child] = Request(src.num_tokens, list(src.codes), "device")

    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(REQUEST_IDS, max_size=3, unique=True))
        on_host = [r for r in ids if r in self.requests and self.requests[r].tier == "host"]
        unknown = [r for r in ids if r not in self.requests]
        needed = sum(blocks_for(self.requests[r].num_tokens) for r in ids if r in self.requests)
        try:
            stats = self.tier.swap_out(ids)
        except WrongTierError:
            assert on_host
            return
        except UnknownRequestError:
            assert unknown
            return
        except HostTierFullError as e:
            assert needed > self.tier.pool.num_free and e.requested == needed
            return
        assert not on_host and not unknown
        assert stats["num_blocks"] == needed and stats["num_requests"] == len(ids)
        assert stats["num_copies"] <= needed
        for r in ids:
            self.requests[r].tier = "host"

    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(REQUEST_IDS, max_size=3, unique=True))
        on_device = [r for r in ids if r in self.requests and self.requests[r].tier == "device"]
        unknown = [r for r in ids if r not in self.requests]
        needed = sum(blocks_for(self.requests[r].num_tokens) for r in ids if r in self.requests)
        rows = len(self._on("device"))
        try:
            stats = self.tier.swap_in(ids)
        except WrongTierError:
            assert on_device
            return
        except UnknownRequestError:
            assert unknown
            return
        except CapacityError:
            assert rows + len(ids) > MAX_SEQS
            return
        except OutOfBlocksError:
            assert needed > self.pool.num_free
            return
        assert not on_device and not unknown and stats["num_blocks"] == needed
        for r in ids:
            self.requests[r].tier = "device"

    @rule(request_id=REQUEST_IDS)
    def free(self, request_id: int) -> None:
        req = self.requests.get(request_id)
        if req is None:
            for call in (self.tables.free, self.tier.free):
                try:
                    call(request_id)
                except UnknownRequestError:
                    continue
                raise AssertionError(f"freed unknown request {request_id}")
            return
        if req.tier == "device":
            try:
                self.tier.free(request_id)  # the wrong tier: refused
            except WrongTierError as e:
                assert e.tier == "device"
            self.tables.free(request_id)
        else:
            try:
                self.tables.free(request_id)
            except WrongTierError as e:
                assert e.tier == "host"
            self.tier.free(request_id)  # evict from the host tier
        del self.requests[request_id]

    @rule(request_id=REQUEST_IDS)
    def swap_twice_in_one_call(self, request_id: int) -> None:
        try:
            self.tier.swap_out([request_id, request_id])
        except InvalidArgumentError:
            return
        raise AssertionError("a repeated id was accepted")

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "tier"):
            return
        self.tables.check_invariants()
        self.pool.check_invariants(exact_refs=True)
        self.tier.check_invariants()
        assert self.tier.num_pending == (0, 0)  # host copies complete at once
        device, host = self._on("device"), self._on("host")
        assert sorted(self.tables.request_ids()) == device
        assert self.tier.request_ids() == host
        # Exact conservation on both tiers.
        held = {int(b) for r in device for b in self.tables.blocks(r)}
        assert self.pool.num_used == len(held)
        assert self.tier.pool.num_used == sum(blocks_for(self.requests[r].num_tokens) for r in host)
        for r, req in self.requests.items():
            assert self.tier.location(r) == req.tier

    @invariant()
    def content_preserved(self) -> None:
        if not hasattr(self, "tier"):
            return
        for r, req in self.requests.items():
            if req.tier == "device":
                pool, blocks = self.pool, self.tables.blocks(r)
                assert self.tables.num_tokens(r) == req.num_tokens
            else:
                pool, blocks = self.tier.pool, self.tier.blocks(r)
                assert self.tier.num_tokens(r) == req.num_tokens
            assert len(blocks) == blocks_for(req.num_tokens)
            pos = np.arange(req.num_tokens)
            owners = np.array(req.codes, dtype=np.int64)
            for layer in range(LAYERS):
                for part, view in enumerate((pool.k_view(layer), pool.v_view(layer))):
                    got = view.view(np.uint16)[blocks[pos // BS], pos % BS]  # [tokens, heads, dim]
                    want = code(owners, pos, layer, part)
                    bad = np.flatnonzero((got != want[:, None, None]).any(axis=(1, 2)))
                    assert bad.size == 0, (
                        f"request {r}: positions {bad} of layer {layer} part {part}"
                    )


TestHostTierMachine = HostTierMachine.TestCase
