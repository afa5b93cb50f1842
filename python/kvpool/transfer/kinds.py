"""The requests of the two kinds of tables a transfer moves, behind one interface, so that one
protocol (protocol.py), one lease book (leases.py) and one data phase serve both:

- `UniformRequests` over ``BlockTables``: a request is its block list;
- `HybridRequests` over ``HybridTables``: a request is every group's pages (full, MLA, the
  live pages of window and chunk groups, state slots) concatenated in the spec's order, the
  order of ``HybridTables.request_pages``. Every page has the pool's page bytes, so the data
  phase moves them as it moves blocks, one copy per run of pages.

Each kind describes a request for an offer (``describe``), decodes and checks a peer's offer
(``decode``, offers.py), adds the offered request on the receiver and returns its page ids in
the offer's order (``add``), and lists a request's pages (``pages``, what a lease covers).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool._core import BlockTables, HybridTables, TransferError
from kvpool.transfer.offers import (
    Offer,
    decode_hybrid_offer,
    decode_offer,
    expected_rows,
    layout_fingerprint,
    spec_fingerprint,
)
from kvpool.transfer.regions import TpShard


class UniformRequests:
    """The requests of a ``BlockTables``."""

    def __init__(self, tables: BlockTables) -> None:
        self.tables = tables
        self.layout = tables.pool.layout
        # This pool's tensor-parallel shard (None: the whole model's heads); the receiver's
        # offers must match it (offers.py), the sender's say it.
        self.tp: TpShard | None = None

    def pages(self, request_id: Any) -> np.ndarray:
        return np.asarray(self.tables.blocks(request_id), dtype=np.int32)

    def describe(self, request_id: Any) -> tuple[dict, np.ndarray]:
        """The offer's fields for the request (beyond the protocol's own) and its block ids."""
        ids = self.pages(request_id)
        fields = {
            "num_tokens": int(self.tables.num_tokens(request_id)),
            "layout": layout_fingerprint(self.layout),
            "src_ids": ids.tolist(),
        }
        if self.tp is not None:
            fields["tp"] = self.tp.wire()
        return fields, ids

    def decode(self, message: Any, gather: bool = False) -> Offer | str:
        return decode_offer(message, self.layout, self.tp, gather)

    def add(self, offer: Offer) -> np.ndarray:
        """Adds the offered request; its block ids (the offer's order). Raises what
        ``BlockTables.add`` raises, nothing allocated."""
        self.tables.add(offer.request_id, offer.num_tokens)
        return self.pages(offer.request_id)


class HybridRequests:
    """The requests of a ``HybridTables``: every group of each."""

    def __init__(self, tables: HybridTables) -> None:
        self.tables = tables
        self.spec = tables.spec
        self.fingerprint = spec_fingerprint(self.spec)

    def pages(self, request_id: Any) -> np.ndarray:
        return np.asarray(self.tables.request_pages(request_id)[:, 2], dtype=np.int32)

    def describe(self, request_id: Any) -> tuple[dict, np.ndarray]:
        """The offer's fields for the request: the spec, the token count, ``next_query`` and
        every group's ``{first_page, page_ids}``; and its page ids, the groups' in order."""
        groups = []
        for group in range(self.spec.num_groups):
            first_page, page_ids, _ = self.tables.table(request_id, group)
            groups.append({"first_page": int(first_page), "page_ids": page_ids.tolist()})
        fields = {
            "num_tokens": int(self.tables.num_tokens(request_id)),
            "next_query": int(self.tables.next_query(request_id)),
            "spec": self.fingerprint,
            "groups": groups,
        }
        ids = np.asarray([p for g in groups for p in g["page_ids"]], dtype=np.int32)
        return fields, ids

    def decode(self, message: Any) -> Offer | str:
        return decode_hybrid_offer(message, self.spec, self.fingerprint)

    def add(self, offer: Offer) -> np.ndarray:
        """Adds the offered request at its ``next_query`` (window and chunk groups hold only
        the live pages, as on the sender); its page ids in the offer's order. Raises what
        ``HybridTables.add`` raises, nothing allocated; TransferError, the request freed
        again, if the tables hold other pages than the offer lists (the same spec, token count
        and next_query make the same table: this is never expected)."""
        self.tables.add(offer.request_id, offer.num_tokens, next_query=offer.next_query)
        rows = self.tables.request_pages(offer.request_id)
        if rows[:, :2].tolist() != expected_rows(offer.group_pages):
            self.tables.free(offer.request_id)
            raise TransferError(
                f"request {offer.request_id}: the receiver's tables hold pages "
                f"{rows[:, :2].tolist()} (group, page index), the offer lists "
                f"{expected_rows(offer.group_pages)}"
            )
        return np.asarray(rows[:, 2], dtype=np.int32)


def requests_of(tables: Any) -> UniformRequests | HybridRequests:
    """The requests of ``tables`` as the protocol moves them; TypeError for other objects."""
    if isinstance(tables, BlockTables):
        return UniformRequests(tables)
    if isinstance(tables, HybridTables):
        return HybridRequests(tables)
    raise TypeError(f"tables must be BlockTables or HybridTables, not {type(tables).__name__}")
