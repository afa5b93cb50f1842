"""Arguments at the binding boundary: exceptions raised by the caller's iterables propagate as
they are; a wrong type is a TypeError naming the argument and the type received (bools,
Python's and NumPy's, are a wrong type wherever a count, index or id is expected), a wrong
value a KvError subclass; NumPy integers and objects with `__index__` are ints; NumPy id
arrays of every stride, alignment and byte order read right. A failed call changes nothing."""

from __future__ import annotations

import subprocess
import sys
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
    LayoutError,
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


def test_a_non_iterable_is_a_type_error_naming_the_argument(tables: BlockTables) -> None:
    with unchanged(tables):
        with pytest.raises(
            TypeError,
            match=r"^argument 'block_ids': must be an iterable of ints, not float \(3\.5\)$",
        ):
            tables.pool.free_many(3.5)  # type: ignore[arg-type]
        with pytest.raises(
            TypeError, match="^argument 'request_ids': must be an iterable of ints, not float"
        ):
            tables.seq_lens(3.5)  # type: ignore[arg-type]


# --- bools are a wrong type, named with the argument --------------------------------------

BOOLS = [True, False, np.True_, np.False_]


@pytest.mark.parametrize("method", ["k_view", "v_view"])
@pytest.mark.parametrize("flag", BOOLS, ids=repr)
def test_a_bool_layer_is_refused_by_name(pool: Pool, method: str, flag: Any) -> None:
    with pytest.raises(TypeError, match=r"^argument 'layer': must be an int, not bool_? \("):
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
    "append_tokens_many one count": ("counts", lambda t, b: t.append_tokens_many([1, 2], b)),
    "append_tokens_many counts": (
        "counts': item 1",
        lambda t, b: t.append_tokens_many([1, 2], [1, b]),
    ),
    "add_request lora_id": ("lora_id", lambda t, b: t.add_request(3, [1, 2], lora_id=b)),
    "HostTier()": ("num_blocks", lambda t, b: HostTier(t, b)),
}


@pytest.mark.parametrize("call", sorted(COUNT_CALLS))
@pytest.mark.parametrize("flag", BOOLS, ids=repr)
def test_a_bool_count_is_refused_by_name(tables: BlockTables, call: str, flag: Any) -> None:
    name, fn = COUNT_CALLS[call]
    with unchanged(tables), pytest.raises(TypeError, match=rf"^argument '{name}'?: must be an int"):
        fn(tables, flag)


def test_a_numpy_bool_array_of_counts_is_refused(tables: BlockTables) -> None:
    with (
        unchanged(tables),
        pytest.raises(
            TypeError, match="^argument 'counts': must be an integer array, not a bool array$"
        ),
    ):
        tables.append_tokens_many([1, 2], np.array([True, False]))


@pytest.mark.parametrize("flag", BOOLS, ids=repr)
def test_a_bool_fraction_is_refused(flag: Any) -> None:
    with pytest.raises(
        TypeError, match="^argument 'gpu_memory_utilization': must be a float, not bool"
    ):
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
    with unchanged(tables), pytest.raises(TypeError, match=r"must be an int(eger array)?, not"):
        BLOCK_ID_CALLS[call](tables.pool, flag)


def test_a_bool_mask_is_not_block_ids(tables: BlockTables) -> None:
    mask = np.zeros(NUM_BLOCKS, dtype=bool)
    mask[tables.blocks(1)] = True
    with unchanged(tables), pytest.raises(TypeError, match="flatnonzero"):
        tables.pool.free_many(mask)
    with unchanged(tables), pytest.raises(TypeError, match="not a bool array"):
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
    with (
        unchanged(tables),
        pytest.raises(TypeError, match=r"^argument 'request_ids?'.*: must be an int"),
    ):
        REQUEST_ID_CALLS[call](tables, flag)


@pytest.mark.parametrize("flag", BOOLS, ids=repr)
def test_a_bool_token_id_is_refused(tables: BlockTables, flag: Any) -> None:
    with (
        unchanged(tables),
        pytest.raises(TypeError, match="^argument 'token_ids': item 1: must be an int, not bool"),
    ):
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


# --- one convention: a wrong type is a TypeError, a wrong value a KvError -----------------


