"""Arguments at the binding boundary: exceptions raised by the caller's iterables propagate as
they are; bools (Python's and NumPy's) are refused wherever a count, index or id is expected,
naming the argument; NumPy id arrays of every stride, alignment and byte order read right.
A failed call changes nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from kvpool import (
    BlockTables,
    HostTier,
    InvalidArgumentError,
    InvalidBlockError,
    KvLayout,
    OutOfBlocksError,
    Pool,
)

LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_dim=16, block_size=4)
NUM_BLOCKS = 256


class CallersOwnError(Exception):
    """Raised by the caller's iterables: must reach the caller unchanged."""


def raising_after(*items: object) -> Iterator[object]:
    yield from items
    raise CallersOwnError("from the caller's generator")


class RaisingIter:
    """An iterable whose `__iter__` itself raises the caller's exception."""

    def __iter__(self) -> Iterator[int]:
        raise CallersOwnError("from the caller's __iter__")


@pytest.fixture
def pool() -> Pool:
    return Pool(LAYOUT, NUM_BLOCKS, device="host", enable_prefix_caching=True)


@pytest.fixture
def tables(pool: Pool) -> BlockTables:
    t = BlockTables(pool, 4, 8)
    t.add(1, 5)
    t.add(2, 3)
    return t


def snapshot(tables: BlockTables) -> tuple[Any, ...]:
    pool = tables.pool
    rows = [(r, tables.num_tokens(r), tables.blocks(r).tolist()) for r in tables.request_ids()]
    return rows, pool.stats(), [pool.ref_cnt(b) for b in range(pool.num_blocks)]


@contextmanager
def unchanged(tables: BlockTables) -> Iterator[None]:
    tables.check_invariants()
    before = snapshot(tables)
    yield
    tables.check_invariants()
    tables.pool.check_invariants()
    assert snapshot(tables) == before


# --- the caller's exceptions propagate -----------------------------------------------------

ITERABLE_CALLS: dict[str, Callable[[BlockTables, Any], object]] = {
    "Pool.free_many": lambda t, it: t.pool.free_many(it),
    "seq_lens": lambda t, it: t.seq_lens(it),
    "block_table": lambda t, it: t.block_table(it),
    "csr": lambda t, it: t.csr(it),
    "append_tokens_many request_ids": lambda t, it: t.append_tokens_many(it, 1),
    "append_tokens_many counts": lambda t, it: t.append_tokens_many([1, 2], it),
    "append_tokens_many token_ids": lambda t, it: t.append_tokens_many([1], [1], it),
    "append_tokens token_ids": lambda t, it: t.append_tokens(1, 1, it),
    "add_request token_ids": lambda t, it: t.add_request(3, it),
    "HostTier.swap_out": lambda t, it: HostTier(t, 16).swap_out(it),
}


@pytest.mark.parametrize("call", sorted(ITERABLE_CALLS))
def test_an_exception_from_the_callers_generator_propagates(tables: BlockTables, call: str) -> None:
    # One valid item first, so the failure comes mid-iteration.
    first = {"Pool.free_many": int(tables.blocks(1)[0])}.get(call, 1)
    with unchanged(tables), pytest.raises(CallersOwnError, match="generator"):
        ITERABLE_CALLS[call](tables, raising_after(first))


@pytest.mark.parametrize("call", sorted(ITERABLE_CALLS))
def test_an_exception_from_the_callers_iter_propagates(tables: BlockTables, call: str) -> None:
    with unchanged(tables), pytest.raises(CallersOwnError, match="__iter__"):
        ITERABLE_CALLS[call](tables, RaisingIter())


def test_a_keyboard_interrupt_from_the_callers_generator_propagates(tables: BlockTables) -> None:
    def interrupted() -> Iterator[int]:
        yield int(tables.blocks(1)[0])
        raise KeyboardInterrupt

    with unchanged(tables), pytest.raises(KeyboardInterrupt):
        tables.pool.free_many(interrupted())


def test_a_non_iterable_is_still_invalid_argument(tables: BlockTables) -> None:
    with unchanged(tables):
        with pytest.raises(InvalidArgumentError, match="iterable"):
            tables.pool.free_many(3.5)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="iterable"):
            tables.seq_lens(3.5)  # type: ignore[arg-type]


# --- bools are refused, naming the argument ------------------------------------------------

BOOLS = [True, False, np.True_, np.False_]


@pytest.mark.parametrize("method", ["k_view", "v_view"])
@pytest.mark.parametrize("flag", BOOLS, ids=repr)
def test_a_bool_layer_is_refused_by_name(pool: Pool, method: str, flag: Any) -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"^invalid argument: layer must be an int, not a bool \(got "
    ):
        getattr(pool, method)(flag)


