"""Who may free a block, and arguments past what can exist: errors that name what the caller
passed, allocations sized by the caller that fail as `OutOfMemoryError` instead of aborting,
and checks that hold while other threads mutate the tables."""

from __future__ import annotations

import os
import threading

import kvpool
import numpy as np
import pytest
from kvpool import (
    BlockTables,
    InvalidArgumentError,
    InvalidBlockError,
    KvError,
    KvLayout,
    OutOfBlocksError,
    OutOfMemoryError,
    Pool,
)

LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=4)  # 256 B blocks


@pytest.fixture
def pool() -> Pool:
    return Pool(LAYOUT, 16, device="host")


def counts(pool: Pool) -> tuple[int, int, list[int]]:
    return pool.num_free, pool.num_used, [pool.ref_cnt(i) for i in range(pool.num_blocks)]


# --- ownership: the tables' blocks are the tables' ----------------------------------------------


def test_a_block_the_tables_hold_cannot_be_freed_through_the_pool(pool: Pool) -> None:
    tables = BlockTables(pool, 2, 4)
    tables.add(1, 6)
    held = int(tables.blocks(1)[0])
    before = counts(pool)
    for call in (lambda: pool.free(held), lambda: pool.free_many([held])):
        with pytest.raises(
            InvalidBlockError, match=rf"invalid block id {held}: held by block tables"
        ):
            call()
        assert counts(pool) == before
    tables.check_invariants()
    pool.check_invariants(exact_refs=True)
    # Freed with its request, the block is handed out again, and then it is the pool API's.
    tables.free(1)
    ids = pool.alloc_many(pool.num_free)
    assert held in ids.tolist()
    pool.free_many(ids)
    pool.check_invariants(exact_refs=True)


def test_pool_blocks_are_unaffected_by_the_ownership_rule(pool: Pool) -> None:
    ids = pool.alloc_many(3)
    pool.free(int(ids[0]))
    pool.free_many(ids[1:])
    assert pool.num_free == 16


# --- arguments past what can exist ----------------------------------------------------------


def test_a_pool_too_large_for_any_memory_is_out_of_memory_not_an_abort() -> None:
    # 4 MiB blocks: 10**9 of them are 4 PB, past any address space.
    huge_blocks = KvLayout(num_layers=64, num_kv_heads=8, head_dim=128, block_size=16)
    with pytest.raises(OutOfMemoryError):
        Pool(huge_blocks, 10**9, device="host")


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


# Per-block bookkeeping (reference counts, free-list links, owner tags: 13 bytes a block) used
# to be allocated and written at creation for every block a pool could ever hold: a growable
# pool of the most blocks (2**31 - 1) wrote 16 GB before mapping anything (an abort, or the
# OOM killer), a fixed pool of 2**26 blocks 800 MB. Now it is reserved fallibly and committed
# only as ids are used: creation either fails with OutOfMemoryError (an address-space or
# overcommit limit) or costs little resident memory. (The slabs themselves are lazily zeroed.)
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: Pool(LAYOUT, 2**26, device="host"), id="fixed"),
        pytest.param(
            lambda: Pool(LAYOUT, device="host", growable=True, max_num_blocks=2**31 - 1),
            id="growable",
        ),
    ],
)
def test_per_block_bookkeeping_is_not_allocated_up_front(make) -> None:
    before = resident_bytes()
    try:
        big = make()
    except OutOfMemoryError:
        return
    grown = None if before is None else resident_bytes() - before
    assert grown is None or grown < 256 * 2**20, f"creating the pool took {grown} resident bytes"
    ids = big.alloc_many(1000)
    big.free_many(ids)
    assert big.num_used == 0 and big.high_water == 1000


def test_a_huge_sequence_of_block_ids_is_refused_without_sizing_a_buffer_for_it(pool: Pool) -> None:
    ids = pool.alloc_many(4)
    before = counts(pool)
    # len() is 10**12: a buffer of that many ids cannot exist; the first stray id is refused.
    with pytest.raises(InvalidBlockError):
        pool.free_many(range(10**12))
    assert counts(pool) == before
    pool.free_many(ids)


