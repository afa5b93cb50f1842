"""A property-based fuzzer over every public constructor and method of the binding (`Pool`,
`KvLayout`, `BlockTables`, `HostTier`, the prefix-cache methods, a pool's eviction stage,
views and DLPack).

Every argument is drawn from good values and hostile ones: wrong types (floats, NaN/inf,
strs, bytes, None, bools, lists, arbitrary objects), NumPy integer scalars and `__index__`
objects (ints), 0, negatives, 2**31, 2**63, 2**64, 2**200, huge and repeated lists, ids
of another pool or tables, and id arrays of the wrong dtype, non-contiguous, read-only or
2-D. Each call must:
- not abort the process and not raise a PanicException (nor any other exception than below);
- raise `TypeError` only when some argument has a wrong type, and `TypeError` when every
  drawn argument has one; otherwise a `KvError` subclass (`BufferError` for a DLPack request
  that cannot be met, the DLPack protocol's own exception);
- leave the pool, tables, tier, prefix cache and eviction stage as they were when it fails
  (counts, ref counts, rows and their blocks, swapped requests, the stage's counters and its
  taken slots' bytes, `check_invariants()` of each).

Profiles as for the state machines (tests/conftest.py): derandomized under "ci", long random
runs under HYPOTHESIS_PROFILE=soak.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kvpool
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from kvpool import BlockStored, BlockTables, HostTier, KvError, KvLayout, Pool

LAYOUT = KvLayout(2, 1, 16, 4)  # 256-byte blocks: every pool here stays tiny
PAGE_SPEC = kvpool.ModelKvSpec([kvpool.KvGroup.full([0], 1, 16)], page_bytes=256)
NUM_BLOCKS = 64


@dataclass(frozen=True)
class Arg:
    """A drawn argument, and whether its type is wrong for the parameter."""

    value: Any
    wrong_type: bool

    def __repr__(self) -> str:
        shown = repr(self.value)
        shown = shown if len(shown) <= 80 else shown[:80] + "..."
        return f"{'WRONG TYPE ' if self.wrong_type else ''}{shown}"


class Index:
    """An int-like user type: `__index__` only."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"Index({self.value})"


EDGE_INTS = [
    0,
    1,
    2,
    3,
    -1,
    -(2**31),
    2**31 - 1,
    2**31,
    2**32,
    2**63 - 1,
    2**63,
    -(2**63),
    2**64 - 1,
    2**64,
    2**200,
    -(2**200),
]
WRONG_SCALARS: list[Any] = [
    1.5,
    2.0,
    math.nan,
    math.inf,
    -math.inf,
    "3",
    "",
    b"3",
    None,
    True,
    False,
    np.True_,
    np.False_,
    np.float64(2.0),
    1 + 2j,
    [1],
    {"a": 1},
    object(),
]


def int_like(value: int) -> st.SearchStrategy[Any]:
    """`value` as a Python int, a NumPy integer (where it fits) or an `__index__` object."""
    forms: list[Any] = [value, Index(value)]
    for dtype in (np.int64, np.int32, np.uint64, np.uint8):
        info = np.iinfo(dtype)
        if info.min <= value <= info.max:
            forms.append(dtype(value))
    return st.sampled_from(forms)


def ints(small: int = NUM_BLOCKS + 8) -> st.SearchStrategy[Arg]:
    """Right-typed ints: small ones (valid ids, counts) and every edge."""
    values = st.one_of(st.integers(0, small), st.sampled_from(EDGE_INTS))
    return values.flatmap(int_like).map(lambda v: Arg(v, False))


WRONG = st.sampled_from(WRONG_SCALARS).map(lambda v: Arg(v, True))


def int_arg(small: int = NUM_BLOCKS + 8) -> st.SearchStrategy[Arg]:
    return st.one_of(ints(small), ints(small), WRONG)


def to_array(values: list[int], dtype: Any) -> np.ndarray | None:
    try:
        return np.array(values, dtype=dtype)
    except (OverflowError, ValueError):
        return None


