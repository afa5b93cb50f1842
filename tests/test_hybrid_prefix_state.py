"""Prefix caching through the Python HybridTables, driven by a Hypothesis state machine over a
mixed layout whose page sizes do not divide the 16-token hash chunk: full attention (21
tokens a page), a sliding window of 20 (5 a page), a recurrent state (2 pages a slot), an MLA
latent (2 a page) and chunked local attention (chunks of 24, 4 a page). Requests are added
with prompts drawn from a few shared token streams (so they share prefixes), appended with
and without ids (one at a time and batched), brought to a chunk boundary and checkpointed,
declared computed, forked and freed, swapped out to a HybridHostTier (every group), swapped
back in and dropped there, over a roomy pool (nothing is ever evicted), a tight one (pages
are evicted, and calls run out of pages), and tighter ones whose prefix cache spills the
pages it evicts to a host tier (`prefix_cache_host_blocks`): one that never drops a page, so
every hit is checked exactly across evictions, and one of 40 pages that drops its least
recently used pages and cuts checkpoints.

The machine plays the kernels on the host slab. It runs every copy a call returns, then reads
back, through each table's slot mapping, every key the call's queries see: each must hold the
value the test wrote for that token, which names the token's group and its whole prefix (so a
page served from another prompt, another group or another place reads other bytes), and each
state slot page must hold the value of the state after exactly the hit (or the last step):
the checkpointed bytes. Then it writes the values of the tokens the call computes.

Against a plain model (the cached keys as (group, page index, prefix at a chunk boundary) and
the checkpoints as (group, prefix), from hybrid.md's rules, with the visibility rules of
tests/hybrid_model.py):

- a hit equals the model's longest servable prefix while nothing has been evicted (the
  roomy pool always; the tight one until its first eviction), and never exceeds it;
- every copy's source is cached for the copy's group; a page a group's table holds is never
  cached for another group;
- every table holds exactly the pages some query still to run sees;
- free + evictable + used == total, the groups' evictable pages add up to the pool's, and
  `check_invariants` holds after every step;
- an append runs out of pages exactly when its fresh pages exceed the free and evictable
  ones, and a failed call changes nothing (tables, reference counts, cached pages);
- a swapped-out request's cached pages (with `cache_computed` before the swap-out, its last
  step's too) stay in the cache and keep serving hits (the content check reads their bytes)
  while it is away; a swap-in reads back, through the new tables, every key and state the
  request's next query sees, and its later pages are cached again; a swap refused (host tier
  or device pool short, wrong tier) changes nothing; a swapped-out id is taken for `add`
  and `fork`; the tier's `check_invariants` holds after every step;
- with a host tier: the groups' host pages add up to the tier's cached blocks after every
  step, a hit counts the pages the tier holds (exact while the tier, at least the pool's
  size, has dropped nothing), the pages it brings back read back the bytes the test wrote
  (they went through the host slab), and a refused call leaves the tier's counters as they
  were;
- once every request is freed nothing is used, and a cache reset frees every page (and
  every host page).

The mutation machines play a wrong hit (the hit's copies skipped, or taken from another
cached page of the same group), a swap that brings back another page's bytes, and a host
tier whose every slot holds the next slot's bytes (a page brought back from the wrong host
slot): the content check must fail them.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pytest
from hybrid_model import GroupRule
from hypothesis import Phase, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    RuleBasedStateMachine,
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
    ModelKvSpec,
    OutOfBlocksError,
    Pool,
    UnknownRequestError,
    WrongTierError,
)

C = 16  # tokens per hashed chunk
PAGE_BYTES = 1024
ROOMY = 4096
TIGHT = 160
HOST_PAGES = 128  # the host tier: a few requests, so swap-outs are refused at times
NUM_IDS = 8
MASK = (1 << 64) - 1


class ContentMismatch(AssertionError):
    """A key or state read back other bytes than the test wrote for it."""


def mixed_spec() -> ModelKvSpec:
    return ModelKvSpec(
        [
            KvGroup.full([0], 1, 12),  # 48 bytes a token: 21 a page
            KvGroup.sliding_window([1], 20, 1, 48),  # 192 bytes: 5 a page
            KvGroup.recurrent_state([2], 1500),  # 2 pages a slot
            KvGroup.mla_latent([3], latent_dim=224, rope_dim=32),  # 512 bytes: 2 a page
            KvGroup.chunked_local([4], 24, 1, 64),  # 256 bytes: 4 a page
        ],
        page_bytes=PAGE_BYTES,
    )


def test_the_spec_has_the_geometry_the_machine_counts_on():
    spec = mixed_spec()
    assert [spec.block_size(g) for g in range(5)] == [21, 5, None, 2, 4]
    assert spec.pages_per_slot(2) == 2


def mix(a: int, b: int) -> int:
    """splitmix64's finaliser over a and b: a 64-bit value naming both."""
    z = (a ^ ((b + 0x9E3779B97F4A7C15 + (a << 6)) & MASK)) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


