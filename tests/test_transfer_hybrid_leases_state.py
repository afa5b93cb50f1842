"""The transfer-lease state machine of test_transfer_leases_state.py over hybrid tables: the
same faults at every step (a sender dying after k pieces, a silent sender past the deadline, a
malformed offer, a receiver gone, aborts, passed deadlines) on requests of every group kind,
some with windows that slid before the transfer. After every step, on both pools, free +
evictable + used + in_flight == total with every live lease covering exactly its request's
pages of every group, the tables' own invariants hold, and the pool's used pages are exactly
the pages the tables' requests hold (no group's page leaked or lost)."""

from __future__ import annotations

import kvpool
from hybrid_pages import fill_groups, group_bytes, mixed_spec
from hypothesis import settings
from hypothesis.stateful import invariant
from kvpool.transfer.kinds import HybridRequests
from kvpool.transfer.leases import LeaseBook
from kvpool.transfer.protocol import PROTOCOL_VERSION
from test_transfer_leases_state import TransferLeases


class HybridTransferLeases(TransferLeases):
    def __init__(self) -> None:
        super().__init__()
        spec = mixed_spec()
        self.src_pool = kvpool.Pool.for_spec(spec, 120, device="host")
        self.dst_pool = kvpool.Pool.for_spec(spec, 60, device="host")
        self.src = kvpool.HybridTables(self.src_pool, spec)
        self.dst = kvpool.HybridTables(self.dst_pool, spec)
        self.src_leases, self.dst_leases = LeaseBook(self.src), LeaseBook(self.dst)

    def _payload(self, rid):
        return group_bytes(self.src, rid)

    def _received(self, rid):
        return group_bytes(self.dst, rid)

    def _make(self, rid, num_tokens, grow):
        self.src.add(rid, num_tokens)
        try:
            if grow:
                self.src.append_tokens(rid, grow * 3)  # the window and chunk groups slide
        except kvpool.KvError:
            self.src.free(rid)
            raise
        fill_groups(self.src, rid, seed=rid)

    def _offer(self, rid, malformed):
        fields, ids = HybridRequests(self.src).describe(rid)
        if malformed:
            group = next(g for g in fields["groups"] if g["page_ids"])
            group["page_ids"][0] = 2**31
        offer = {
            "kind": "offer",
            "version": PROTOCOL_VERSION,
            "request_id": rid,
            **fields,
            "mode": "staged",
            "chunk_blocks": 2,
        }
        return offer, len(ids)

    def _held(self, tables):
        return {rid for rid in range(self.next_rid) if rid in tables}

    @invariant()
    def used_pages_are_the_requests_pages(self):
        for pool, tables in ((self.src_pool, self.src), (self.dst_pool, self.dst)):
            held = sum(tables.num_pages(rid) for rid in self._held(tables))
            assert pool.num_used == held, (pool.num_used, held)


HybridTransferLeases.TestCase.settings = settings(max_examples=30, stateful_step_count=25)
TestHybridTransferLeases = HybridTransferLeases.TestCase