@st.composite
def int_sequence(draw: st.DrawFn, small: int = NUM_BLOCKS + 8) -> Arg:
    """A sequence of ints in one of many containers, or something that is not one."""
    kind = draw(
        st.sampled_from(
            [
                "list",
                "list",
                "tuple",
                "generator",
                "repeated",
                "huge",
                "array",
                "array",
                "strided",
                "readonly",
                "2d",
                "float array",
                "bool array",
                "wrong item",
                "not a sequence",
            ]
        )
    )
    items = [
        int(draw(st.one_of(st.integers(0, small), st.sampled_from(EDGE_INTS))))
        for _ in range(draw(st.integers(0, 6)))
    ]
    if kind == "list":
        return Arg([draw(int_like(i)) for i in items], False)
    if kind == "tuple":
        return Arg(tuple(items), False)
    if kind == "generator":
        return Arg(iter(items), False)
    if kind == "repeated":
        return Arg(items[:1] * 5000, False)
    if kind == "huge":
        return Arg(list(range(100_000)), False)
    if kind == "wrong item":  # first, so that no bad value among the others is met before it
        return Arg([draw(WRONG).value, *items], True)
    if kind == "not a sequence":
        value = draw(st.sampled_from([1.5, None, 3, "12", b"12", np.int64(3)]))
        return Arg(value, True)
    if kind == "float array":
        return Arg(np.array(items, dtype=np.float64), True)
    if kind == "bool array":
        return Arg(np.array([i % 2 == 0 for i in items], dtype=bool), True)
    dtype = draw(st.sampled_from([np.int32, np.int64, np.uint32, np.int16, np.uint64, ">i4"]))
    array = to_array(items, dtype)
    if array is None:  # an edge int that does not fit the dtype: the list form instead
        return Arg(items, False)
    if kind == "strided":
        array = np.repeat(array, 2)[::2]
    elif kind == "readonly":
        array.flags.writeable = False
    elif kind == "2d":
        array = array.reshape(1, -1)
    return Arg(array, False)


def none_ok(strategy: st.SearchStrategy[Arg]) -> st.SearchStrategy[Arg]:
    """`strategy` for an optional parameter, where None is a right type (not given)."""
    return strategy.map(lambda a: Arg(None, False) if a.value is None else a)


def int_or_sequence() -> st.SearchStrategy[Arg]:
    """`counts`: one int for every request or a sequence of ints."""
    return st.one_of(int_arg(8), int_sequence(8))


def flag() -> st.SearchStrategy[Arg]:
    return st.one_of(
        st.booleans().map(lambda b: Arg(b, False)),
        st.sampled_from([1, 0, "yes", None, 1.0]).map(lambda v: Arg(v, True)),
    )


def salt() -> st.SearchStrategy[Arg]:
    good = st.sampled_from([None, "tenant", b"tenant", "\u00e9"]).map(lambda v: Arg(v, False))
    bad = st.sampled_from([1, 1.5, ["a"], bytearray(b"x"), True]).map(lambda v: Arg(v, True))
    return st.one_of(good, bad)


def extra() -> st.SearchStrategy[Arg]:
    good = st.sampled_from([None, b"", b"adapter"]).map(lambda v: Arg(v, False))
    bad = st.sampled_from(["adapter", 1, [1], True]).map(lambda v: Arg(v, True))
    return st.one_of(good, bad)


# A stream: refused by a host pool whatever it is (no type check is reached).
STREAMS = st.one_of(
    st.just(Arg(None, False)),
    st.sampled_from([0, 1, -1, "s", object()]).map(lambda v: Arg(v, False)),
)


# --- the world every call runs against ------------------------------------------------------