@dataclass
class Request:
    """A request of the model: its tokens, how they continue, and what the tables know."""

    family: int
    diverge: int  # tokens below follow the family's stream, the others the variant's
    variant: int
    known: bool  # added and appended with ids: the tables hash its tokens
    tokens: list[int] = field(default_factory=list)
    prefix: list[int] = field(default_factory=list)  # prefix[p] names tokens[: p + 1]
    next_query: int = 0
    registered: int = 0  # keys registered up to here

    def token(self, p: int) -> int:
        if p < self.diverge:
            return self.family << 16 | p
        return 0x8000_0000 | self.variant << 16 | p

    def push(self, count: int) -> list[int]:
        new = [self.token(p) for p in range(len(self.tokens), len(self.tokens) + count)]
        for t in new:
            self.prefix.append(mix(self.prefix[-1] if self.prefix else 0x5EED, t))
            self.tokens.append(t)
        return new

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def clone(self) -> Request:
        return Request(
            self.family,
            self.diverge,
            self.variant,
            self.known,
            list(self.tokens),
            list(self.prefix),
            self.next_query,
            self.registered,
        )


def ceil_chunk(n: int) -> int:
    return -(-n // C) * C


class CacheModel:
    """The cached keys and checkpoints, and which hit they serve (hybrid.md's rules)."""

    def __init__(self, rules: list[GroupRule]) -> None:
        self.rules = rules
        self.requests: dict[int, Request] = {}
        self.keys: set[tuple[int, int, int]] = set()
        self.checkpoints: set[tuple[int, int]] = set()

    def register(self, rid: int, upto: int) -> None:
        """The keys of `rid`'s pages held now for every chunk boundary up to `upto` (its
        tokens below have run): page k of a token group under boundary b when
        k * bs < b <= ceil16((k + 1) * bs)."""
        r = self.requests[rid]
        if not r.known:
            return
        upto = upto // C * C
        for b in range(r.registered + C, upto + 1, C):
            for g, group_rule in enumerate(self.rules):
                bs = group_rule.block_size
                if bs is None:
                    continue
                start, stop = group_rule.live_pages(r.num_tokens, r.next_query)
                for k in range(start, stop):
                    if k * bs < b <= ceil_chunk((k + 1) * bs):
                        self.keys.add((g, k, r.prefix[b - 1]))
        r.registered = max(r.registered, upto)

    def hit(self, prefix: list[int]) -> int:
        """The longest multiple of 16 below the prompt's length every group serves: a token
        group needs the pages holding a key the query at h sees (the one h ends inside
        under h, the others under their last boundary), a state group a checkpoint at h."""
        h = max(len(prefix) - 1, 0) // C * C
        while h > 0:
            if all(
                self.serves(g, group_rule, prefix, h) for g, group_rule in enumerate(self.rules)
            ):
                return h
            h -= C
        return 0

    def serves(self, g: int, group_rule: GroupRule, prefix: list[int], h: int) -> bool:
        bs = group_rule.block_size
        if bs is None:
            return (g, prefix[h - 1]) in self.checkpoints
        start, stop = group_rule.live_pages(h, h)
        for k in range(start, stop):
            end = (k + 1) * bs
            b = ceil_chunk(end) if end <= h else h
            if (g, k, prefix[b - 1]) not in self.keys:
                return False
        return True


def slab(pool: Pool) -> np.ndarray:
    """A host pool's slab as a flat writable uint8 array over its raw address (the test's
    stand-in for the kernels). The caller keeps `pool` alive while it uses the array."""
    size = pool.num_blocks * pool.block_bytes
    return np.frombuffer((ctypes.c_uint8 * size).from_address(pool.base_ptr), dtype=np.uint8)


def token_value(r: Request, g: int, p: int) -> int:
    return mix(r.prefix[p], g + 1)


def state_value(r: Request, g: int, t: int, page: int) -> int:
    """The state after the first `t` tokens (t > 0), as page `page` of the slot holds it."""
    return mix(r.prefix[t - 1], 1000 + 8 * g + page)


IDS = st.integers(0, NUM_IDS - 1)


def event(name: str) -> None:
    """Hypothesis' event inside a test run; nothing when a fixed run calls the rules."""
    try:
        hypothesis_event(name)
    except InvalidArgument:
        pass


class CachedHybridMachine(RuleBasedStateMachine):
    num_pages = ROOMY
    # Pages of the prefix cache's host tier, which the pages the pool evicts spill to.
    host_cache_pages: int | None = None
    # "skip hit copies", "copy from another page" (a wrong hit), "swap in another page"
    # (a swap-in reading another host page's bytes) or "rotate host cache slots" (every
    # prefix-cache host slot holding the next slot's bytes, so a page brought back from the
    # host tier reads another page's): the content check must see them.
    mutation: str | None = None
    # What the runs met, over every run of the class (the coverage tests read it).
    coverage: ClassVar[dict[str, int]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.spec = mixed_spec()
        self.pool = Pool.for_spec(
            self.spec,
            self.num_pages,
            device="host",
            enable_prefix_caching=True,
            prefix_cache_host_blocks=self.host_cache_pages,
        )
        self.tables = HybridTables(self.pool, self.spec)
        self.rules = [GroupRule.of(self.spec, i, g) for i, g in enumerate(self.spec.groups)]
        self.model = CacheModel(self.rules)
        self.bytes = slab(self.pool)
        self.tier = HybridHostTier(self.tables, HOST_PAGES)
        self.host_bytes = slab(self.tier.pool)
        address = self.pool.prefix_cache_host_base_ptr
        assert (address is None) == (self.host_cache_pages is None)
        self.host_cache_bytes = None
        if address is not None and self.host_cache_pages is not None:
            size = self.host_cache_pages * PAGE_BYTES
            self.host_cache_bytes = np.frombuffer(
                (ctypes.c_uint8 * size).from_address(address), dtype=np.uint8
            )
        # Requests the tier holds, as the model knows them.
        self.swapped: dict[int, Request] = {}

    # --- the device, played on the slab ---------------------------------------------------

    def offset(self, g: int, slot: int) -> int:
        bs = self.rules[g].block_size
        assert bs is not None
        page, token = divmod(slot, bs)
        if self.rules[g].kind == "mla_latent":
            return self.spec.latent_offset_bytes(g, page, 0, token, 0)
        return self.spec.attention_offset_bytes(g, page, 0, "k", token, 0, 0)

    def read(self, offset: int) -> int:
        return int.from_bytes(self.bytes[offset : offset + 8].tobytes(), "little")

    def write(self, offset: int, value: int) -> None:
        self.bytes[offset : offset + 8] = np.frombuffer(value.to_bytes(8, "little"), np.uint8)

    def run_copies(self, copies: np.ndarray) -> None:
        for _, src, dst in copies:
            start = PAGE_BYTES
            self.bytes[dst * start : (dst + 1) * start] = self.bytes[
                src * start : (src + 1) * start
            ]

    def check_reads(self, rid: int, r: Request, query: int, states: bool = True) -> None:
        """What the queries from `query` on read below it: every key they see holds its own
        prefix's value in its own group, every state page (unless not `states`) the state
        after `query`."""
        for g, group_rule in enumerate(self.rules):
            if group_rule.block_size is None:
                if query == 0 or not states:
                    continue
                for i, page in enumerate(self.tables.state_slot(rid, g).tolist()):
                    if self.read(page * PAGE_BYTES) != state_value(r, g, query, i):
                        raise ContentMismatch(f"request {rid} group {g} state page {i} at {query}")
                continue
            seen = [p for p in range(query) if group_rule.sees(query, p)]
            if not seen:
                continue
            for p, slot in zip(seen, self.tables.slot_mapping(rid, g, seen).tolist(), strict=True):
                if self.read(self.offset(g, slot)) != token_value(r, g, p):
                    raise ContentMismatch(f"request {rid} group {g} token {p} (from {query})")

    def write_step(self, rid: int, r: Request, start: int) -> None:
        """The step computing `r`'s tokens from `start` on: their values, the state after."""
        n = r.num_tokens
        for g, group_rule in enumerate(self.rules):
            if group_rule.block_size is None:
                if n > 0:
                    for i, page in enumerate(self.tables.state_slot(rid, g).tolist()):
                        self.write(page * PAGE_BYTES, state_value(r, g, n, i))
                continue
            positions = list(range(start, n))
            if positions:
                slots = self.tables.slot_mapping(rid, g, positions).tolist()
                for p, slot in zip(positions, slots, strict=True):
                    self.write(self.offset(g, slot), token_value(r, g, p))

    # --- helpers --------------------------------------------------------------------------

    def snapshot(self) -> object:
        pool = self.pool
        out: list[object] = [pool.num_free, pool.num_evictable, pool.num_used, len(self.tables)]
        out.append(self.tables.cache_stats())
        stats = pool.prefix_cache_stats()
        out.append(stats["num_cached_blocks"])
        host = ("host_num_cached_blocks", "host_stored_blocks", "host_evictions")
        out.append([stats[k] for k in (*host, "swapped_in_blocks")])
        out.append((self.tier.request_ids(), self.tier.pool.num_free, self.tier.num_pending))
        for rid in self.tier.request_ids():
            n, next_query, rows = self.tier.swapped(rid)
            out.append((rid, n, next_query, rows.tolist()))
        for rid in range(NUM_IDS):
            if rid in self.tables:
                out.append((rid, self.tables.num_tokens(rid), self.tables.next_query(rid)))
                for g in range(len(self.rules)):
                    first, ids, n = self.tables.table(rid, g)
                    # The reference counts of the pages held (the others are in the counts).
                    refs = [pool.ref_cnt(p) for p in ids.tolist()]
                    groups = [self.tables.cached_page_group(p) for p in ids.tolist()]
                    out.append((rid, g, first, ids.tolist(), n, refs, groups))
        return out

    def refused(self, error: type[Exception], call, *args, **kwargs) -> None:
        before = self.snapshot()
        with pytest.raises(error):
            call(*args, **kwargs)
        assert self.snapshot() == before, "a failed call changed something"

    def evicted(self) -> bool:
        return self.pool.prefix_cache_stats()["evictions"] > 0

    def hits_are_exact(self) -> bool:
        """Whether every key the model registered is still cached: nothing was evicted, or
        everything evicted went to a host tier at least as large as the pool (a smaller one
        may lack room for one eviction's pages) and stayed there."""
        if self.host_cache_pages is None or self.host_cache_pages < self.num_pages:
            return not self.evicted()
        return self.pool.prefix_cache_stats()["host_evictions"] == 0

    def host_cached(self) -> int:
        return self.pool.prefix_cache_stats()["host_num_cached_blocks"]

    def fresh_pages(self, rids: list[int], counts: list[int]) -> int:
        """The fresh pages appending `counts` to `rids` takes (new pages and copies of shared
        pages they write), from the model's rules and the pool's reference counts: one
        append after another in call order, each seeing the references the earlier ones
        dropped (of a forked pair only the first copies), as append_tokens_many plans."""
        dropped: Counter[int] = Counter()

        def shared(page: int) -> bool:
            return self.pool.ref_cnt(page) - dropped[page] > 1

        fresh = 0
        for rid, count in zip(rids, counts, strict=True):
            n = self.model.requests[rid].num_tokens
            let_go: list[int] = []
            for g, group_rule in enumerate(self.rules):
                first, ids, _ = self.tables.table(rid, g)
                ids = ids.tolist()
                start, stop = group_rule.live_pages(n + count, n)
                kept = range(max(start, first), min(stop, first + len(ids)))
                fresh += (stop - start) - len(kept)
                let_go += [p for i, p in enumerate(ids, start=first) if i not in kept]
                if count == 0 or not ids:
                    continue
                if group_rule.block_size is None:
                    if shared(ids[0]):
                        fresh += len(ids)
                        let_go += ids
                elif n % group_rule.block_size and n // group_rule.block_size in kept:
                    written = ids[n // group_rule.block_size - first]
                    if shared(written):
                        fresh += 1
                        let_go.append(written)
            dropped.update(let_go)
        return fresh

    def room(self) -> int:
        return self.pool.num_free + self.pool.num_evictable

    def has_requests(self) -> bool:
        return bool(self.model.requests)

    def taken(self, rid: int) -> bool:
        """Whether `rid` is in the tables or swapped out (not free for add or fork)."""
        return rid in self.model.requests or rid in self.swapped

    def known_requests(self) -> dict[int, Request]:
        """The requests whose tokens the tables know, swapped out ones included (their
        prompts can still be shared: their cached pages stay)."""
        every = {**self.model.requests, **self.swapped}
        return {rid: r for rid, r in every.items() if r.known}

    def existing(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.model.requests)), label="request")

    def oob_allowed(self) -> bool:
        return self.num_pages < ROOMY

    def state_if_refusable(self) -> object:
        """The snapshot to compare with if the next call may run out of pages (tight pool)."""
        return self.snapshot() if self.oob_allowed() else None

    def count(self, what: str) -> None:
        event(what)
        self.coverage[what] = self.coverage.get(what, 0) + 1

    # --- rules ----------------------------------------------------------------------------

    @rule(
        rid=IDS,
        family=st.integers(0, 1),
        diverge=st.sampled_from([24, 40, 72]),
        variant=st.integers(0, 1),
        length=st.integers(1, 72),
    )
    def add_request(self, rid: int, family: int, diverge: int, variant: int, length: int) -> None:
        r = Request(family, diverge, variant, known=True)
        tokens = r.push(length)
        if self.taken(rid):
            self.refused(DuplicateRequestError, self.tables.add_request, rid, tokens)
            return
        self.add_checked(rid, r, tokens)

    @precondition(lambda self: bool(self.known_requests()))
    @rule(data=st.data(), rid=IDS, extra=st.integers(1, 20))
    def add_sharing_a_prompt(self, data: st.DataObject, rid: int, extra: int) -> None:
        """A prompt continuing a known request's tokens by `extra` of its own stream (it
        shares all of that request's prefix: a hit wherever that request was cached, also
        while that request is swapped out)."""
        known = self.known_requests()
        self.share_checked(data.draw(st.sampled_from(sorted(known)), label="source"), rid, extra)

    def share_checked(self, source_id: int, rid: int, extra: int) -> None:
        if source_id in self.swapped:
            self.count("prompt of a swapped-out request")
        r = self.known_requests()[source_id].clone()
        r.next_query = r.registered = 0
        r.push(extra)
        tokens = list(r.tokens)
        if self.taken(rid):
            self.refused(DuplicateRequestError, self.tables.add_request, rid, tokens)
            return
        self.add_checked(rid, r, tokens)
        if source_id in self.swapped and rid in self.tables and self.tables.next_query(rid):
            self.count("hit on a swapped-out request's prompt")

    @precondition(lambda self: any(r.known for r in self.model.requests.values()))
    @rule(data=st.data(), rid=IDS, extra=st.integers(1, 20))
    def checkpoint_and_share(self, data: st.DataObject, rid: int, extra: int) -> None:
        """A known request brought to a chunk boundary and checkpointed, then a prompt
        sharing it: the way a state model is meant to hit."""
        known = sorted(i for i, r in self.model.requests.items() if r.known)
        source = data.draw(st.sampled_from(known), label="source")
        r = self.model.requests[source]
        self.append_checked([source], [C - r.num_tokens % C], True)
        if source in self.model.requests and self.model.requests[source].num_tokens % C == 0:
            self.checkpoint_checked(source)
        self.add_sharing_a_prompt(data, rid, extra)

    def add_checked(self, rid: int, r: Request, tokens: list[int]) -> None:
        expected = self.model.hit(r.prefix)
        exact = self.hits_are_exact()
        if self.mutation == "rotate host cache slots" and self.host_cache_bytes is not None:
            self.host_cache_bytes[:] = np.roll(self.host_cache_bytes, -PAGE_BYTES)
        host_before = self.host_cached() if self.host_cache_pages else 0
        before = self.state_if_refusable()
        try:
            added = self.tables.add_request(rid, np.array(tokens, dtype=np.int64))
        except OutOfBlocksError:
            assert self.oob_allowed(), "a roomy pool ran out of pages"
            assert self.snapshot() == before, "a failed add_request changed something"
            self.count("add out of pages")
            return
        h = added.num_cached_tokens
        if exact:
            assert h == expected, (rid, tokens, h, expected)
        assert h <= expected, (rid, h, expected)
        assert self.tables.next_query(rid) == h
        self.count("hit" if h else "miss")
        if exact:
            self.count("exact hit checked" if h else "exact miss checked")
        assert added.swapped_in_pages <= host_before, (added.swapped_in_pages, host_before)
        if self.host_cache_pages is not None and self.pool.prefix_cache_stats()["host_evictions"]:
            self.count("host tier dropped pages")
        if added.swapped_in_pages:
            assert h > 0 and self.host_cache_pages is not None
            self.count("hit brought back from the host tier")
            if exact and self.evicted():
                self.count("exact hit after evictions checked")
        copies = added.copies
        assert copies.dtype == np.int32 and copies.shape[1:] == (3,)
        for g, src, dst in copies.tolist():
            assert self.tables.cached_page_group(src) == g, ("copy from another group", g, src)
            held = self.tables.table(rid, g)[1].tolist()
            assert dst in held and src not in held, (g, src, dst, held)
        if len(copies):
            self.count("hit with copies")
        if h and self.mutation == "skip hit copies":
            copies = copies[:0]
        elif h and self.mutation == "copy from another page":
            copies = copies.copy()
            for row in copies:
                others = [
                    p
                    for p in range(self.pool.num_blocks)
                    if p != row[1] and self.tables.cached_page_group(p) == row[0]
                ]
                row[1] = others[0] if others else row[2]
        self.run_copies(copies)
        r.next_query = r.registered = h
        self.check_reads(rid, r, h)
        self.write_step(rid, r, h)
        self.model.requests[rid] = r

    @rule(rid=IDS, length=st.integers(1, 20))
    def add_without_ids(self, rid: int, length: int) -> None:
        if self.taken(rid):
            self.refused(DuplicateRequestError, self.tables.add, rid, length)
            return
        r = Request(9, 0, 9 + rid, known=False)
        r.push(length)
        before = self.state_if_refusable()
        try:
            self.tables.add(rid, length)
        except OutOfBlocksError:
            assert self.oob_allowed() and self.snapshot() == before
            return
        self.write_step(rid, r, 0)
        self.model.requests[rid] = r

    def append_checked(self, rids: list[int], counts: list[int], with_ids: bool) -> None:
        """Appends `counts` to `rids` (one call for all), checks the room it needed, the
        reads of every request's step, and writes the step."""
        news = [self.model.requests[rid].clone() for rid in rids]
        ids = [t for r, count in zip(news, counts, strict=True) for t in r.push(count)]
        needed = self.fresh_pages(rids, counts)
        if needed > self.room():
            self.count("append out of pages")
            args = (rids, counts, ids) if with_ids else (rids, counts)
            self.refused(OutOfBlocksError, self.tables.append_tokens_many, *args)
            return
        if len(rids) == 1:
            token_ids = ids if with_ids else None
            copies = self.tables.append_tokens(rids[0], counts[0], token_ids)
        else:
            token_ids = np.array(ids, dtype=np.uint32) if with_ids else None
            copies = self.tables.append_tokens_many(rids, counts, token_ids)
        self.run_copies(copies)
        for rid, new in zip(rids, news, strict=True):
            old_n = self.model.requests[rid].num_tokens
            # The tables cache what had run before the append changed them.
            self.model.register(rid, old_n)
            new.registered = self.model.requests[rid].registered
            new.next_query = old_n
            new.known &= with_ids
            assert self.tables.next_query(rid) == old_n
        for rid, new in zip(rids, news, strict=True):
            self.check_reads(rid, new, new.next_query)
        for rid, new in zip(rids, news, strict=True):
            self.write_step(rid, new, new.next_query)
            self.model.requests[rid] = new

    @precondition(has_requests)
    @rule(data=st.data(), count=st.one_of(st.integers(0, 2), st.integers(0, 20)), ids=st.booleans())
    def append(self, data: st.DataObject, count: int, ids: bool) -> None:
        self.append_checked([self.existing(data)], [count], ids or data.draw(st.booleans()))

    @precondition(has_requests)
    @rule(data=st.data())
    def append_many(self, data: st.DataObject) -> None:
        choice = st.sampled_from(sorted(self.model.requests))
        rids = data.draw(st.lists(choice, min_size=1, max_size=3, unique=True), label="requests")
        counts = data.draw(st.lists(st.integers(0, 17), min_size=len(rids), max_size=len(rids)))
        self.append_checked(rids, counts, data.draw(st.booleans(), label="with ids"))

    @precondition(has_requests)
    @rule(data=st.data())
    def to_boundary_and_checkpoint(self, data: st.DataObject) -> None:
        rid = self.existing(data)
        r = self.model.requests[rid]
        self.append_checked([rid], [C - r.num_tokens % C], True)
        if rid in self.model.requests and self.model.requests[rid].num_tokens % C == 0:
            self.checkpoint_checked(rid)

    def checkpoint_checked(self, rid: int) -> None:
        r = self.model.requests[rid]
        n = r.num_tokens
        if n == 0 or n % C or not r.known:
            self.refused(InvalidArgumentError, self.tables.checkpoint, rid)
            return
        slot = self.tables.state_slot(rid, 2).tolist()
        before = self.state_if_refusable()
        try:
            copies = self.tables.checkpoint(rid)
        except OutOfBlocksError:
            assert self.oob_allowed() and self.snapshot() == before
            return
        if len(copies):
            assert copies[:, 0].tolist() == [2, 2] and copies[:, 1].tolist() == slot
            assert [self.tables.cached_page_group(int(p)) for p in copies[:, 2]] == [2, 2]
        # Before any later call may hand the checkpoint's pages out again.
        self.run_copies(copies)
        self.count("checkpoint" if len(copies) else "checkpoint kept")
        self.model.register(rid, n)
        self.model.checkpoints.add((2, r.prefix[n - 1]))

    @precondition(has_requests)
    @rule(data=st.data())
    def checkpoint(self, data: st.DataObject) -> None:
        self.checkpoint_checked(self.existing(data))

    @precondition(has_requests)
    @rule(data=st.data())
    def cache_computed(self, data: st.DataObject) -> None:
        rid = self.existing(data)
        self.tables.cache_computed(rid)
        self.model.register(rid, self.model.requests[rid].num_tokens)

    @precondition(has_requests)
    @rule(data=st.data(), child=IDS)
    def fork(self, data: st.DataObject, child: int) -> None:
        parent = self.existing(data)
        if self.taken(child):
            self.refused(DuplicateRequestError, self.tables.fork, parent, child)
            return
        self.tables.fork(parent, child)
        r = self.model.requests[parent].clone()
        r.diverge = min(r.diverge, r.num_tokens)
        r.variant = 100 + child
        self.model.requests[child] = r

    @precondition(has_requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = self.existing(data)
        self.tables.free(rid)
        del self.model.requests[rid]

    @rule(rid=IDS)
    def calls_on_an_unknown_request_are_refused(self, rid: int) -> None:
        if rid in self.model.requests:
            return
        self.refused(UnknownRequestError, self.tables.checkpoint, rid)
        self.refused(UnknownRequestError, self.tables.append_tokens, rid, 1, [1])
        if rid not in self.swapped:
            self.refused(UnknownRequestError, self.tier.swap_in, [rid])
            self.refused(UnknownRequestError, self.tier.free, rid)

    # --- the host tier --------------------------------------------------------------------

    @precondition(has_requests)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        choice = st.sampled_from(sorted(self.model.requests))
        rids = data.draw(st.lists(choice, min_size=1, max_size=2, unique=True), label="swap out")
        if data.draw(st.booleans(), label="cache_computed first"):
            # The step has run: its pages are cached before they leave.
            for rid in rids:
                self.tables.cache_computed(rid)
                self.model.register(rid, self.model.requests[rid].num_tokens)
        self.swap_out_checked(rids)

    @precondition(lambda self: any(r.known for r in self.model.requests.values()))
    @rule(data=st.data(), rid=IDS, extra=st.integers(1, 20))
    def checkpoint_swap_out_and_share(self, data: st.DataObject, rid: int, extra: int) -> None:
        """A known request brought to a chunk boundary, checkpointed and swapped out, then a
        prompt sharing it: the hit is served by the pages the swapped-out request left in the
        cache (the content check reads them)."""
        known = sorted(i for i, r in self.model.requests.items() if r.known)
        source = data.draw(st.sampled_from(known), label="source")
        r = self.model.requests[source]
        self.append_checked([source], [C - r.num_tokens % C], True)
        if source in self.model.requests and self.model.requests[source].num_tokens % C == 0:
            self.checkpoint_checked(source)
        if source in self.model.requests:
            self.swap_out_checked([source])
        if source in self.swapped or source in self.model.requests:
            self.share_checked(source, rid, extra)

    def swap_out_checked(self, rids: list[int]) -> None:
        """Swaps out `rids`, every group: refused (nothing changes) when the host tier is
        short. Their cached pages stay in the cache (evictable) and serve hits meanwhile;
        chunks still to register stay with the request (cached from its new pages later)."""
        needed = sum(self.tables.num_pages(rid) for rid in rids)
        shared = any(
            self.pool.ref_cnt(int(p)) > 1 or self.tables.cached_page_group(int(p)) is not None
            for rid in rids
            for p in self.tables.request_pages(rid)[:, 2]
        )
        if needed > self.tier.pool.num_free:
            self.count("swap out refused: host tier full")
            self.refused(HostTierFullError, self.tier.swap_out, rids)
            return
        stats = self.tier.swap_out(rids)
        assert stats["num_requests"] == len(rids) and stats["num_blocks"] == needed
        self.count("swap out of shared or cached pages" if shared else "swap out")
        for rid in rids:
            r = self.model.requests[rid]
            self.swapped[rid] = self.model.requests.pop(rid)
            assert rid not in self.tables and self.tier.location(rid) == "host"
            n, next_query, _ = self.tier.swapped(rid)
            assert (n, next_query) == (r.num_tokens, r.next_query)
            if self.mutation == "swap in another page":
                self.corrupt_host_page(rid)

    def corrupt_host_page(self, rid: int) -> None:
        """The mutation: the request's first host page gets the bytes of another host page
        (a swap that copies from the wrong page)."""
        rows = self.tier.swapped(rid)[2]
        mine = {int(p) for p in rows[:, 2]}
        others = [p for p in range(self.tier.pool.num_blocks) if p not in mine]
        dst, src = int(rows[0, 2]), others[0]
        self.host_bytes[dst * PAGE_BYTES : (dst + 1) * PAGE_BYTES] = self.host_bytes[
            src * PAGE_BYTES : (src + 1) * PAGE_BYTES
        ]

    @precondition(lambda self: bool(self.swapped))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        """Swaps one or two requests back in: refused (nothing changes) when the free and
        evictable pages cannot hold them; the tables evict through themselves otherwise.
        Each reads back every key and state its next query sees."""
        choice = st.sampled_from(sorted(self.swapped))
        rids = data.draw(st.lists(choice, min_size=1, max_size=2, unique=True), label="swap in")
        needed = sum(len(self.tier.swapped(rid)[2]) for rid in rids)
        if needed > self.room():
            self.count("swap in refused: out of pages")
            self.refused(OutOfBlocksError, self.tier.swap_in, rids)
            return
        evicted = self.pool.prefix_cache_stats()["evictions"]
        stats = self.tier.swap_in(rids)
        assert stats["num_requests"] == len(rids) and stats["num_blocks"] == needed
        if self.pool.prefix_cache_stats()["evictions"] > evicted:
            self.count("swap in evicted")
        self.count("swap in")
        for rid in rids:
            r = self.swapped.pop(rid)
            self.model.requests[rid] = r
            assert self.tables.next_query(rid) == r.next_query
            # Its next query (at its tokens' end) and the queries from its first unrun one.
            self.check_reads(rid, r, r.num_tokens)
            self.check_reads(rid, r, r.next_query, states=False)

    @precondition(lambda self: bool(self.swapped))
    @rule(data=st.data())
    def free_swapped(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.swapped)), label="free swapped")
        self.tier.free(rid)
        del self.swapped[rid]
        assert self.tier.location(rid) is None
        self.count("free swapped")

    @precondition(has_requests)
    @rule(data=st.data())
    def tier_calls_on_the_wrong_tier_are_refused(self, data: st.DataObject) -> None:
        self.refused(WrongTierError, self.tier.swap_in, [self.existing(data)])
        self.refused(WrongTierError, self.tier.free, self.existing(data))
        if self.swapped:
            rid = data.draw(st.sampled_from(sorted(self.swapped)))
            self.refused(WrongTierError, self.tier.swap_out, [rid])
            self.refused(DuplicateRequestError, self.tables.add, rid, 1)
            self.refused(DuplicateRequestError, self.tables.fork, self.existing(data), rid)

    # --- invariants -----------------------------------------------------------------------

    @invariant()
    def tables_hold_exactly_the_live_pages(self) -> None:
        assert len(self.tables) == len(self.model.requests)
        for rid, r in self.model.requests.items():
            assert self.tables.num_tokens(rid) == r.num_tokens
            for g, group_rule in enumerate(self.rules):
                first, ids, _ = self.tables.table(rid, g)
                start, stop = group_rule.live_pages(r.num_tokens, r.next_query)
                assert len(ids) == stop - start, (rid, g, first, len(ids), start, stop)
                if len(ids):
                    assert first == start, (rid, g, first, start)

    @invariant()
    def no_group_holds_a_page_cached_for_another(self) -> None:
        held: dict[int, int] = {}
        for rid in self.model.requests:
            for g in range(len(self.rules)):
                for page in self.tables.table(rid, g)[1].tolist():
                    assert held.setdefault(page, g) == g, ("page in two groups", page)
                    assert self.tables.cached_page_group(page) in (None, g), (page, g)

    @invariant()
    def pages_are_conserved(self) -> None:
        pool = self.pool
        assert pool.num_free + pool.num_evictable + pool.num_used == pool.num_blocks
        stats = self.tables.cache_stats()
        assert sum(s["evictable_pages"] for s in stats) == pool.num_evictable
        cache = pool.prefix_cache_stats()
        assert sum(s["cached_pages"] for s in stats) == cache["num_cached_blocks"]
        # Over the host tier too: each host block is one group's cached page.
        host_pages = sum(s["host_pages"] for s in stats)
        assert host_pages == cache["host_num_cached_blocks"] <= cache["host_num_blocks"]
        if self.host_cache_pages is None:
            assert host_pages == 0
        self.tables.check_invariants()
        pool.check_invariants()
        assert self.tier.request_ids() == sorted(self.swapped)
        self.tier.check_invariants()

    def teardown(self) -> None:
        # Every request still there reads what its next query sees.
        for rid, r in self.model.requests.items():
            self.check_reads(rid, r, r.num_tokens)
        # Every id the tables hold: a rule that failed half way may have left one the model
        # does not know.
        for rid in range(NUM_IDS):
            if rid in self.tables:
                self.tables.free(rid)
        for rid in self.tier.request_ids():
            self.tier.free(rid)
        self.tier.check_invariants()
        assert self.tier.pool.num_used == 0, "host pages leaked"
        self.tables.check_invariants()
        pool = self.pool
        assert pool.num_used == 0, "pages leaked after every request was freed"
        assert pool.num_free + pool.num_evictable == pool.num_blocks
        if not self.oob_allowed():
            assert not self.evicted(), "the roomy pool evicted: the exact hit check was off"
        pool.reset_prefix_cache()
        assert pool.num_free == pool.num_blocks, "a cached page leaked"
        assert self.host_cached() == 0 if self.host_cache_pages else True
        assert all(s["host_pages"] == 0 for s in self.tables.cache_stats())
        self.tables.check_invariants()