def test_a_huge_sequence_of_token_ids_is_out_of_memory() -> None:
    tables = BlockTables(Pool(LAYOUT, 16, device="host", enable_prefix_caching=True), 2, 4)
    with pytest.raises(OutOfMemoryError):
        tables.add_request(1, range(2**62))
    assert len(tables) == 0 and 1 not in tables
    tables.check_invariants()


def test_alloc_many_past_64_bits_names_the_count(pool: Pool) -> None:
    before = counts(pool)
    with pytest.raises(OutOfBlocksError, match=str(2**200)) as info:
        pool.alloc_many(2**200)
    assert info.value.requested == 2**200
    assert (info.value.free, info.value.num_blocks, info.value.max_num_blocks) == (16, 16, None)
    assert counts(pool) == before


def test_memory_bytes_errors_talk_about_memory_bytes() -> None:
    for too_large in (2**63, 2**64):
        with pytest.raises(
            InvalidArgumentError,
            match=rf"^invalid argument: memory_bytes {too_large} is out of range "
            rf"\(at most {2**63 - 1}\)$",
        ):
            Pool(LAYOUT, memory_bytes=too_large, device="host")
    with pytest.raises(InvalidArgumentError, match=rf"memory_bytes={2**62} holds \d+ blocks"):
        Pool(LAYOUT, memory_bytes=2**62, device="host")


def test_layout_sizes_past_64_bits_are_named() -> None:
    with pytest.raises(kvpool.LayoutError, match=str(2**70)):
        KvLayout(2**70, 1, 16, 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gpu_memory_utilization": True},
        {"num_blocks": True},
        {"memory_bytes": False},
        {"growable": True, "max_num_blocks": True},
    ],
)
def test_bools_are_refused_where_numbers_are_expected(kwargs: dict[str, object]) -> None:
    with pytest.raises(TypeError, match="not bool"):
        Pool(LAYOUT, device="host", **kwargs)  # type: ignore[arg-type]


def test_tables_refuse_bools_as_counts(pool: Pool) -> None:
    tables = BlockTables(pool, 2, 4)
    with pytest.raises(TypeError, match="^argument 'num_tokens': must be an int, not bool"):
        tables.add(1, True)
    with pytest.raises(TypeError, match="^argument 'max_seqs': must be an int, not bool"):
        BlockTables(pool, True, 4)


def test_a_batch_too_large_to_gather_is_out_of_memory(pool: Pool) -> None:
    # 2**22 repeated ids x a 2**16-wide row x 4 bytes: a 1 TiB table.
    tables = BlockTables(pool, 2, 2**16)
    tables.add(1, 3)
    repeated = np.ones(2**22, dtype=np.int64)
    with pytest.raises(OutOfMemoryError):
        tables.block_table(repeated)
    # seq_lens and CSR are sized by what they hold: they fit.
    assert tables.seq_lens(repeated).shape == (2**22,)
    assert tables.csr(repeated)[1].shape == (2**22,)
    tables.check_invariants()


def test_system_error_is_a_kv_error_with_errno() -> None:
    assert issubclass(kvpool.KvSystemError, KvError)
    assert kvpool.KvSystemError.__module__ == "kvpool.exceptions"


# --- checks under concurrency -----------------------------------------------------------------


def test_tables_check_invariants_holds_while_other_threads_mutate(pool: Pool) -> None:
    tables = BlockTables(pool, 4, 4)
    errors: list[BaseException] = []
    stop = threading.Event()

    def mutate(request_id: int) -> None:
        try:
            for _ in range(300):
                tables.add(request_id, 3)
                tables.append_tokens(request_id, 5)
                tables.fork(request_id, request_id + 100)
                tables.append_tokens(request_id + 100, 1)
                tables.free(request_id)
                tables.free(request_id + 100)
        except BaseException as e:
            errors.append(e)

    def check() -> None:
        try:
            while not stop.is_set():
                tables.check_invariants()
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=mutate, args=(r,)) for r in (1, 2)]
    checker = threading.Thread(target=check)
    checker.start()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    checker.join()
    assert errors == []
    tables.check_invariants()
    pool.check_invariants(exact_refs=True)