@dataclass
class World:
    pool: Pool
    tables: BlockTables
    tier: HostTier
    growable: Pool
    foreign: BlockTables  # another pool's tables: its request ids are foreign here

    def snapshot(self) -> tuple[Any, ...]:
        pools = [
            (p.num_blocks, p.num_free, p.num_used, p.num_evictable, p.high_water)
            for p in (self.pool, self.growable, self.tier.pool)
        ]
        refs = [self.pool.ref_cnt(b) for b in range(self.pool.num_blocks)]
        refs += [self.growable.ref_cnt(b) for b in range(self.growable.num_blocks)]
        rows = [
            (r, self.tables.num_tokens(r), self.tables.blocks(r).tolist())
            for r in self.tables.request_ids()
        ]
        swapped = [
            (r, self.tier.num_tokens(r), self.tier.blocks(r).tolist())
            for r in self.tier.request_ids()
        ]
        cache = self.pool.prefix_cache_stats()
        return pools, refs, rows, swapped, cache

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self.growable.check_invariants()
        self.tables.check_invariants()
        self.tier.check_invariants()


def make_world() -> World:
    pool = Pool(LAYOUT, NUM_BLOCKS, device="host", enable_prefix_caching=True)
    tables = BlockTables(pool, 8, 8)
    tables.add(1, 5)
    tables.add_request(2, list(range(9)))
    tables.add_request(3, list(range(9)))  # shares cached blocks with 2
    tables.fork(1, 4)
    tables.add(5, 2)
    tables.free(5)  # evictable blocks for the cache
    tables.add(6, 3)
    tier = HostTier(tables, 16)
    tier.swap_out([6])
    pool.alloc_many(2)  # raw blocks, held outside the tables
    growable = Pool(LAYOUT, device="host", growable=True, max_num_blocks=256, chunk_bytes=4096)
    foreign_pool = Pool(LAYOUT, 8, device="host")
    foreign = BlockTables(foreign_pool, 4, 4)
    foreign.add(77, 3)
    return World(pool, tables, tier, growable, foreign)


# --- the calls ------------------------------------------------------------------------------


def aligned_bytes(num_bytes: int) -> np.ndarray:
    """A writable uint8 array starting at a 256-byte boundary (Pool.from_external's need)."""
    raw = np.zeros(num_bytes + 256, dtype=np.uint8)
    start = (-raw.ctypes.data) % 256
    return raw[start : start + num_bytes]


Call = tuple[Callable[..., st.SearchStrategy[Arg]], ...]


def kv_event() -> st.SearchStrategy[Arg]:
    """A disk-tier event for `append_kv_event`, or something that is not an event."""
    stored = BlockStored([bytes(32)], None, list(range(16)), 16, None, "disk")
    good = st.sampled_from([stored]).map(lambda v: Arg(v, False))
    bad = st.sampled_from([1, "BlockStored", None, b"x"]).map(lambda v: Arg(v, True))
    return st.one_of(good, bad)


POOL_CALLS: dict[str, tuple[Call, Callable[..., object]]] = {
    "alloc_many": ((int_arg,), lambda w, n: w.pool.alloc_many(n)),
    "growable.alloc_many": ((lambda: int_arg(300),), lambda w, n: w.growable.alloc_many(n)),
    "free": ((int_arg,), lambda w, b: w.pool.free(b)),
    "free_many": ((int_sequence,), lambda w, ids: w.pool.free_many(ids)),
    "ref_cnt": ((int_arg,), lambda w, b: w.pool.ref_cnt(b)),
    "block_ptr": ((int_arg,), lambda w, b: w.pool.block_ptr(b)),
    "grow": ((lambda: int_arg(300),), lambda w, n: w.growable.grow(n)),
    "fixed.grow": ((int_arg,), lambda w, n: w.pool.grow(n)),
    "k_view": ((lambda: int_arg(4),), lambda w, layer: w.pool.k_view(layer)),
    "v_view": ((lambda: int_arg(4),), lambda w, layer: w.pool.v_view(layer)),
    "check_invariants": ((flag,), lambda w, exact: w.pool.check_invariants(exact)),
    "enable_kv_cache_events": (
        (flag, lambda: none_ok(int_arg(20))),
        lambda w, on, n: w.pool.enable_kv_cache_events(on, max_queued_events=n),
    ),
    "reset_prefix_cache": ((), lambda w: w.pool.reset_prefix_cache()),
    "from_external": (
        (lambda: none_ok(int_arg(8)),),
        lambda w, n: Pool.from_external(
            LAYOUT, aligned_bytes(8 * LAYOUT.block_bytes), num_blocks=n
        ),
    ),
    "block_checksums": ((int_sequence,), lambda w, ids: w.pool.block_checksums(ids)),
    "attach_eviction_stage": ((int_arg,), lambda w, n: w.pool.attach_eviction_stage(n)),
    "append_kv_event": ((kv_event,), lambda w, e: w.pool.append_kv_event(e)),
    "lookup_prefix": (
        (int_sequence, salt, lambda: none_ok(int_arg(4)), extra),
        lambda w, t, s, lora, e: w.pool.lookup_prefix(t, cache_salt=s, lora_id=lora, extra_keys=e),
    ),
}