class TightCachedHybridMachine(CachedHybridMachine):
    num_pages = TIGHT
    coverage: ClassVar[dict[str, int]] = {}


class SpillingHybridMachine(CachedHybridMachine):
    """A tight pool whose prefix cache spills to a host tier large enough never to drop a
    page: every evicted cached page (every group's, checkpoints included) stays servable,
    so every hit is checked exactly against the model, evictions or not, and the ones
    served from the host tier are content-checked like any."""

    num_pages = 96  # tighter still: evictions (and so spills) start early in a run
    host_cache_pages = 2048
    coverage: ClassVar[dict[str, int]] = {}


class SmallHostCacheHybridMachine(SpillingHybridMachine):
    """A host tier of 40 pages: it drops its least recently used pages (and checkpoints it
    cannot keep whole); hits are then at most the model's, and still content-checked."""

    host_cache_pages = 40
    coverage: ClassVar[dict[str, int]] = {}


def run_machine(
    machine: type[CachedHybridMachine], max_examples: int | None = None
) -> dict[str, int]:
    """Runs `machine` under the loaded profile (derandomized in CI), with at most
    `max_examples` runs if given (the profile's count otherwise); returns its coverage."""
    machine.coverage.clear()
    examples = settings().max_examples if max_examples is None else max_examples
    if max_examples is not None:
        examples = min(examples, max_examples)
    run_state_machine_as_test(
        machine, settings=settings(stateful_step_count=50, max_examples=examples)
    )
    return dict(machine.coverage)


