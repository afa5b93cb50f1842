"""The API fuzzer of tests/test_api_fuzz.py over the hybrid classes: every method of KvGroup,
ModelKvSpec, HybridTables and HybridHostTier with good and hostile arguments (its strategies
and its `check_call`: no crash, TypeError only for a wrong type, otherwise a KvError
subclass, and nothing changed by a failed call). HybridTables' methods run over a pool with
prefix caching too (cached pages and a checkpoint in it, the cache's counts in the
snapshot). A test checks that every public method is fuzzed here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import test_api_fuzz as fuzz
from hypothesis import given
from hypothesis import strategies as st
from kvpool import HybridHostTier, HybridTables, KvGroup, KvLayout, ModelKvSpec, Pool

Arg = fuzz.Arg
NUM_PAGES = 64


def spec() -> ModelKvSpec:
    """Every kind of group over 1024-byte pages."""
    return ModelKvSpec(
        [
            KvGroup.sliding_window([0], 5, 1, 16),
            KvGroup.full([1], 1, 16),
            KvGroup.chunked_local([2], 12, 1, 16),
            KvGroup.mla_latent([3], 32, 8),
            KvGroup.recurrent_state([4], 1500),
        ],
        page_bytes=1024,
    )


@dataclass
class World:
    spec: ModelKvSpec
    pool: Pool
    tables: HybridTables
    tier: HybridHostTier

    def snapshot(self) -> tuple[Any, ...]:
        pools = [
            (p.num_blocks, p.num_free, p.num_used, p.num_evictable)
            for p in (self.pool, self.tier.pool)
        ]
        refs = [self.pool.ref_cnt(b) for b in range(self.pool.num_blocks)]
        tables = []
        for r in sorted(range(16)):
            if r in self.tables:
                for g in range(self.spec.num_groups):
                    first, ids, n = self.tables.table(r, g)
                    tables.append((r, g, first, ids.tolist(), n))
        swapped = [(r, *self.tier.swapped(r)[:2]) for r in self.tier.request_ids()]
        swapped_pages = [self.tier.swapped(r)[2].tolist() for r in self.tier.request_ids()]
        cached = self.tables.cache_stats()
        cached_groups = [self.tables.cached_page_group(b) for b in range(self.pool.num_blocks)]
        next_queries = [self.tables.next_query(r) for r in range(16) if r in self.tables]
        return pools, refs, tables, swapped, swapped_pages, cached, cached_groups, next_queries

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self.tables.check_invariants()
        self.tier.check_invariants()


def make_world(caching: bool = False) -> World:
    """Requests added, forked, grown and swapped out; with `caching`, over a caching pool
    where request 4's prompt is cached and checkpointed at 32 tokens (so a prompt sharing it
    hits) and request 5 was added from it."""
    s = spec()
    pool = Pool.for_spec(s, NUM_PAGES, device="host", enable_prefix_caching=caching)
    tables = HybridTables(pool, s)
    tables.add(1, 20)
    tables.add(2, 9)
    tables.fork(2, 3)
    tables.append_tokens(1, 3)
    tables.add(6, 4)
    if caching:
        tables.add_request(4, list(range(32)))
        tables.checkpoint(4)
        tables.add_request(5, list(range(40)))
    tier = HybridHostTier(tables, 16)
    tier.swap_out([6])
    return World(s, pool, tables, tier)


def group_arg() -> st.SearchStrategy[Arg]:
    return fuzz.int_arg(6)


def request_arg() -> st.SearchStrategy[Arg]:
    return fuzz.int_arg(8)


def tokens_arg() -> st.SearchStrategy[Arg]:
    return fuzz.int_arg(40)


def lora_arg() -> st.SearchStrategy[Arg]:
    return fuzz.none_ok(fuzz.int_arg(4))


Call = tuple[Callable[..., st.SearchStrategy[Arg]], ...]

TABLES_CALLS: dict[str, tuple[Call, Callable[..., object]]] = {
    "add": ((request_arg, tokens_arg), lambda w, r, n: w.tables.add(r, n)),
    "add next_query": (
        (request_arg, tokens_arg, lambda: fuzz.none_ok(tokens_arg())),
        lambda w, r, n, q: w.tables.add(r, n, next_query=q),
    ),
    "request_pages": ((request_arg,), lambda w, r: w.tables.request_pages(r)),
    "append_tokens": ((request_arg, tokens_arg), lambda w, r, n: w.tables.append_tokens(r, n)),
    "append_tokens_many": (
        (lambda: fuzz.int_sequence(8), fuzz.int_or_sequence),
        lambda w, rs, ns: w.tables.append_tokens_many(rs, ns),
    ),
    "add_request": (
        (request_arg, lambda: fuzz.int_sequence(48), fuzz.salt, lora_arg, fuzz.extra),
        lambda w, r, t, s, lora, e: w.tables.add_request(
            r, t, cache_salt=s, lora_id=lora, extra_keys=e
        ),
    ),
    "append_tokens ids": (
        (request_arg, lambda: fuzz.int_arg(8), lambda: fuzz.none_ok(fuzz.int_sequence(48))),
        lambda w, r, n, t: w.tables.append_tokens(r, n, t),
    ),
    "append_tokens_many ids": (
        (
            lambda: fuzz.int_sequence(8),
            fuzz.int_or_sequence,
            lambda: fuzz.none_ok(fuzz.int_sequence(48)),
        ),
        lambda w, rs, ns, t: w.tables.append_tokens_many(rs, ns, t),
    ),
    "cache_computed": ((request_arg,), lambda w, r: w.tables.cache_computed(r)),
    "checkpoint": ((request_arg,), lambda w, r: w.tables.checkpoint(r)),
    "cached_page_group": (
        (lambda: fuzz.int_arg(NUM_PAGES + 4),),
        lambda w, p: w.tables.cached_page_group(p),
    ),
    "next_query": ((request_arg,), lambda w, r: w.tables.next_query(r)),
    "fork": ((request_arg, request_arg), lambda w, p, c: w.tables.fork(p, c)),
    "free": ((request_arg,), lambda w, r: w.tables.free(r)),
    "num_tokens": ((request_arg,), lambda w, r: w.tables.num_tokens(r)),
    "num_pages": ((request_arg,), lambda w, r: w.tables.num_pages(r)),
    "table": ((request_arg, group_arg), lambda w, r, g: w.tables.table(r, g)),
    "slot_mapping": (
        (request_arg, group_arg, lambda: fuzz.int_sequence(40)),
        lambda w, r, g, ps: w.tables.slot_mapping(r, g, ps),
    ),
    "state_slot": ((request_arg, group_arg), lambda w, r, g: w.tables.state_slot(r, g)),
}

TIER_CALLS: dict[str, tuple[Call, Callable[..., object]]] = {
    "swap_out": ((lambda: fuzz.int_sequence(8),), lambda w, rs: w.tier.swap_out(rs)),
    "swap_in": ((lambda: fuzz.int_sequence(8),), lambda w, rs: w.tier.swap_in(rs)),
    "free": ((request_arg,), lambda w, r: w.tier.free(r)),
    "location": ((request_arg,), lambda w, r: w.tier.location(r)),
    "swapped": ((request_arg,), lambda w, r: w.tier.swapped(r)),
}

SPEC_CALLS: dict[str, tuple[Call, Callable[..., object]]] = {
    "block_size": ((group_arg,), lambda w, g: w.spec.block_size(g)),
    "pages_per_slot": ((group_arg,), lambda w, g: w.spec.pages_per_slot(g)),
    "state_packing": ((group_arg,), lambda w, g: w.spec.state_packing(g)),
    "used_bytes": ((group_arg,), lambda w, g: w.spec.used_bytes(g)),
    "group_of_layer": ((group_arg,), lambda w, layer: w.spec.group_of_layer(layer)),
    "live_pages": (
        (group_arg, tokens_arg, tokens_arg),
        lambda w, g, n, q: w.spec.live_pages(g, n, q),
    ),
    "pages_to_add": ((tokens_arg,), lambda w, n: w.spec.pages_to_add(n)),
    "attention_offset_bytes": (
        (group_arg, fuzz.int_arg, group_arg, group_arg, group_arg, group_arg),
        lambda w, g, p, layer, t, h, d: w.spec.attention_offset_bytes(g, p, layer, "k", t, h, d),
    ),
    "latent_offset_bytes": (
        (group_arg, fuzz.int_arg, group_arg, group_arg, fuzz.int_arg),
        lambda w, g, p, layer, t, d: w.spec.latent_offset_bytes(g, p, layer, t, d),
    ),
    "state_location": (
        (group_arg, group_arg, fuzz.int_arg),
        lambda w, g, layer, b: w.spec.state_location(g, layer, b),
    ),
}

GROUP_CALLS: dict[str, tuple[Call, Callable[..., object]]] = {
    "full": (
        (fuzz.int_sequence, fuzz.size_arg, fuzz.size_arg),
        lambda w, ls, h, d: KvGroup.full(ls, h, d),
    ),
    "sliding_window": (
        (fuzz.int_sequence, fuzz.size_arg, fuzz.size_arg, fuzz.size_arg),
        lambda w, ls, win, h, d: KvGroup.sliding_window(ls, win, h, d),
    ),
    "chunked_local": (
        (fuzz.int_sequence, fuzz.size_arg, fuzz.size_arg, fuzz.size_arg),
        lambda w, ls, c, h, d: KvGroup.chunked_local(ls, c, h, d),
    ),
    "mla_latent": (
        (fuzz.int_sequence, fuzz.size_arg, fuzz.size_arg),
        lambda w, ls, lat, rope: KvGroup.mla_latent(ls, lat, rope),
    ),
    "recurrent_state": (
        (fuzz.int_sequence, fuzz.size_arg),
        lambda w, ls, b: KvGroup.recurrent_state(ls, b),
    ),
}

ALL_CALLS = {
    **{f"HybridTables.{k}": v for k, v in TABLES_CALLS.items()},
    **{f"HybridHostTier.{k}": v for k, v in TIER_CALLS.items()},
    **{f"ModelKvSpec.{k}": v for k, v in SPEC_CALLS.items()},
    **{f"KvGroup.{k}": v for k, v in GROUP_CALLS.items()},
}


@pytest.mark.parametrize("name", sorted(ALL_CALLS))
@given(data=st.data())
def test_hybrid_methods(name: str, data: st.DataObject) -> None:
    strategies, fn = ALL_CALLS[name]
    fuzz.check_call(make_world(), name, fn, fuzz.draw_args(data, strategies))


@pytest.mark.parametrize("name", sorted(TABLES_CALLS))
@given(data=st.data())
def test_hybrid_tables_methods_with_prefix_caching(name: str, data: st.DataObject) -> None:
    strategies, fn = TABLES_CALLS[name]
    fuzz.check_call(make_world(caching=True), name, fn, fuzz.draw_args(data, strategies))


@given(
    groups=st.lists(st.integers(0, 4), max_size=4),
    page_bytes=fuzz.optional(fuzz.size_arg((256, 1024, 4096))),
    num_layers=fuzz.optional(fuzz.size_arg((4, 5))),
    wrong=st.booleans(),
)
def test_spec_constructor(groups, page_bytes, num_layers, wrong) -> None:
    """Groups drawn from the world's, so layers are covered, missed or repeated."""
    chosen: list[Any] = [spec().groups[g] for g in groups]
    if wrong:
        chosen.append("full")
    args = [Arg(chosen, wrong), page_bytes, num_layers]
    fuzz.check_call(
        make_world(),
        "ModelKvSpec",
        lambda w, gs, pb, nl: ModelKvSpec(gs, pb, num_layers=nl),
        args,
    )