TABLES_CALLS: dict[str, tuple[Call, Callable[..., object]]] = {
    "add": ((int_arg, lambda: int_arg(40)), lambda w, r, n: w.tables.add(r, n)),
    "add_request": (
        (int_arg, int_sequence, salt, lambda: none_ok(int_arg(4)), extra),
        lambda w, r, t, s, lora, e: w.tables.add_request(
            r, t, cache_salt=s, lora_id=lora, extra_keys=e
        ),
    ),
    "append_tokens": ((int_arg, lambda: int_arg(40)), lambda w, r, n: w.tables.append_tokens(r, n)),
    "append_tokens ids": (
        (int_arg, lambda: int_arg(8), lambda: none_ok(int_sequence())),
        lambda w, r, n, t: w.tables.append_tokens(r, n, t),
    ),
    "append_tokens_many": (
        (lambda: int_sequence(8), int_or_sequence),
        lambda w, rs, c: w.tables.append_tokens_many(rs, c),
    ),
    "append_tokens_many ids": (
        (lambda: int_sequence(8), int_or_sequence, lambda: none_ok(int_sequence())),
        lambda w, rs, c, t: w.tables.append_tokens_many(rs, c, t),
    ),
    "fork": ((int_arg, int_arg), lambda w, p, c: w.tables.fork(p, c)),
    "free": ((int_arg,), lambda w, r: w.tables.free(r)),
    "num_tokens": ((int_arg,), lambda w, r: w.tables.num_tokens(r)),
    "blocks": ((int_arg,), lambda w, r: w.tables.blocks(r)),
    "seq_lens": ((lambda: int_sequence(8),), lambda w, rs: w.tables.seq_lens(rs)),
    "block_table": ((lambda: int_sequence(8),), lambda w, rs: w.tables.block_table(rs)),
    "csr": ((lambda: int_sequence(8),), lambda w, rs: w.tables.csr(rs)),
    "sync": ((lambda: STREAMS,), lambda w, stream: w.tables.sync(stream)),
    "foreign id": ((int_arg,), lambda w, r: w.tables.seq_lens([r, *w.foreign.request_ids()])),
}

TIER_CALLS: dict[str, tuple[Call, Callable[..., object]]] = {
    "swap_out": ((lambda: int_sequence(8),), lambda w, rs: w.tier.swap_out(rs)),
    "swap_in": ((lambda: int_sequence(8),), lambda w, rs: w.tier.swap_in(rs)),
    "free": ((int_arg,), lambda w, r: w.tier.free(r)),
    "location": ((int_arg,), lambda w, r: w.tier.location(r)),
    "num_tokens": ((int_arg,), lambda w, r: w.tier.num_tokens(r)),
    "blocks": ((int_arg,), lambda w, r: w.tier.blocks(r)),
}


# --- the eviction stage, in a world of its own: a pool takes one stage, and the Pool fuzzer
# attaches one to `World.pool` -----------------------------------------------------------------

STAGE_SLOTS = 6