def test_cached_calls_match_the_model_on_a_roomy_pool():
    c = run_machine(CachedHybridMachine)
    print(c)
    # Nothing is evicted (the teardown checks), so every hit and miss is checked exactly.
    assert c.get("exact hit checked", 0) >= 10 and c.get("exact miss checked", 0) >= 50, c
    assert c.get("hit with copies", 0) >= 10 and c.get("checkpoint", 0) >= 20, c
    assert c.get("swap in", 0) >= 5 and c.get("swap out of shared or cached pages", 0) >= 10, c
    assert c.get("swap out refused: host tier full", 0) >= 1, c
    assert c.get("hit on a swapped-out request's prompt", 0) >= 1, c


def test_evicted_pages_spill_to_the_host_tier_and_hits_bring_them_back():
    # Fewer runs than the others: the tight pool's rules are the same, the spill is the point.
    c = run_machine(SpillingHybridMachine, max_examples=30)
    print(c)
    assert c.get("hit brought back from the host tier", 0) >= 5, c
    assert c.get("exact hit after evictions checked", 0) >= 5, c
    assert c.get("append out of pages", 0) >= 1, c


def test_a_small_host_tier_drops_pages_and_still_serves_the_right_bytes():
    c = run_machine(SmallHostCacheHybridMachine, max_examples=30)
    print(c)
    assert c.get("hit brought back from the host tier", 0) >= 3, c
    assert c.get("host tier dropped pages", 0) >= 3, c