@given(data=st.data())
def test_tables_and_tier_constructors(data: st.DataObject) -> None:
    world = make_world()
    pages = data.draw(fuzz.none_ok(fuzz.size_arg((4, 16))))
    other = Pool(KvLayout(1, 1, 64, 1), 8, device="host")  # 256-byte blocks, not the pages
    fuzz.check_call(world, "HybridTables", lambda w: HybridTables(w.pool, w.spec), [])
    fuzz.check_call(world, "HybridTables other", lambda w: HybridTables(other, w.spec), [])
    fuzz.check_call(world, "HybridHostTier", lambda w, n: HybridHostTier(w.tables, n), [pages])
    fuzz.check_call(
        world,
        "HybridHostTier memory_bytes",
        lambda w, n: HybridHostTier(w.tables, memory_bytes=n),
        [pages],
    )


def test_the_fuzzer_covers_every_public_method() -> None:
    fuzzed = {
        HybridTables: {name.split()[0] for name in TABLES_CALLS},
        HybridHostTier: set(TIER_CALLS),
        ModelKvSpec: {*SPEC_CALLS, "uniform"},  # uniform takes only a KvLayout
        KvGroup: set(GROUP_CALLS),
    }
    no_args = {
        "check_invariants",
        "poll",
        "wait",
        "request_ids",
        "cache_stats",
        "kv_cache_snapshot",
        "shrink",
    }
    for cls, names in fuzzed.items():
        methods = {m for m in vars(cls) if not m.startswith("_") and callable(getattr(cls, m))}
        missing = methods - names - no_args
        assert not missing, f"{cls.__name__} methods not fuzzed: {sorted(missing)}"