@dataclass
class StageWorld:
    """A prefix-caching host pool whose eviction stage holds staged blocks (3 filled) and
    blocks taken under two take ids (`taken`, 2 slots, and one slot under a later id)."""

    pool: Pool
    tables: BlockTables
    stage: kvpool._core.EvictionStage
    taken: kvpool._core.EvictedBlocks

    def snapshot(self) -> tuple[Any, ...]:
        pool = (self.pool.num_blocks, self.pool.num_free, self.pool.num_used)
        refs = [self.pool.ref_cnt(b) for b in range(self.pool.num_blocks)]
        # The taken slots' bytes: a failed call neither released nor rewrote them (checksums
        # raises, failing the test, if they were released).
        sums = self.stage.checksums(self.taken.slots).tolist()
        return pool, refs, self.pool.prefix_cache_stats(), self.stage.stats(), sums

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self.tables.check_invariants()
        self.stage.check_invariants()


def make_stage_world() -> StageWorld:
    pool = Pool(LAYOUT, 8, device="host", enable_prefix_caching=True)
    tables = BlockTables(pool, 8, 8)
    stage = pool.attach_eviction_stage(STAGE_SLOTS)
    block = LAYOUT.block_size
    tables.add_request(1, list(range(1000, 1000 + block * STAGE_SLOTS + 1)))
    tables.free(1)
    tables.add_request(2, list(range(5000, 5000 + block * 8)))  # evicts request 1's blocks
    tables.free(2)
    assert stage.stats()["num_filled"] == STAGE_SLOTS
    taken = stage.take(2)
    later = stage.take(1)
    assert len(taken) == 2 and len(later) == 1 and later.take_id != taken.take_id
    return StageWorld(pool, tables, stage, taken)


STAGE_CALLS: dict[str, tuple[Call, Callable[..., object]]] = {
    "take": ((lambda: none_ok(int_arg(8)),), lambda w, n: w.stage.take(n)),
    "release": (
        (lambda: int_arg(4), lambda: int_sequence(STAGE_SLOTS + 2)),
        lambda w, take_id, slots: w.stage.release(take_id, slots),
    ),
    "release own": (  # the right take id: only the slots vary
        (lambda: int_sequence(STAGE_SLOTS + 2),),
        lambda w, slots: w.stage.release(w.taken.take_id, slots),
    ),
    "checksums": (
        (lambda: int_sequence(STAGE_SLOTS + 2),),
        lambda w, slots: w.stage.checksums(slots),
    ),
    "stats": ((), lambda w: w.stage.stats()),
    "check_invariants": ((), lambda w: w.stage.check_invariants()),
}


def check_call(
    world: World | StageWorld,
    name: str,
    fn: Callable[..., object],
    args: list[Arg],
    allowed: tuple[type[BaseException], ...] = (),
) -> None:
    """Calls `fn` and asserts the convention (see the module docstring)."""
    note(f"{name}({', '.join(map(repr, args))})")
    before = world.snapshot()
    try:
        fn(world, *(a.value for a in args))
    except (TypeError, KvError, *allowed) as e:
        note(f"raised {type(e).__name__}: {e}")
        wrong = [a.wrong_type for a in args]
        if isinstance(e, TypeError):
            assert any(wrong), f"TypeError for right-typed arguments: {e}"
        else:
            assert not all(wrong) or not wrong, f"{type(e).__name__} for wrong types: {e}"
        world.check_invariants()
        assert world.snapshot() == before, "a failed call changed the state"
        return
    world.check_invariants()


def draw_args(data: st.DataObject, strategies: Call) -> list[Arg]:
    return [data.draw(make(), label=f"arg {i}") for i, make in enumerate(strategies)]


@pytest.mark.parametrize("name", sorted(POOL_CALLS))
@given(data=st.data())
def test_pool_methods(name: str, data: st.DataObject) -> None:
    strategies, fn = POOL_CALLS[name]
    check_call(make_world(), name, fn, draw_args(data, strategies))


@pytest.mark.parametrize("name", sorted(TABLES_CALLS))
@given(data=st.data())
def test_block_tables_methods(name: str, data: st.DataObject) -> None:
    strategies, fn = TABLES_CALLS[name]
    check_call(make_world(), name, fn, draw_args(data, strategies))