COUNT_CALLS: dict[str, tuple[str, Callable[[BlockTables, Any], object]]] = {
    "Pool.alloc_many": ("n", lambda t, b: t.pool.alloc_many(b)),
    "Pool.grow": ("num_blocks", lambda t, b: t.pool.grow(b)),
    "Pool()": ("num_blocks", lambda t, b: Pool(LAYOUT, b, device="host")),
    "Pool(memory_bytes)": (
        "memory_bytes",
        lambda t, b: Pool(LAYOUT, memory_bytes=b, device="host"),
    ),
    "KvLayout()": ("num_layers", lambda t, b: KvLayout(b, 1, 16, 4)),
    "KvLayout.tp_shard": ("tp_size", lambda t, b: LAYOUT.tp_shard(b)),
    "BlockTables()": ("max_seqs", lambda t, b: BlockTables(t.pool, b, 4)),
    "add": ("num_tokens", lambda t, b: t.add(3, b)),
    "append_tokens": ("n", lambda t, b: t.append_tokens(1, b)),
    "append_tokens_many one count": ("count", lambda t, b: t.append_tokens_many([1, 2], b)),
    "append_tokens_many counts": ("count", lambda t, b: t.append_tokens_many([1, 2], [1, b])),
    "add_request lora_id": ("lora_id", lambda t, b: t.add_request(3, [1, 2], lora_id=b)),
    "HostTier()": ("num_blocks", lambda t, b: HostTier(t, b)),
}


@pytest.mark.parametrize("call", sorted(COUNT_CALLS))
@pytest.mark.parametrize("flag", BOOLS, ids=repr)
def test_a_bool_count_is_refused_by_name(tables: BlockTables, call: str, flag: Any) -> None:
    name, fn = COUNT_CALLS[call]
    with (
        unchanged(tables),
        pytest.raises(InvalidArgumentError, match=rf"{name} must be an int, not a bool"),
    ):
        fn(tables, flag)


def test_a_numpy_bool_array_of_counts_is_refused(tables: BlockTables) -> None:
    with (
        unchanged(tables),
        pytest.raises(InvalidArgumentError, match="count must be an int, not a bool"),
    ):
        tables.append_tokens_many([1, 2], np.array([True, False]))


@pytest.mark.parametrize("flag", BOOLS, ids=repr)
def test_a_bool_fraction_is_refused(flag: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="bool"):
        Pool(LAYOUT, gpu_memory_utilization=flag, device="host")


BLOCK_ID_CALLS: dict[str, Callable[[Pool, Any], object]] = {
    "free": lambda p, b: p.free(b),
    "ref_cnt": lambda p, b: p.ref_cnt(b),
    "block_ptr": lambda p, b: p.block_ptr(b),
    "free_many list": lambda p, b: p.free_many([b]),
    "free_many array": lambda p, b: p.free_many(np.array([b])),
}


@pytest.mark.parametrize("call", sorted(BLOCK_ID_CALLS))
@pytest.mark.parametrize("flag", BOOLS, ids=repr)
def test_a_bool_block_id_is_refused(tables: BlockTables, call: str, flag: Any) -> None:
    tables.pool.alloc_many(2)  # blocks 0 and 1 in use: only the bool can be what is refused
    with unchanged(tables), pytest.raises(InvalidBlockError, match="a bool is not a block id"):
        BLOCK_ID_CALLS[call](tables.pool, flag)


def test_a_bool_mask_is_not_block_ids(tables: BlockTables) -> None:
    mask = np.zeros(NUM_BLOCKS, dtype=bool)
    mask[tables.blocks(1)] = True
    with unchanged(tables), pytest.raises(InvalidBlockError, match="flatnonzero"):
        tables.pool.free_many(mask)
    with unchanged(tables), pytest.raises(InvalidBlockError, match="a bool is not a block id"):
        tables.pool.free_many(np.zeros(0, dtype=bool))


REQUEST_ID_CALLS: dict[str, Callable[[BlockTables, Any], object]] = {
    "add": lambda t, b: t.add(b, 3),
    "free": lambda t, b: t.free(b),
    "num_tokens": lambda t, b: t.num_tokens(b),
    "seq_lens list": lambda t, b: t.seq_lens([b]),
    "seq_lens array": lambda t, b: t.seq_lens(np.array([b])),
    "append_tokens_many": lambda t, b: t.append_tokens_many([b], 1),
}