def test_cached_calls_match_the_model_on_a_tight_pool():
    c = run_machine(TightCachedHybridMachine)
    print(c)
    assert c.get("hit", 0) >= 5 and c.get("append out of pages", 0) >= 5, c
    assert c.get("add out of pages", 0) >= 5, c
    assert c.get("swap in evicted", 0) >= 1 and c.get("swap in refused: out of pages", 0) >= 1, c


class SkippedHitCopiesMachine(CachedHybridMachine):
    mutation = "skip hit copies"


class HitCopiedFromAnotherPageMachine(CachedHybridMachine):
    mutation = "copy from another page"


class SwapInOfAnotherPageMachine(CachedHybridMachine):
    mutation = "swap in another page"


class HostCacheSlotsRotatedMachine(SpillingHybridMachine):
    mutation = "rotate host cache slots"


@pytest.mark.parametrize(
    "machine",
    [
        SkippedHitCopiesMachine,
        HitCopiedFromAnotherPageMachine,
        SwapInOfAnotherPageMachine,
        HostCacheSlotsRotatedMachine,
    ],
)
def test_the_content_check_fails_a_wrong_hit(machine: type[CachedHybridMachine]) -> None:
    """A hit whose copies are skipped (the resumed state and the page the hit ends inside
    keep a fresh page's bytes) or read from another cached page of the same group must fail
    the content check (derandomized: always on the same draws)."""
    with pytest.raises(ContentMismatch):
        run_state_machine_as_test(
            machine,
            # Finding the failure is the point: shrinking it would only cost time.
            settings=settings(max_examples=60, print_blob=False, phases=[Phase.generate]),
        )


def test_a_resumed_state_reads_back_the_checkpointed_bytes():
    """A fixed run: checkpoint at 32, the slot overwritten by later steps, then a prompt
    sharing the 32 tokens resumes from exactly the checkpointed bytes."""
    m = CachedHybridMachine()
    m.add_request(0, family=0, diverge=72, variant=0, length=30)
    m.append_checked([0], [2], True)
    m.checkpoint_checked(0)
    m.append_checked([0], [5], True)  # the live slot now holds the state after 37 tokens
    slot = m.tables.state_slot(0, 2).tolist()
    assert m.read(slot[0] * PAGE_BYTES) == state_value(m.model.requests[0], 2, 37, 0)
    m.add_request(1, family=0, diverge=40, variant=1, length=50)
    assert m.tables.next_query(1) == 32
    r = m.model.requests[1]
    for i, page in enumerate(m.tables.state_slot(1, 2).tolist()):
        assert page not in slot
        assert m.read(page * PAGE_BYTES) == state_value(r, 2, 50, i)  # written after the check
    m.teardown()
