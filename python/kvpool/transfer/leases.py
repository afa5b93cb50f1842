"""Transfer leases: who owns a block while it is in flight.

Between a receiver's accept and the end of the data phase its blocks are neither the request's
(nothing may read them yet) nor free; on the sender they are being read and must not be freed
or overwritten. A `Lease` names those blocks, the request and a deadline; an endpoint's
`LeaseBook` holds its live leases. Every way a transfer ends ends its lease exactly once:
success (the blocks become the request's on the receiver, are freed or kept on the sender),
an abort, a vanished peer, a passed deadline or a malformed message (the receiver frees the
blocks, the sender keeps them). So at every step

    free + evictable + used + in_flight == total

where ``in_flight`` counts the blocks of live leases and ``used`` the other allocated blocks
(`LeaseBook.check_invariants`). The pool and the tables know nothing of leases: a lease is
bookkeeping of the transfer side over blocks the tables already own, so the core is unchanged.
A hybrid request's lease holds every page of every group (kinds.py: ``HybridRequests.pages``),
so a fault returns all of them at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool._core import BlockTables, HybridTables, TransferError
from kvpool.transfer.kinds import requests_of

SEND, RECV = "send", "recv"


@dataclass
class Lease:
    """The blocks of one request in flight on one side, until ``deadline`` (a time on the
    transfer's clock)."""

    request_id: int
    block_ids: tuple[int, ...]
    deadline: float
    role: str  # SEND (blocks being read here) or RECV (blocks being written here)
    live: bool = field(default=True)


class LeaseBook:
    """The live leases of one endpoint (over one ``BlockTables`` or ``HybridTables``)."""

    def __init__(self, tables: BlockTables | HybridTables) -> None:
        self.tables = tables
        self._requests = requests_of(tables)
        self._leases: dict[int, Lease] = {}

    def take(self, request_id: int, block_ids: object, deadline: float, role: str) -> Lease:
        """Leases the request's blocks; refuses (TransferError, nothing taken) a request or a block
        already in flight, which would be a second transfer of the same blocks."""
        ids = tuple(int(b) for b in block_ids)  # type: ignore[attr-defined]
        if request_id in self._leases:
            raise TransferError(f"request {request_id} is already in flight")
        held = {b for lease in self._leases.values() for b in lease.block_ids}
        if held.intersection(ids) or len(set(ids)) != len(ids):
            raise TransferError(f"a block of request {request_id} is already in flight")
        lease = Lease(request_id, ids, deadline, role)
        self._leases[request_id] = lease
        return lease

    def end(self, lease: Lease) -> bool:
        """Ends the lease; True the first time, False if it had already ended (so the caller
        returns its blocks exactly once)."""
        if not lease.live:
            return False
        lease.live = False
        del self._leases[lease.request_id]
        return True

    def live(self) -> list[Lease]:
        return list(self._leases.values())

    def expired(self, now: float) -> list[Lease]:
        return [lease for lease in self._leases.values() if now >= lease.deadline]

    @property
    def in_flight(self) -> int:
        return sum(len(lease.block_ids) for lease in self._leases.values())

    def check_invariants(self) -> None:
        """Raises AssertionError unless every live lease covers exactly its request's blocks in
        the tables, no block is in two leases, and free + evictable + used + in_flight ==
        total (with the pool's and the tables' own invariants)."""
        tables, pool = self.tables, self.tables.pool
        pool.check_invariants()
        tables.check_invariants()
        seen: set[int] = set()
        for rid, lease in self._leases.items():
            assert lease.live and lease.request_id == rid, f"dead lease {lease} still held"
            assert rid in tables, f"lease of request {rid}, which the tables no longer hold"
            held = tuple(int(b) for b in self._requests.pages(rid))
            assert held == lease.block_ids, (
                f"lease of request {rid} covers {lease.block_ids}, the tables {held}"
            )
            assert seen.isdisjoint(lease.block_ids), f"a block of request {rid} leased twice"
            seen.update(lease.block_ids)
        in_flight = len(seen)
        used = pool.num_used - in_flight
        assert used >= 0, f"{in_flight} blocks in flight but only {pool.num_used} allocated"
        total = pool.num_free + pool.num_evictable + used + in_flight
        assert total == pool.num_blocks, (
            f"free {pool.num_free} + evictable {pool.num_evictable} + used {used} + in_flight "
            f"{in_flight} = {total} != {pool.num_blocks} blocks"
        )
