"""The NumPy reference of the paged_metadata kernel (slot mapping and FlashInfer's CSR page
table) against independent constructions: the generation loop's build_step for the slot
mapping of packed steps, and the CSR read back into per-sequence page lists. No GPU."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvpool import reference
from kvpool.generation import build_step


def _tables(lens, block_size=4, width=16):
    pool = kvpool.Pool(kvpool.KvLayout(1, 1, 64, block_size, "float16"), 128, device="host")
    tables = kvpool.BlockTables(pool, len(lens), width)
    for i, n in enumerate(lens):
        tables.add(i, n)
    return pool, tables


@given(st.lists(st.tuples(st.integers(1, 30), st.integers(0, 30)), min_size=1, max_size=6))
def test_slot_mapping_equals_build_steps(seqs):
    """Sequence i holds cached + new tokens; the step computes the new ones (prefill chunks,
    or a single decode token). The reference's slots are build_step's, padding -1."""
    seqs = [(c, n if n else 1) for c, n in seqs]
    pool, tables = _tables([c + n for c, n in seqs])
    prefill = [(i, [0] * n, c) for i, (c, n) in enumerate(seqs)]
    batch = build_step(tables, [], prefill, [], [])
    table = tables.block_table(list(range(len(seqs))))
    lens = np.array([c + n for c, n in seqs], np.int32)
    pad = 5
    slots, *_ = reference.paged_metadata(
        table, lens, 4, batch.prefill_qo_indptr, batch.num_tokens + pad
    )
    np.testing.assert_array_equal(slots[: batch.num_tokens], batch.slot_mapping)
    assert (slots[batch.num_tokens :] == -1).all()


@given(st.lists(st.integers(0, 32), min_size=0, max_size=7), st.sampled_from([1, 4, 16]))
def test_csr_lists_each_sequences_pages(lens, block_size):
    width = 3 if block_size == 16 else 32
    rng = np.random.default_rng(len(lens))
    table = rng.integers(0, 1000, (len(lens), width)).astype(np.int32)
    _, indptr, indices, last = reference.paged_metadata(table, np.array(lens, np.int32), block_size)
    assert indptr[0] == 0 and len(indices) == len(lens) * width
    for s, n in enumerate(lens):
        pages = min(-(-n // block_size), width)
        assert indptr[s + 1] - indptr[s] == pages
        np.testing.assert_array_equal(indices[indptr[s] : indptr[s + 1]], table[s, :pages])
        tokens_in_pages = (pages - 1) * block_size + last[s] if pages else 0
        assert tokens_in_pages == min(n, width * block_size)
        assert (1 <= last[s] <= block_size) if n else last[s] == 0
    assert (indices[indptr[-1] :] == -1).all()


def test_positions_past_the_table_row_get_the_null_slot():
    table = np.array([[7, 9]], np.int32)
    slots, *_ = reference.paged_metadata(
        table, np.array([10], np.int32), 4, np.array([0, 4], np.int32), 6
    )
    # positions 6..9: 6, 7 in block 9 (offsets 2, 3); 8, 9 past the 2-block row
    np.testing.assert_array_equal(slots, [38, 39, -1, -1, -1, -1])


def test_the_reference_sees_a_one_token_change():
    table = np.array([[1, 2], [3, 4]], np.int32)
    ptr = np.array([0, 2, 3], np.int32)
    a = reference.paged_metadata(table, np.array([5, 2], np.int32), 4, ptr, 3)
    b = reference.paged_metadata(table, np.array([5, 3], np.int32), 4, ptr, 3)
    assert not np.array_equal(a[0], b[0]) and not np.array_equal(a[3], b[3])


def test_the_kernel_wrapper_refuses_host_arrays():
    with pytest.raises(kvpool.InvalidArgumentError):
        kvpool.paged_metadata(
            np.zeros((1, 1), np.int32),
            np.zeros(1, np.int32),
            4,
            indptr=np.zeros(2, np.int32),
            indices=np.zeros(1, np.int32),
            last_page_len=np.zeros(1, np.int32),
        )


@given(st.lists(st.integers(1, 60), min_size=1, max_size=6))
def test_csr_equals_block_tables_csr(lens):
    """The reference's CSR of a table is what BlockTables.csr reports for the same requests."""
    _, tables = _tables(lens)
    ids = list(range(len(lens)))
    want = tables.csr(ids)
    _, indptr, indices, last = reference.paged_metadata(
        tables.block_table(ids), tables.seq_lens(ids), 4
    )
    np.testing.assert_array_equal(indptr, want[0])
    np.testing.assert_array_equal(indices[: indptr[-1]], want[1])
    np.testing.assert_array_equal(last, want[2])