class Index:
    """An int-like user type: `__index__` only."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


WRONG_TYPE_CALLS: dict[str, tuple[str, Callable[[BlockTables, Any], object]]] = {
    "add request_id": ("request_id", lambda t, v: t.add(v, 5)),
    "add num_tokens": ("num_tokens", lambda t, v: t.add(7, v)),
    "free": ("block_id", lambda t, v: t.pool.free(v)),
    "alloc_many": ("n", lambda t, v: t.pool.alloc_many(v)),
    "fork parent_id": ("parent_id", lambda t, v: t.fork(v, 9)),
    "fork child_id": ("child_id", lambda t, v: t.fork(1, v)),
    "tables.free": ("request_id", lambda t, v: t.free(v)),
    "BlockTables max_blocks_per_seq": (
        "max_blocks_per_seq",
        lambda t, v: BlockTables(t.pool, 2, v),
    ),
    "KvLayout head_dim": ("head_dim", lambda t, v: KvLayout(2, 1, v, 4)),
}


@pytest.mark.parametrize("call", sorted(WRONG_TYPE_CALLS))
@pytest.mark.parametrize("value", [1.5, "3", None, b"3", [1]], ids=repr)
def test_a_wrong_type_is_a_type_error_naming_argument_and_type(
    tables: BlockTables, call: str, value: Any
) -> None:
    name, fn = WRONG_TYPE_CALLS[call]
    type_name = type(value).__name__
    with (
        unchanged(tables),
        pytest.raises(TypeError, match=rf"^argument '{name}': must be an int, not {type_name} \("),
    ):
        fn(tables, value)


@pytest.mark.parametrize(
    "value", [np.int64(3), np.int32(3), np.uint8(3), Index(3)], ids=lambda v: type(v).__name__
)
def test_numpy_integers_and_index_objects_are_ints(tables: BlockTables, value: Any) -> None:
    tables.add(value, value)
    assert tables.num_tokens(3) == 3 and tables.pool.alloc_many(value).shape == (3,)
    tables.fork(value, Index(9))
    assert tables.append_tokens_many([value], value)[0].shape == (3,)
    assert tables.append_tokens_many(np.array([3], dtype=np.uint64), [value])[0].shape == (3,)
    assert LAYOUT.tp_head_range(value, 0) == (0, 1)


def test_an_index_past_64_bits_is_a_value_error_naming_it(tables: BlockTables) -> None:
    with (
        unchanged(tables),
        pytest.raises(OutOfBlocksError, match=r"requested 18446744073709551616"),
    ):
        tables.pool.alloc_many(Index(2**64))
    with pytest.raises(
        LayoutError, match=r"^invalid layout: num_layers 18446744073709551616 is out"
    ):
        KvLayout(Index(2**64), 1, 16, 4)
    with unchanged(tables), pytest.raises(InvalidArgumentError, match=r"request id -5 is negative"):
        tables.add(Index(-5), 3)


def test_an_index_raising_its_own_error_propagates(tables: BlockTables) -> None:
    class Raising:
        def __index__(self) -> int:
            raise CallersOwnError("from the caller's __index__")

    with unchanged(tables), pytest.raises(CallersOwnError):
        tables.add(Raising(), 3)


def test_a_huge_layout_value_says_out_of_range_not_positive() -> None:
    with pytest.raises(
        LayoutError, match=r"^invalid layout: num_layers 9223372036854775808 is out of range"
    ):
        KvLayout(2**63, 1, 16, 4)
    with pytest.raises(LayoutError, match=r"num_layers must be positive, got -1$"):
        KvLayout(-1, 1, 16, 4)
    with pytest.raises(LayoutError, match=r"num_layers must be positive, got 0$"):
        KvLayout(0, 1, 16, 4)


def test_a_str_of_counts_is_a_type_error_not_its_characters(tables: BlockTables) -> None:
    with (
        unchanged(tables),
        pytest.raises(
            TypeError,
            match=r"^argument 'counts': must be an int or an iterable of ints, not str \('11'\)$",
        ),
    ):
        tables.append_tokens_many([1, 2], "11")  # type: ignore[arg-type]


def test_block_tables_too_large_for_memory_is_out_of_memory_not_an_abort() -> None:
    # The constructor's 8 GiB table (its docstring says so) under a 3 GiB address-space limit.
    script = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
        "import kvpool\n"
        "pool = kvpool.Pool(kvpool.KvLayout(2, 1, 16, 4), 4, device='host')\n"
        "try:\n"
        "    kvpool.BlockTables(pool, 2**20, 2047)\n"
        "except kvpool.OutOfMemoryError as e:\n"
        "    print('refused:', e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: cannot allocate 8585740288 bytes"), done.stdout
    assert "2047" in (BlockTables.__doc__ or "") and "OutOfMemoryError" in (
        BlockTables.__doc__ or ""
    )


def test_a_stream_without_the_protocol_is_a_type_error_and_a_bad_answer_a_value_error():
    pool = Pool(LAYOUT, 8, device="host")
    tables = BlockTables(pool, 4, 4)
    tier = HostTier(tables, num_blocks=8)
    tables.add(1, 5)
    used = pool.num_used

    class BadAnswer:
        def __cuda_stream__(self):
            return "not (version, handle)"

    with pytest.raises(TypeError, match="stream must implement __cuda_stream__.*got object"):
        tier.swap_out([1], object())
    with pytest.raises(InvalidArgumentError, match="did not return"):
        tier.swap_out([1], BadAnswer())
    assert tier.location(1) == "device" and pool.num_used == used  # nothing moved
    assert tables.check_invariants() is None