@pytest.mark.parametrize("call", sorted(REQUEST_ID_CALLS))
@pytest.mark.parametrize("flag", BOOLS, ids=repr)
def test_a_bool_request_id_is_refused(tables: BlockTables, call: str, flag: Any) -> None:
    with unchanged(tables), pytest.raises(InvalidArgumentError, match="is a bool, not an integer"):
        REQUEST_ID_CALLS[call](tables, flag)


@pytest.mark.parametrize("flag", BOOLS, ids=repr)
def test_a_bool_token_id_is_refused(tables: BlockTables, flag: Any) -> None:
    with unchanged(tables), pytest.raises(InvalidArgumentError, match="is a bool, not an int"):
        tables.add_request(3, [5, flag])


# --- NumPy id arrays in and out ------------------------------------------------------------


def test_alloc_many_returns_a_fresh_int32_array(pool: Pool) -> None:
    for n in (0, 1, 16, 63, 64, 100):
        ids = pool.alloc_many(n)
        assert ids.dtype == np.int32 and ids.shape == (n,)
        assert ids.flags.c_contiguous and ids.flags.writeable and ids.flags.owndata
        assert len(set(ids.tolist())) == n and all(pool.ref_cnt(int(b)) == 1 for b in ids)
        ids[:] = -1  # the caller's to change: the pool keeps no view of it
        pool.check_invariants()
    assert pool.num_used == 0 + 1 + 16 + 63 + 64 + 100


def test_alloc_many_past_the_pool_changes_nothing(pool: Pool) -> None:
    pool.alloc_many(NUM_BLOCKS - 3)
    before = pool.stats()
    for n in (4, 64, NUM_BLOCKS + 1, 2**40):
        with pytest.raises(OutOfBlocksError):
            pool.alloc_many(n)
        assert pool.stats() == before


def id_arrays(ids: list[int]) -> dict[str, np.ndarray]:
    """`ids` as arrays of every layout the fast path must read right."""
    n = len(ids)
    strided = np.full(2 * n, -7, dtype=np.int32)
    strided[::2] = ids
    reversed_ = np.array(ids[::-1], dtype=np.int64)[::-1]
    raw = bytearray(1 + 4 * n)
    misaligned = np.frombuffer(raw, dtype=np.int32, offset=1, count=n)
    misaligned[:] = ids  # writes through to `raw`, at an odd address
    readonly = np.array(ids, dtype=np.int32)
    readonly.flags.writeable = False
    arrays: dict[str, np.ndarray] = {
        "int32": np.array(ids, dtype=np.int32),
        "int64": np.array(ids, dtype=np.int64),
        "longlong": np.array(ids, dtype=np.longlong),
        "intc": np.array(ids, dtype=np.intc),
        "strided": strided[::2],
        "reversed": reversed_,
        "misaligned": misaligned,
        "readonly": readonly,
        "big-endian": np.array(ids, dtype=">i4"),
        "int16": np.array(ids, dtype=np.int16),
        "column": np.array([ids, ids], dtype=np.int32).T[:, 0],
    }
    if min(ids) >= 0:
        arrays["uint32"] = np.array(ids, dtype=np.uint32)
    return arrays


@pytest.mark.parametrize("layout", sorted(id_arrays([1])))
def test_free_many_reads_every_array_layout(pool: Pool, layout: str) -> None:
    held = pool.alloc_many(40).tolist()
    chosen = held[3:30:3]
    pool.free_many(id_arrays(chosen)[layout])
    assert [pool.ref_cnt(b) for b in held] == [0 if b in chosen else 1 for b in held]
    pool.check_invariants()


@pytest.mark.parametrize(
    ("layout", "bad"),
    [
        (layout, bad)
        for layout in sorted(id_arrays([1]))
        for bad in (-1, NUM_BLOCKS, "repeat")
        if (layout, bad) != ("uint32", -1)
    ],  # -1 is no uint32
)
def test_free_many_refuses_a_bad_id_in_every_array_layout(
    pool: Pool, layout: str, bad: Any
) -> None:
    held = pool.alloc_many(8).tolist()
    ids = held[:3] + [held[1] if bad == "repeat" else bad] + held[4:]
    before = pool.stats(), [pool.ref_cnt(b) for b in range(NUM_BLOCKS)]
    with pytest.raises(InvalidBlockError, match="repeated" if bad == "repeat" else str(bad)):
        pool.free_many(id_arrays(ids)[layout])
    assert (pool.stats(), [pool.ref_cnt(b) for b in range(NUM_BLOCKS)]) == before


def test_request_ids_read_from_every_array_layout(tables: BlockTables) -> None:
    for layout, rids in id_arrays([2, 1]).items():
        assert tables.seq_lens(rids).tolist() == [3, 5], layout
