"""BlockTables on the host: every method and every error path. A failed call changes nothing."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from kvpool import (
    BlockTables,
    CapacityError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidBlockError,
    KvError,
    KvLayout,
    OutOfBlocksError,
    Pool,
    UnknownRequestError,
)

BS = 4  # tokens per block: small, so a few tokens cross block boundaries
LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=BS)  # 256 B blocks
NUM_BLOCKS = 16
MAX_SEQS = 4
MAX_BLOCKS = 6

BAD_IDS: list[Any] = [-1, 2**64, 2**70, 1.5, "7", None, [1]]


@pytest.fixture
def pool() -> Pool:
    return Pool(LAYOUT, NUM_BLOCKS, device="host")


@pytest.fixture
def tables(pool: Pool) -> BlockTables:
    return BlockTables(pool, MAX_SEQS, MAX_BLOCKS)


def check(tables: BlockTables) -> None:
    """Both invariant checks; nothing but `tables` holds blocks in these tests."""
    tables.check_invariants()
    tables.pool.check_invariants(exact_refs=True)


def snapshot(tables: BlockTables) -> tuple[Any, ...]:
    """Everything observable about the tables and their pool."""
    pool = tables.pool
    ids = tables.request_ids()
    per_request = [(r, tables.num_tokens(r), tables.blocks(r).tolist()) for r in ids]
    table, seq_lens = tables.sync()
    return (
        ids,
        per_request,
        table.tolist(),
        seq_lens.tolist(),
        pool.num_free,
        [pool.ref_cnt(b) for b in range(pool.num_blocks)],
    )


@contextmanager
def unchanged(tables: BlockTables) -> Iterator[None]:
    check(tables)
    before = snapshot(tables)
    yield
    check(tables)
    assert snapshot(tables) == before


def expected_slots(blocks: np.ndarray, start: int, stop: int) -> list[int]:
    """vLLM's slot mapping: token p lives at block_id * block_size + p % block_size."""
    return [int(blocks[p // BS]) * BS + p % BS for p in range(start, stop)]


# --- construction, len, contains --------------------------------------------------------------


def test_construction(pool: Pool, tables: BlockTables) -> None:
    assert tables.pool is pool
    assert (tables.max_seqs, tables.max_blocks_per_seq) == (MAX_SEQS, MAX_BLOCKS)
    assert len(tables) == 0 and tables.request_ids() == []
    assert "BlockTables(len=0" in repr(tables)
    table, seq_lens = tables.sync()
    assert table.shape == (0, MAX_BLOCKS) and table.dtype == np.int32
    assert seq_lens.shape == (0,) and seq_lens.dtype == np.int32
    assert pool.stream is None
    check(tables)


@pytest.mark.parametrize("max_seqs,max_blocks", [(0, 4), (4, 0), (-1, 4), (4, -1), (2**40, 2**40)])
def test_construction_rejects_bad_capacity(pool: Pool, max_seqs: int, max_blocks: int) -> None:
    with pytest.raises(InvalidArgumentError):
        BlockTables(pool, max_seqs, max_blocks)


def test_len_and_contains(tables: BlockTables) -> None:
    tables.add(10, 3)
    tables.add(2**64 - 1, 0)  # the largest request id
    assert len(tables) == 2
    assert 10 in tables and 2**64 - 1 in tables and np.int64(10) in tables
    assert 11 not in tables
    for bad in BAD_IDS:
        assert bad not in tables
    tables.free(10)
    assert 10 not in tables and len(tables) == 1


# --- add, append, slot mapping ----------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [0, 1, BS - 1, BS, BS + 1, MAX_BLOCKS * BS])
def test_add_allocates_ceil_blocks_and_returns_slots(tables: BlockTables, num_tokens: int) -> None:
    pool = tables.pool
    slots = tables.add(7, num_tokens)
    blocks = tables.blocks(7)
    assert slots.dtype == np.int64 and blocks.dtype == np.int32
    assert len(blocks) == -(-num_tokens // BS)
    assert pool.num_free == NUM_BLOCKS - len(blocks)
    assert slots.tolist() == expected_slots(blocks, 0, num_tokens)
    assert tables.num_tokens(7) == num_tokens
    assert all(pool.ref_cnt(int(b)) == 1 for b in blocks)
    check(tables)


def test_append_takes_a_block_only_when_the_last_one_fills(tables: BlockTables) -> None:
    pool = tables.pool
    tables.add(1, 1)
    history = [len(tables.blocks(1))]
    for n in range(1, 2 * BS + 3):
        slots, copies = tables.append_tokens(1, 1)
        assert copies.shape == (0, 2) and copies.dtype == np.int32
        assert slots.tolist() == expected_slots(tables.blocks(1), n, n + 1)
        history.append(len(tables.blocks(1)))
        assert pool.num_free == NUM_BLOCKS - history[-1]
        check(tables)
    # one new block exactly at tokens BS+1, 2*BS+1, ...
    assert history == [-(-(n + 1) // BS) for n in range(2 * BS + 3)]


def test_append_zero_tokens_changes_nothing(tables: BlockTables) -> None:
    tables.add(1, BS)
    with unchanged(tables):
        slots, copies = tables.append_tokens(1, 0)
        slots_many, copies_many = tables.append_tokens_many([1], [0])
    assert slots.shape == (0,) and copies.shape == (0, 2)
    assert slots_many.shape == (0,) and copies_many.shape == (0, 2)


def test_append_many_concatenates_slots_in_call_order(tables: BlockTables) -> None:
    tables.add(1, 3)
    tables.add(2, 0)
    tables.add(3, BS)
    before = {r: tables.num_tokens(r) for r in (1, 2, 3)}
    order, counts = [3, 1, 2], [5, 2, BS + 1]
    slots, copies = tables.append_tokens_many(order, counts)
    assert copies.shape == (0, 2)
    expected = []
    for r, n in zip(order, counts):
        expected += expected_slots(tables.blocks(r), before[r], before[r] + n)
        assert tables.num_tokens(r) == before[r] + n
    assert slots.tolist() == expected
    check(tables)


@pytest.mark.parametrize(
    "ids,counts",
    [
        ([1, 2], 3),  # one count for all
        (np.array([1, 2], dtype=np.int64), np.array([3, 3])),
        ((1, 2), (3, 3)),
        (iter([1, 2]), [np.int64(3), 3]),
        ([np.uint64(1), np.int32(2)], [3, 3]),
    ],
)
def test_append_many_argument_forms(tables: BlockTables, ids: Any, counts: Any) -> None:
    tables.add(1, 1)
    tables.add(2, 2)
    slots, _ = tables.append_tokens_many(ids, counts)
    assert len(slots) == 6
    assert (tables.num_tokens(1), tables.num_tokens(2)) == (4, 5)


def test_append_many_empty_batch(tables: BlockTables) -> None:
    tables.add(1, 1)
    with unchanged(tables):
        slots, copies = tables.append_tokens_many([], [])
        tables.append_tokens_many(np.array([], dtype=np.int64), 1)
    assert slots.shape == (0,) and copies.shape == (0, 2)


def test_slots_are_distinct_across_requests(tables: BlockTables) -> None:
    all_slots = [tables.add(r, n).tolist() for r, n in [(1, 5), (2, 3), (3, 9)]]
    all_slots.append(tables.append_tokens_many([1, 2, 3], [2, 6, 1])[0].tolist())
    flat = list(itertools.chain.from_iterable(all_slots))
    assert len(flat) == len(set(flat))
    assert all(0 <= s < NUM_BLOCKS * BS for s in flat)


# --- free ---------------------------------------------------------------------------------------


def test_free_returns_blocks_and_moves_the_last_row_into_the_hole(tables: BlockTables) -> None:
    pool = tables.pool
    for r, n in [(10, 5), (20, 1), (30, 9), (40, 0)]:
        tables.add(r, n)
    assert tables.request_ids() == [10, 20, 30, 40]
    blocks_30 = tables.blocks(30).tolist()
    tables.free(20)
    assert tables.request_ids() == [10, 40, 30]
    assert tables.blocks(30).tolist() == blocks_30 and tables.num_tokens(30) == 9
    assert pool.num_free == NUM_BLOCKS - 2 - 3
    tables.free(30)  # the last row: nothing moves
    assert tables.request_ids() == [10, 40]
    tables.free(10)
    assert tables.request_ids() == [40]
    tables.free(40)
    assert tables.request_ids() == [] and pool.num_free == NUM_BLOCKS
    table, seq_lens = tables.sync()
    assert table.shape == (0, MAX_BLOCKS) and seq_lens.shape == (0,)
    check(tables)


def test_freed_id_can_be_reused(tables: BlockTables) -> None:
    tables.add(1, 5)
    tables.free(1)
    tables.add(1, 2)
    assert tables.num_tokens(1) == 2 and len(tables.blocks(1)) == 1
    check(tables)


# --- batch views: seq_lens, block_table, csr, sync ------------------------------------------------


def populate(tables: BlockTables) -> dict[int, int]:
    sizes = {5: 1, 6: BS, 7: BS + 1, 8: 0}
    for r, n in sizes.items():
        tables.add(r, n)
    tables.free(6)  # shuffles the rows
    tables.add(6, 3 * BS - 1)
    del sizes[6]
    sizes[6] = 3 * BS - 1
    return sizes


@pytest.mark.parametrize("batch", [[5, 6, 7, 8], [8, 7, 6, 5], [7], [6, 5], [], [5, 5, 7]])
def test_batch_views_follow_the_batch_order(tables: BlockTables, batch: list[int]) -> None:
    sizes = populate(tables)
    seq_lens = tables.seq_lens(batch)
    table = tables.block_table(batch)
    assert seq_lens.dtype == np.int32 and table.dtype == np.int32
    assert seq_lens.tolist() == [sizes[r] for r in batch]
    assert table.shape == (len(batch), MAX_BLOCKS)
    for i, r in enumerate(batch):
        blocks = tables.blocks(r).tolist()
        assert table[i].tolist() == blocks + [-1] * (MAX_BLOCKS - len(blocks))

    indptr, indices, last_page_len = tables.csr(batch)
    assert indptr.dtype == indices.dtype == last_page_len.dtype == np.int32
    assert indptr.tolist() == [0, *itertools.accumulate(len(tables.blocks(r)) for r in batch)]
    assert indices.tolist() == [b for r in batch for b in tables.blocks(r).tolist()]
    for r, last in zip(batch, last_page_len.tolist()):
        if sizes[r] == 0:
            assert last == 0  # no pages at all
        else:  # FlashInfer: tokens in the last page, 1..block_size
            assert 1 <= last <= BS
            assert (len(tables.blocks(r)) - 1) * BS + last == sizes[r]


def test_batch_views_accept_arrays(tables: BlockTables) -> None:
    sizes = populate(tables)
    batch = np.array([7, 5], dtype=np.int64)
    assert tables.seq_lens(batch).tolist() == [sizes[7], sizes[5]]
    assert np.array_equal(tables.block_table(batch), tables.block_table([7, 5]))


def test_sync_on_host_returns_numpy_in_row_order(tables: BlockTables) -> None:
    populate(tables)
    ids = tables.request_ids()
    table, seq_lens = tables.sync()
    assert isinstance(table, np.ndarray) and isinstance(seq_lens, np.ndarray)
    assert np.array_equal(table, tables.block_table(ids))
    assert np.array_equal(seq_lens, tables.seq_lens(ids))
    table[:] = 99  # a copy: writing it does not touch the tables
    seq_lens[:] = 99
    assert np.array_equal(tables.sync()[0], tables.block_table(ids))
    check(tables)


def test_sync_on_host_rejects_a_stream(tables: BlockTables) -> None:
    with pytest.raises(InvalidArgumentError):
        tables.sync(stream=0)


# --- copy-on-write fork -----------------------------------------------------------------------------


def test_fork_shares_every_block(tables: BlockTables) -> None:
    pool = tables.pool
    tables.add(1, 2 * BS + 1)
    free = pool.num_free
    tables.fork(1, 2)
    assert tables.blocks(2).tolist() == tables.blocks(1).tolist()
    assert tables.num_tokens(2) == 2 * BS + 1
    assert pool.num_free == free
    assert all(pool.ref_cnt(int(b)) == 2 for b in tables.blocks(1))
    check(tables)


def test_child_append_into_shared_partial_block_copies(tables: BlockTables) -> None:
    pool = tables.pool
    tables.add(1, BS + 2)
    parent = tables.blocks(1).tolist()
    tables.fork(1, 2)
    slots, copies = tables.append_tokens(2, 1)
    child = tables.blocks(2).tolist()
    assert copies.tolist() == [[parent[-1], child[-1]]]
    assert child[:-1] == parent[:-1] and child[-1] not in parent
    assert slots.tolist() == [child[-1] * BS + 2]  # offset 2 of the fresh block
    assert tables.blocks(1).tolist() == parent  # the parent keeps the original
    assert [pool.ref_cnt(b) for b in parent] == [2, 1]
    assert pool.ref_cnt(child[-1]) == 1
    check(tables)
    # the parent's last block is its own now: no copy, the slot goes into the original
    slots, copies = tables.append_tokens(1, 1)
    assert copies.shape == (0, 2) and slots.tolist() == [parent[-1] * BS + 2]
    assert tables.blocks(1).tolist() == parent
    check(tables)


def test_parent_append_after_fork_copies_and_child_keeps_original(tables: BlockTables) -> None:
    tables.add(1, 3)
    original = tables.blocks(1).tolist()
    tables.fork(1, 2)
    slots, copies = tables.append_tokens(1, 2)  # fills the copy and takes one more block
    new = tables.blocks(1).tolist()
    assert copies.tolist() == [[original[0], new[0]]]
    assert len(new) == 2 and tables.blocks(2).tolist() == original
    assert slots.tolist() == [new[0] * BS + 3, new[1] * BS]
    check(tables)


def test_fork_with_full_last_block_needs_no_copy(tables: BlockTables) -> None:
    pool = tables.pool
    tables.add(1, 2 * BS)
    parent = tables.blocks(1).tolist()
    tables.fork(1, 2)
    slots, copies = tables.append_tokens(2, 1)
    child = tables.blocks(2).tolist()
    assert copies.shape == (0, 2)
    assert child[:2] == parent and child[2] not in parent
    assert slots.tolist() == [child[2] * BS]
    assert [pool.ref_cnt(b) for b in parent] == [2, 2]
    check(tables)


def test_appending_zero_tokens_to_a_shared_block_does_not_copy(tables: BlockTables) -> None:
    tables.add(1, 1)
    tables.fork(1, 2)
    with unchanged(tables):
        _, copies = tables.append_tokens_many([1, 2], [0, 0])
    assert copies.shape == (0, 2)


@pytest.mark.parametrize("order", [[1, 2], [2, 1]])
def test_parent_and_child_append_in_one_call(tables: BlockTables, order: list[int]) -> None:
    """The first in the call copies; the second finds the block unshared and keeps it."""
    pool = tables.pool
    tables.add(1, BS + 1)
    original = tables.blocks(1).tolist()
    tables.fork(1, 2)
    slots, copies = tables.append_tokens_many(order, [1, 1])
    first, second = order
    first_blocks, second_blocks = tables.blocks(first).tolist(), tables.blocks(second).tolist()
    assert copies.tolist() == [[original[-1], first_blocks[-1]]]
    assert second_blocks == original
    assert first_blocks[0] == original[0] and first_blocks[-1] not in original
    assert slots.tolist() == [first_blocks[-1] * BS + 1, original[-1] * BS + 1]
    assert [pool.ref_cnt(b) for b in original] == [2, 1]
    check(tables)


def test_three_way_share_appending_together_copies_twice(tables: BlockTables) -> None:
    tables.add(1, 2)
    original = tables.blocks(1).tolist()
    tables.fork(1, 2)
    tables.fork(2, 3)  # a fork of a fork shares the same blocks
    assert tables.pool.ref_cnt(original[0]) == 3
    _, copies = tables.append_tokens_many([3, 1, 2], 1)
    assert [src for src, _ in copies.tolist()] == [original[0]] * 2
    assert tables.blocks(2).tolist() == original  # the last one keeps the original
    dsts = {tables.blocks(3)[0], tables.blocks(1)[0]}
    assert dsts == {dst for _, dst in copies.tolist()} and original[0] not in dsts
    assert tables.pool.ref_cnt(original[0]) == 1
    check(tables)


def test_free_after_fork_keeps_shared_blocks(tables: BlockTables) -> None:
    pool = tables.pool
    tables.add(1, 2 * BS + 1)
    blocks = tables.blocks(1).tolist()
    tables.fork(1, 2)
    tables.free(1)
    assert tables.blocks(2).tolist() == blocks
    assert [pool.ref_cnt(b) for b in blocks] == [1, 1, 1]
    assert pool.num_free == NUM_BLOCKS - 3
    slots, copies = tables.append_tokens(2, 1)  # the sole owner now: no copy
    assert copies.shape == (0, 2) and slots.tolist() == [blocks[-1] * BS + 1]
    tables.free(2)
    assert pool.num_free == NUM_BLOCKS
    check(tables)


def test_fork_past_the_most_references_a_block_holds_fails_and_changes_nothing() -> None:
    """Reference counts are 16 bits wide: a fork stops at 65 534 references to one block."""
    most_shared = 65_534
    pool = Pool(LAYOUT, 4, device="host")
    tables = BlockTables(pool, most_shared + 1, 1)
    tables.add(0, BS)
    block = int(tables.blocks(0)[0])
    for child in range(1, most_shared):
        tables.fork(0, child)
    assert pool.ref_cnt(block) == most_shared
    free = pool.num_free
    with pytest.raises(
        InvalidBlockError, match=f"block id {block}: already has {most_shared} references"
    ):
        tables.fork(0, most_shared)
    assert pool.ref_cnt(block) == most_shared and pool.num_free == free
    assert most_shared not in tables and len(tables.request_ids()) == most_shared
    # One reference fewer, and the fork goes through.
    tables.free(1)
    tables.fork(0, most_shared)
    assert pool.ref_cnt(block) == most_shared
    check(tables)


def test_fork_of_an_empty_request(tables: BlockTables) -> None:
    tables.add(1, 0)
    tables.fork(1, 2)
    assert tables.blocks(2).tolist() == [] and tables.num_tokens(2) == 0
    slots, copies = tables.append_tokens(2, 1)
    assert copies.shape == (0, 2) and len(tables.blocks(2)) == 1
    assert slots.tolist() == [int(tables.blocks(2)[0]) * BS]
    assert tables.blocks(1).tolist() == []
    check(tables)


# --- errors: unknown and duplicate ids ------------------------------------------------------------


def test_unknown_request_id_everywhere(tables: BlockTables) -> None:
    tables.add(1, 3)
    tables.add(2, 5)
    calls = [
        lambda: tables.num_tokens(99),
        lambda: tables.blocks(99),
        lambda: tables.append_tokens(99, 1),
        lambda: tables.append_tokens_many([1, 99], [1, 1]),
        lambda: tables.append_tokens_many([1, 2, 99], [BS, BS, 1]),  # would take blocks first
        lambda: tables.fork(99, 3),
        lambda: tables.free(99),
        lambda: tables.seq_lens([1, 99]),
        lambda: tables.block_table([99]),
        lambda: tables.csr([2, 99]),
    ]
    for call in calls:
        with unchanged(tables), pytest.raises(UnknownRequestError):
            call()


def test_error_classes_share_the_base() -> None:
    for cls in (
        UnknownRequestError,
        DuplicateRequestError,
        CapacityError,
        OutOfBlocksError,
        InvalidArgumentError,
    ):
        assert issubclass(cls, KvError)


def test_duplicate_request_id(tables: BlockTables) -> None:
    tables.add(1, 3)
    tables.add(2, 1)
    for call in (lambda: tables.add(1, 1), lambda: tables.fork(2, 1), lambda: tables.fork(1, 1)):
        with unchanged(tables), pytest.raises(DuplicateRequestError):
            call()


@pytest.mark.parametrize("bad", BAD_IDS)
def test_bad_request_ids_raise_kv_errors(tables: BlockTables, bad: Any) -> None:
    tables.add(1, 3)
    calls = [
        lambda: tables.add(bad, 1),
        lambda: tables.num_tokens(bad),
        lambda: tables.blocks(bad),
        lambda: tables.append_tokens(bad, 1),
        lambda: tables.append_tokens_many([1, bad], 1),
        lambda: tables.fork(bad, 2),
        lambda: tables.fork(1, bad),
        lambda: tables.free(bad),
        lambda: tables.seq_lens([bad]),
        lambda: tables.block_table([1, bad]),
        lambda: tables.csr([bad]),
    ]
    is_int = isinstance(bad, int | np.integer) and not isinstance(bad, bool | np.bool_)
    for call in calls:
        with unchanged(tables), pytest.raises(KvError if is_int else TypeError):
            call()


def test_negative_ids_in_an_int64_array(tables: BlockTables) -> None:
    tables.add(1, 3)
    with unchanged(tables), pytest.raises(InvalidArgumentError):
        tables.append_tokens_many(np.array([1, -1], dtype=np.int64), 1)


@pytest.mark.parametrize("not_iterable", [None, 3, object()])
def test_request_ids_must_be_iterable(tables: BlockTables, not_iterable: Any) -> None:
    tables.add(1, 3)
    with unchanged(tables), pytest.raises(TypeError, match="must be an iterable of ints"):
        tables.append_tokens_many(not_iterable, 1)


# --- errors: argument checks -------------------------------------------------------------------


@pytest.mark.parametrize("counts", [[1], [1, 1, 1], []])
def test_append_many_mismatched_lengths(tables: BlockTables, counts: list[int]) -> None:
    tables.add(1, 3)
    tables.add(2, 3)
    with unchanged(tables), pytest.raises(InvalidArgumentError):
        tables.append_tokens_many([1, 2], counts)


@pytest.mark.parametrize("ids", [[1, 1], [1, 2, 1], [2, 1, 2]])
def test_append_many_repeated_id(tables: BlockTables, ids: list[int]) -> None:
    tables.add(1, 3)
    tables.add(2, BS)
    with unchanged(tables), pytest.raises(InvalidArgumentError):
        tables.append_tokens_many(ids, 1)


@pytest.mark.parametrize(
    ("counts", "error"),
    [
        ([1, -1], InvalidArgumentError),
        (-1, InvalidArgumentError),
        ([1, 1.5], TypeError),
        ([1, "2"], TypeError),
        ([1, None], TypeError),
        (None, TypeError),
        ([1, True], TypeError),
    ],
)
def test_append_many_bad_counts(tables: BlockTables, counts: Any, error: type[Exception]) -> None:
    tables.add(1, 3)
    tables.add(2, 3)
    with unchanged(tables), pytest.raises(error):
        tables.append_tokens_many([1, 2], counts)


def test_append_many_count_beyond_any_int_exceeds_capacity(tables: BlockTables) -> None:
    tables.add(1, 3)
    with unchanged(tables), pytest.raises(CapacityError):
        tables.append_tokens_many([1], [2**64])


def test_negative_token_counts(tables: BlockTables) -> None:
    tables.add(1, 3)
    for call in (lambda: tables.add(2, -1), lambda: tables.append_tokens(1, -1)):
        with unchanged(tables), pytest.raises(InvalidArgumentError):
            call()


# --- errors: capacity ----------------------------------------------------------------------------


def test_max_seqs(tables: BlockTables) -> None:
    for r in range(MAX_SEQS):
        tables.add(r, 1)
    for call in (lambda: tables.add(100, 0), lambda: tables.fork(0, 100)):
        with unchanged(tables), pytest.raises(CapacityError):
            call()
    tables.free(0)
    tables.fork(1, 100)  # room again
    check(tables)


def test_max_blocks_per_seq(tables: BlockTables) -> None:
    full = MAX_BLOCKS * BS
    with unchanged(tables), pytest.raises(CapacityError):
        tables.add(1, full + 1)
    tables.add(1, full - 1)
    tables.add(2, 1)
    for call in (
        lambda: tables.append_tokens(1, 2),
        lambda: tables.append_tokens_many([2, 1], [1, 2]),  # the first fits; none may grow
        lambda: tables.append_tokens(2, 2**62),
    ):
        with unchanged(tables), pytest.raises(CapacityError):
            call()
    tables.append_tokens(1, 1)  # exactly full is fine
    assert len(tables.blocks(1)) == MAX_BLOCKS
    with unchanged(tables), pytest.raises(CapacityError):
        tables.append_tokens(1, 1)
    assert tables.append_tokens(1, 0)[0].shape == (0,)


# --- errors: out of blocks (all or nothing) ----------------------------------------------------------


def assert_out_of_blocks(
    excinfo: pytest.ExceptionInfo[OutOfBlocksError], requested: int, free: int
) -> None:
    assert (excinfo.value.requested, excinfo.value.free, excinfo.value.num_blocks) == (
        requested,
        free,
        NUM_BLOCKS,
    )


def test_add_out_of_blocks(pool: Pool) -> None:
    tables = BlockTables(pool, MAX_SEQS, NUM_BLOCKS + 1)
    tables.add(1, (NUM_BLOCKS - 2) * BS)
    with unchanged(tables), pytest.raises(OutOfBlocksError) as excinfo:
        tables.add(2, 2 * BS + 1)
    assert_out_of_blocks(excinfo, 3, 2)
    tables.add(2, 2 * BS)  # exactly what is left
    assert pool.num_free == 0
    check(tables)


def test_append_out_of_blocks_is_all_or_nothing(tables: BlockTables) -> None:
    pool = tables.pool
    tables.add(1, 5 * BS)
    tables.add(2, 5 * BS - 1)
    tables.add(3, 4 * BS)
    assert pool.num_free == 2
    with unchanged(tables), pytest.raises(OutOfBlocksError) as excinfo:
        tables.append_tokens_many([1, 2, 3], [1, 2, 1])  # one new block each: 3 > 2
    assert_out_of_blocks(excinfo, 3, 2)
    tables.append_tokens_many([1, 2, 3], [1, 1, 1])  # 2 fills its last block: 2 new blocks
    assert pool.num_free == 0
    check(tables)


def test_copy_on_write_out_of_blocks(pool: Pool) -> None:
    tables = BlockTables(pool, MAX_SEQS, NUM_BLOCKS)
    tables.add(1, (NUM_BLOCKS - 1) * BS + 1)  # the last block partly filled
    tables.fork(1, 2)
    assert pool.num_free == 0
    for call in (lambda: tables.append_tokens(2, 1), lambda: tables.append_tokens_many([1, 2], 1)):
        with unchanged(tables), pytest.raises(OutOfBlocksError) as excinfo:
            call()
        assert_out_of_blocks(excinfo, 1, 0)
    tables.free(1)  # the child owns everything now and appends in place
    _, copies = tables.append_tokens(2, 1)
    assert copies.shape == (0, 2)
    check(tables)


def test_out_of_blocks_counts_the_copy_and_the_new_blocks_together(pool: Pool) -> None:
    tables = BlockTables(pool, MAX_SEQS, NUM_BLOCKS)
    tables.add(1, BS + 1)
    tables.fork(1, 2)
    tables.add(3, (NUM_BLOCKS - 4) * BS)
    assert pool.num_free == 2
    with unchanged(tables), pytest.raises(OutOfBlocksError) as excinfo:
        tables.append_tokens(2, 2 * BS)  # one copy + two new blocks
    assert_out_of_blocks(excinfo, 3, 2)
    _, copies = tables.append_tokens(2, BS)  # one copy + one new block
    assert copies.shape == (1, 2) and pool.num_free == 0
    check(tables)


# --- lifetime ------------------------------------------------------------------------------------


def test_dropping_the_tables_returns_their_blocks(pool: Pool) -> None:
    import gc

    tables = BlockTables(pool, MAX_SEQS, MAX_BLOCKS)
    tables.add(1, 2 * BS + 1)
    tables.fork(1, 2)
    tables.append_tokens(2, 1)  # a copy-on-write block too
    other = BlockTables(pool, MAX_SEQS, MAX_BLOCKS)
    other.add(1, BS)
    assert pool.num_free == NUM_BLOCKS - 5
    del tables
    gc.collect()
    assert pool.num_free == NUM_BLOCKS - 1
    pool.check_invariants(exact_refs=True)
    del other
    gc.collect()
    assert pool.num_free == NUM_BLOCKS
    pool.check_invariants(exact_refs=True)


def test_tables_keep_their_pool_alive() -> None:
    import gc

    tables = BlockTables(Pool(LAYOUT, NUM_BLOCKS, device="host"), MAX_SEQS, MAX_BLOCKS)
    gc.collect()
    tables.add(1, 3)
    assert tables.pool.num_free == NUM_BLOCKS - 1
    check(tables)