@pytest.mark.parametrize("name", sorted(TIER_CALLS))
@given(data=st.data())
def test_host_tier_methods(name: str, data: st.DataObject) -> None:
    strategies, fn = TIER_CALLS[name]
    check_call(make_world(), name, fn, draw_args(data, strategies))


@pytest.mark.parametrize("name", sorted(STAGE_CALLS))
@given(data=st.data())
def test_eviction_stage_methods(name: str, data: st.DataObject) -> None:
    strategies, fn = STAGE_CALLS[name]
    check_call(make_stage_world(), name, fn, draw_args(data, strategies))


# --- constructors: sizes are either small or beyond every limit, so nothing here allocates
# more than a few KiB (a size in between would take real memory, not exercise the checks) ----

SIZES = [0, 1, 7, 64, -1, 2**31, 2**32, 2**63, 2**64, 2**200, -(2**63)]


def size_arg(extra_small: tuple[int, ...] = ()) -> st.SearchStrategy[Arg]:
    values = st.sampled_from(SIZES + list(extra_small)).flatmap(int_like)
    return st.one_of(
        values.map(lambda v: Arg(v, False)), values.map(lambda v: Arg(v, False)), WRONG
    )


def optional(strategy: st.SearchStrategy[Arg]) -> st.SearchStrategy[Arg]:
    return none_ok(st.one_of(st.just(Arg(None, False)), strategy))


@given(
    dims=st.tuples(size_arg((16, 4)), size_arg((16, 4)), size_arg((16, 4)), size_arg((16, 4))),
    dtype=st.sampled_from(["float16", "bfloat16", "float8_e4m3fn", "int8", ""]),
)
def test_kv_layout(dims: tuple[Arg, ...], dtype: str) -> None:
    world = make_world()
    check_call(world, "KvLayout", lambda w, *d: KvLayout(*d, dtype=dtype), list(dims))


@given(data=st.data())
def test_kv_layout_tp(data: st.DataObject) -> None:
    args = draw_args(data, (lambda: int_arg(8), lambda: int_arg(8)))
    check_call(make_world(), "tp_head_range", lambda w, t, r: LAYOUT.tp_head_range(t, r), args)
    check_call(make_world(), "tp_shard", lambda w, t: LAYOUT.tp_shard(t), args[:1])


@given(
    num_blocks=optional(size_arg()),
    memory_bytes=optional(size_arg((256, 4096))),
    fraction=optional(st.one_of(st.floats(allow_nan=True).map(lambda f: Arg(f, False)), WRONG)),
    growable=flag(),
    max_num_blocks=optional(size_arg()),
    initial_num_blocks=optional(size_arg()),
    chunk_bytes=optional(size_arg((4096, 65536))),
    caching=flag(),
    host_blocks=optional(size_arg()),
)
def test_pool_constructor(
    num_blocks: Arg,
    memory_bytes: Arg,
    fraction: Arg,
    growable: Arg,
    max_num_blocks: Arg,
    initial_num_blocks: Arg,
    chunk_bytes: Arg,
    caching: Arg,
    host_blocks: Arg,
) -> None:
    args = [
        num_blocks,
        memory_bytes,
        fraction,
        growable,
        max_num_blocks,
        initial_num_blocks,
        chunk_bytes,
        caching,
        host_blocks,
    ]

    def make(w: World, *values: Any) -> object:
        n, mem, frac, grow, max_n, init, chunk, cache, host = values
        return Pool(
            LAYOUT,
            n,
            memory_bytes=mem,
            gpu_memory_utilization=frac,
            growable=grow,
            max_num_blocks=max_n,
            initial_num_blocks=init,
            chunk_bytes=chunk,
            device="host",
            enable_prefix_caching=cache,
            prefix_cache_host_blocks=host,
        )

    check_call(make_world(), "Pool", make, args)

    def for_spec(w: World, *values: Any) -> object:
        n, mem, frac, grow, max_n, init, chunk, cache, host = values
        return Pool.for_spec(
            PAGE_SPEC,
            n,
            memory_bytes=mem,
            gpu_memory_utilization=frac,
            growable=grow,
            max_num_blocks=max_n,
            initial_num_blocks=init,
            chunk_bytes=chunk,
            device="host",
            enable_prefix_caching=cache,
            prefix_cache_host_blocks=host,
        )

    check_call(make_world(), "Pool.for_spec", for_spec, args)


