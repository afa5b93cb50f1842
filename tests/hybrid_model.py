"""A plain-Python model of kvpool.HybridTables, for tests/test_hybrid_state.py.

It knows, per request, its token count, the first position whose query has not run yet, and
per group its table (first page index, page ids); per page, its reference count. Which pages a
table keeps comes from the visibility rules of hybrid.md ("Which pages a request keeps"),
written here from the query side (`visible`) and not from the core's formulas:

    full, MLA            the query at p sees keys 0 ..= p
    sliding window w     the query at p sees keys p - w + 1 ..= p
    chunked local c      the query at p sees keys p // c * c ..= p

A token group's table holds exactly the pages with a key that some query from `next_query` on
sees, among the request's tokens; a state group holds its slot. The pool picks page ids, so
the model learns new ids from the tables, after checking they were free and that kept pages
stayed where they were. `window_error` widens every window by that many tokens: a model that
must disagree with the tables (the mutation test).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from kvpool import HybridHostTier, HybridTables, KvGroup, ModelKvSpec


@dataclass(frozen=True)
class GroupRule:
    """What the model needs of one group: its kind, window or chunk, and page geometry."""

    kind: str
    block_size: int | None  # tokens per page; None for a state group
    pages_per_slot: int | None  # state groups only
    window: int | None = None
    chunk: int | None = None

    @staticmethod
    def of(spec: ModelKvSpec, index: int, group: KvGroup, window_error: int = 0) -> GroupRule:
        window = None if group.window is None else group.window + window_error
        return GroupRule(
            group.kind, spec.block_size(index), spec.pages_per_slot(index), window, group.chunk
        )

    def sees(self, query: int, key: int) -> bool:
        """Whether the query at position `query` attends to the key at `key`."""
        if key > query:
            return False
        if self.kind == "sliding_window":
            assert self.window is not None
            return key >= query - self.window + 1
        if self.kind == "chunked_local":
            assert self.chunk is not None
            return key // self.chunk == query // self.chunk
        return True  # full, MLA

    def visible(self, key: int, next_query: int) -> bool:
        """Whether some query at `next_query` or later sees `key`. The latest query that can
        still see a key is at most `key + window - 1` (window) or the end of its chunk, so
        the queries up to there decide."""
        first = max(key, next_query)
        horizon = {"sliding_window": self.window, "chunked_local": self.chunk}.get(self.kind)
        if horizon is None:
            return True
        return any(self.sees(q, key) for q in range(first, first + horizon))

    def live_pages(self, num_tokens: int, next_query: int) -> tuple[int, int]:
        """(start, stop) page indices a request keeps. Pages below the first visible key go;
        an empty live range sits at `num_tokens // block_size`, where the next token goes."""
        if self.block_size is None:
            assert self.pages_per_slot is not None
            return (0, self.pages_per_slot)
        bs = self.block_size
        live = [k // bs for k in range(num_tokens) if self.visible(k, next_query)]
        if not live:
            return (num_tokens // bs, num_tokens // bs)
        # Visibility is monotone in the key for every kind: the visible keys are a suffix.
        return (live[0], -(-num_tokens // bs))


@dataclass
class GroupPages:
    first_page: int = 0
    page_ids: list[int] = field(default_factory=list)


@dataclass
class Request:
    num_tokens: int
    next_query: int
    groups: list[GroupPages]


@dataclass
class Plan:
    """One group's expected change: which old pages stay (indices into the old ids), how
    many new pages follow them, and which kept indices (in the new table) are copied."""

    first_page: int
    kept: range
    num_new: int
    copies: list[int]


class HybridModel:
    def __init__(self, spec: ModelKvSpec, num_blocks: int, window_error: int = 0) -> None:
        self.rules = [GroupRule.of(spec, i, g, window_error) for i, g in enumerate(spec.groups)]
        self.num_blocks = num_blocks
        self.requests: dict[int, Request] = {}
        self.ref_cnt: Counter[int] = Counter()
        # Requests on the host tier, as they were on the device (their device page ids are
        # stale; the host ids are the tier's to pick).
        self.swapped: dict[int, Request] = {}

    # --- what the model predicts ------------------------------------------------------

    @property
    def num_used(self) -> int:
        return sum(1 for c in self.ref_cnt.values() if c > 0)

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.num_used

    def plans(self, request: Request, num_tokens: int, next_query: int) -> list[Plan]:
        appending = num_tokens > request.num_tokens
        plans = []
        for rule, pages in zip(self.rules, request.groups, strict=True):
            start, stop = rule.live_pages(num_tokens, next_query)
            old = range(pages.first_page, pages.first_page + len(pages.page_ids))
            lo, hi = max(start, old.start), min(stop, old.stop)
            kept = range(lo - old.start, hi - old.start) if lo < hi else range(0)
            plan = Plan(start, kept, (stop - start) - len(kept), [])
            if appending and pages.page_ids:
                if rule.block_size is None:
                    if self.ref_cnt[pages.page_ids[0]] > 1:
                        plan.copies = list(range(len(pages.page_ids)))
                elif request.num_tokens % rule.block_size:
                    written = request.num_tokens // rule.block_size - old.start
                    if written in kept and self.ref_cnt[pages.page_ids[written]] > 1:
                        plan.copies = [written - kept.start]
            plans.append(plan)
        return plans

    def fresh_pages(self, plans: list[Plan]) -> int:
        return sum(p.num_new + len(p.copies) for p in plans)

    def add_fits(self, num_tokens: int) -> bool:
        empty = Request(0, 0, [GroupPages() for _ in self.rules])
        return self.fresh_pages(self.plans(empty, num_tokens, 0)) <= self.num_free

    def append_fits(self, request_ids: list[int], counts: list[int]) -> bool:
        """Whether a batch is met: the fresh pages its appends take one after another in
        call order (each planned on the reference counts the earlier ones leave: of a
        forked pair only the first copies) fit the pages free before the call. What
        HybridTables.append_tokens_many promises: the pages an earlier append releases are
        not handed to a later one within the call."""
        free = self.num_free
        saved = self.ref_cnt.copy()
        needed = 0
        try:
            for rid, count in zip(request_ids, counts, strict=True):
                r = self.requests[rid]
                plans = self.plans(r, r.num_tokens + count, r.num_tokens)
                needed += self.fresh_pages(plans)
                for plan, pages in zip(plans, r.groups, strict=True):
                    kept = {pages.page_ids[i] for i in plan.kept}
                    copied = {pages.page_ids[plan.kept.start + i] for i in plan.copies}
                    for page in pages.page_ids:
                        if page not in kept or page in copied:
                            self.ref_cnt[page] -= 1
        finally:
            self.ref_cnt = saved
        return needed <= free

    # --- following the tables ---------------------------------------------------------

    def _adopt(
        self,
        tables: HybridTables,
        rid: int,
        request: Request,
        plans: list[Plan],
        num_tokens: int,
        copies: np.ndarray | None,
    ) -> tuple[Request, list[int]]:
        """Checks `rid`'s tables against `plans` (kept pages in place, fresh pages free
        before the call, the copies listed as planned) and returns the request as it is
        now with its fresh pages (copy destinations first). Reference counts are not touched
        here."""
        fresh: list[int] = []
        expected_copies: list[tuple[int, int, int]] = []
        groups = []
        for g, (plan, pages) in enumerate(zip(plans, request.groups, strict=True)):
            first, ids, n = tables.table(rid, g)
            ids = ids.tolist()
            assert n == num_tokens, (rid, g, n, num_tokens)
            assert first == plan.first_page, (rid, g, "first page", first, plan.first_page)
            kept = [pages.page_ids[i] for i in plan.kept]
            assert len(ids) == len(kept) + plan.num_new, (rid, g, ids, kept, plan)
            for index, (now, before) in enumerate(zip(ids, kept)):
                if index in plan.copies:
                    assert now != before, (rid, g, "copy kept the shared page", now)
                    expected_copies.append((g, before, now))
                    fresh.append(now)
                else:
                    assert now == before, (rid, g, "kept page moved", index, now, before)
            fresh.extend(ids[len(kept) :])
            groups.append(GroupPages(first, ids))
        assert len(set(fresh)) == len(fresh), ("a fresh page handed out twice", fresh)
        for page in fresh:
            assert self.ref_cnt[page] == 0, ("fresh page was in use", page, self.ref_cnt[page])
            assert 0 <= page < self.num_blocks
        if copies is not None:
            got = [tuple(int(x) for x in row) for row in copies]
            assert got == expected_copies, (rid, got, expected_copies)
        return Request(num_tokens, request.next_query, groups), fresh

    def add(self, tables: HybridTables, rid: int, num_tokens: int) -> list[int]:
        """Follows an add; returns the request's (fresh) pages."""
        empty = Request(0, 0, [GroupPages() for _ in self.rules])
        plans = self.plans(empty, num_tokens, 0)
        request, fresh = self._adopt(tables, rid, empty, plans, num_tokens, None)
        request.next_query = 0
        for pages in request.groups:
            self.ref_cnt.update(pages.page_ids)
        self.requests[rid] = request
        return fresh

    def append(self, tables: HybridTables, rid: int, count: int, copies: np.ndarray) -> list[int]:
        """Follows one request's append; `copies` are the rows the call returned for it.
        Returns the new pages that are not copy destinations."""
        old = self.requests[rid]
        num_tokens = old.num_tokens + count
        plans = self.plans(old, num_tokens, old.num_tokens)
        new, fresh = self._adopt(tables, rid, old, plans, num_tokens, copies)
        new.next_query = old.num_tokens
        for plan, before, after in zip(plans, old.groups, new.groups, strict=True):
            kept = {before.page_ids[i] for i in plan.kept}
            copied = {before.page_ids[plan.kept.start + i] for i in plan.copies}
            for page in before.page_ids:
                if page not in kept or page in copied:
                    self.ref_cnt[page] -= 1
            for page in after.page_ids:
                if page not in kept:  # a new page or a copy's destination
                    self.ref_cnt[page] += 1
        self.requests[rid] = new
        destinations = {int(row[2]) for row in copies}
        return [p for p in fresh if p not in destinations]

    def expected_copy_count(self, rid: int, count: int) -> int:
        r = self.requests[rid]
        return sum(len(p.copies) for p in self.plans(r, r.num_tokens + count, r.num_tokens))

    def fork(self, parent: int, child: int) -> None:
        p = self.requests[parent]
        self.requests[child] = Request(
            p.num_tokens,
            p.next_query,
            [GroupPages(g.first_page, list(g.page_ids)) for g in p.groups],
        )
        for g in p.groups:
            self.ref_cnt.update(g.page_ids)

    def free(self, rid: int) -> None:
        for g in self.requests.pop(rid).groups:
            self.ref_cnt.subtract(g.page_ids)

    # --- host tier --------------------------------------------------------------------

    @staticmethod
    def num_pages(request: Request) -> int:
        return sum(len(g.page_ids) for g in request.groups)

    def host_pages_used(self) -> int:
        return sum(self.num_pages(r) for r in self.swapped.values())

    def swap_out(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            request = self.requests.pop(rid)
            for g in request.groups:
                self.ref_cnt.subtract(g.page_ids)
            self.swapped[rid] = request

    def swap_in(self, tables: HybridTables, request_ids: list[int]) -> None:
        """Follows a swap-in: each group's table is back at its page indices with fresh
        pages (free before the call, none handed out twice)."""
        fresh: list[int] = []
        for rid in request_ids:
            old = self.swapped.pop(rid)
            groups = []
            for g, pages in enumerate(old.groups):
                first, ids, n = tables.table(rid, g)
                assert (first, len(ids), n) == (
                    pages.first_page,
                    len(pages.page_ids),
                    old.num_tokens,
                ), (rid, g)
                fresh.extend(ids.tolist())
                groups.append(GroupPages(first, ids.tolist()))
            self.requests[rid] = Request(old.num_tokens, old.next_query, groups)
        assert len(set(fresh)) == len(fresh)
        assert all(self.ref_cnt[p] == 0 for p in fresh), "swap-in took a page in use"
        self.ref_cnt.update(fresh)

    def free_swapped(self, rid: int) -> None:
        del self.swapped[rid]

    def check_host_tier(self, tier: HybridHostTier) -> None:
        """The tier holds exactly the swapped requests, each group's pages at the page
        indices the request had, on distinct host pages."""
        assert tier.request_ids() == sorted(self.swapped)
        host_ids: list[int] = []
        for rid, r in self.swapped.items():
            n, next_query, rows = tier.swapped(rid)
            assert (n, next_query) == (r.num_tokens, r.next_query)
            expected = [
                (g, pages.first_page + i)
                for g, pages in enumerate(r.groups)
                for i in range(len(pages.page_ids))
            ]
            assert [(int(g), int(i)) for g, i, _ in rows] == expected, rid
            host_ids.extend(int(p) for _, _, p in rows)
        assert len(set(host_ids)) == len(host_ids), "a host page held twice"
        assert tier.pool.num_used == len(host_ids) == self.host_pages_used()

    # --- checks -----------------------------------------------------------------------

    def check_tables_equal(self, tables: HybridTables) -> None:
        assert len(tables) == len(self.requests)
        for rid, r in self.requests.items():
            assert rid in tables
            assert tables.num_tokens(rid) == r.num_tokens
            for g, pages in enumerate(r.groups):
                first, ids, n = tables.table(rid, g)
                assert (first, ids.tolist(), n) == (pages.first_page, pages.page_ids, r.num_tokens)

    def check_conservation(self, tables: HybridTables) -> None:
        pool = tables.pool
        assert pool.num_free + pool.num_evictable + pool.num_used == pool.num_blocks
        held_by_group: list[set[int]] = [set() for _ in self.rules]
        for r in self.requests.values():
            for g, pages in enumerate(r.groups):
                held_by_group[g].update(pages.page_ids)
        for a in range(len(held_by_group)):
            for b in range(a + 1, len(held_by_group)):
                assert not held_by_group[a] & held_by_group[b], ("page in two groups", a, b)
        assert sum(len(s) for s in held_by_group) == pool.num_used == self.num_used
        for page, count in self.ref_cnt.items():
            assert pool.ref_cnt(page) == count, (page, pool.ref_cnt(page), count)

    def check_visibility(self) -> None:
        """Every page a token group holds has a key some future query sees, and every such
        key's page is held: checked key by key, not through `live_pages`."""
        for rid, r in self.requests.items():
            for rule, pages in zip(self.rules, r.groups, strict=True):
                if rule.block_size is None:
                    assert len(pages.page_ids) == rule.pages_per_slot
                    continue
                bs = rule.block_size
                held = range(pages.first_page, pages.first_page + len(pages.page_ids))
                needed = {k // bs for k in range(r.num_tokens) if rule.visible(k, r.next_query)}
                assert needed == set(held), (rid, rule.kind, sorted(needed), held)