@given(data=st.data())
def test_block_tables_and_tier_constructors(data: st.DataObject) -> None:
    world = make_world()
    args = draw_args(data, (size_arg, size_arg))
    optional_args = [Arg(None, False) if a.value is None else a for a in args]
    check_call(world, "BlockTables", lambda w, s, b: BlockTables(w.pool, s, b), args)
    check_call(world, "HostTier", lambda w, n: HostTier(w.tables, n), optional_args[:1])
    check_call(
        world,
        "HostTier memory_bytes",
        lambda w, n: HostTier(w.tables, memory_bytes=n),
        optional_args[1:],
    )


# --- views and DLPack -----------------------------------------------------------------------

VERSIONS = st.one_of(
    st.just(Arg(None, False)),
    st.tuples(st.sampled_from(EDGE_INTS), st.sampled_from(EDGE_INTS)).map(lambda t: Arg(t, False)),
    st.sampled_from([(1,), "1.0", 1.5, (1.0, 0), [1, 0]]).map(lambda v: Arg(v, True)),
)
DEVICES = st.one_of(
    st.just(Arg(None, False)),
    st.tuples(st.sampled_from([1, 2, 0, -1, 2**40]), st.sampled_from([0, 1, -1, 2**40])).map(
        lambda t: Arg(t, False)
    ),
    st.sampled_from([(1,), "cpu", 1.5]).map(lambda v: Arg(v, True)),
)
COPIES = st.one_of(
    st.sampled_from([None, True, False]).map(lambda v: Arg(v, False)),
    st.sampled_from([1, "no"]).map(lambda v: Arg(v, True)),
)


@given(max_version=VERSIONS, dl_device=DEVICES, copy=COPIES, stream=STREAMS)
def test_dlpack(max_version: Arg, dl_device: Arg, copy: Arg, stream: Arg) -> None:
    world = make_world()

    def export(w: World, version: Any, device: Any, copy: Any, stream: Any) -> object:
        view = w.pool.k_view(0).slab_view
        capsule = view.__dlpack__(max_version=version, dl_device=device, copy=copy, stream=stream)
        if version is None or version[0] < 1:
            assert "dltensor" in repr(capsule) and "versioned" not in repr(capsule)
        return np.from_dlpack(view) if version is None else capsule

    check_call(
        world, "__dlpack__", export, [max_version, dl_device, copy, stream], allowed=(BufferError,)
    )


def test_the_fuzzer_covers_every_public_method() -> None:
    fuzzed = {
        Pool: {*POOL_CALLS, "__new__", "for_spec"},
        BlockTables: {*TABLES_CALLS, "__new__"},
        HostTier: {*TIER_CALLS, "__new__"},
        kvpool._core.EvictionStage: set(STAGE_CALLS),
    }
    # Methods without arguments a caller could get wrong: read-only getters and reprs.
    no_args = {
        "shrink",
        "alloc",
        "stats",
        "prefix_cache_stats",
        "take_kv_events",
        "take_kv_event_batch",
        "kv_cache_snapshot",
        "request_ids",
        "poll",
        "wait",
        "check_invariants",
    }
    for cls, names in fuzzed.items():
        methods = {m for m in vars(cls) if not m.startswith("_") and callable(getattr(cls, m))}
        missing = methods - {n.split()[0] for n in names} - no_args
        assert not missing, f"{cls.__name__} methods not fuzzed: {sorted(missing)}"
    assert kvpool._core.SlabView.__dlpack__ is not None
