"""The attention checker can pass and can fail: it accepts the float64 reference rounded to the
output dtype, and rejects a reference that drops one token or reads one wrong block (CPU only,
so CI proves the GPU suites' check has teeth)."""

from __future__ import annotations

import numpy as np
import pytest
from attention_check import (
    TOLERANCE,
    as_float64,
    assert_attention_close,
    decode_reference_without_token,
    row_errors,
    table_with_wrong_block,
)
from kvpool import reference

DTYPES = ["float16", "bfloat16"]
BLOCK_SIZE = 16
SEQ_LENS = [1, 15, 16, 17, 40, 100, 257]  # one token, block ends, mid-block ends, longer
HQ, HKV, D = 8, 2, 64


def _case(dtype: str, seed: int = 0):
    """Random q and a paged cache (N(0,1) elements of `dtype`), shuffled tables, the reference."""
    rng = np.random.default_rng(seed)
    lens = np.array(SEQ_LENS, dtype=np.int32)
    need = -(-lens // BLOCK_SIZE)
    num_blocks = int(need.sum()) + 8
    ids = rng.permutation(num_blocks)
    tables = np.full((len(lens), int(need.max()) + 2), -1, dtype=np.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[at : at + n]
        at += n

    def elems(shape):
        return reference.from_float64(rng.standard_normal(shape), dtype)

    q = elems((len(lens), HQ, D))
    k = elems((num_blocks, BLOCK_SIZE, HKV, D))
    v = elems((num_blocks, BLOCK_SIZE, HKV, D))
    want = reference.paged_attention_decode(q, k, v, tables, lens, dtype)
    return q, k, v, tables, lens, num_blocks, want


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_rounded_to_the_dtype_passes(dtype):
    *_, want = _case(dtype)
    rounded = reference.from_float64(want, dtype)
    worst = assert_attention_close(rounded, want, dtype, "rounded reference")
    assert 0 < worst < TOLERANCE[dtype] / 2  # the bound leaves the kernel room beyond rounding


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_dropped_token_fails(dtype):
    q, k, v, tables, lens, _, want = _case(dtype)
    rounded = reference.from_float64(want, dtype)
    for seq, n in enumerate(lens):
        if n < 2:
            continue  # dropping the only token leaves nothing to attend to
        # first token, last token, each side of the first block boundary, one in the middle
        for token in sorted(
            {0, BLOCK_SIZE - 1, BLOCK_SIZE, int(n) // 2, int(n) - 1} & set(range(n))
        ):
            wrong = decode_reference_without_token(q, k, v, tables, lens, dtype, seq, token)
            wrong_rounded = reference.from_float64(wrong, dtype)
            with pytest.raises(AssertionError, match=rf"worst row \({seq}, "):
                assert_attention_close(wrong_rounded, want, dtype, f"drop {seq}/{token}")
            # and the other way round: a correct kernel checked against a buggy reference
            with pytest.raises(AssertionError):
                assert_attention_close(rounded, wrong, dtype, f"drop {seq}/{token}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_wrong_block_fails(dtype):
    q, k, v, tables, lens, num_blocks, want = _case(dtype)
    for seq, n in enumerate(lens):
        for index in range(-(-int(n) // BLOCK_SIZE)):
            bad = table_with_wrong_block(tables, lens, BLOCK_SIZE, num_blocks, seq, index)
            got = reference.from_float64(
                reference.paged_attention_decode(q, k, v, bad, lens, dtype), dtype
            )
            with pytest.raises(AssertionError, match=r"1 of \d+ rows|\d+ of \d+ rows"):
                assert_attention_close(got, want, dtype, f"wrong block {seq}/{index}")
            errs = row_errors(got, want, dtype)
            assert (errs[seq] > TOLERANCE[dtype]).all()  # every head of that sequence
            assert (np.delete(errs, seq, axis=0) <= TOLERANCE[dtype]).all()  # only that one


def test_a_whole_batch_norm_would_miss_what_the_row_check_catches():
    dtype = "float16"
    q, k, v, tables, lens, _, want = _case(dtype)
    seq = len(lens) - 1  # the longest sequence: one token weighs least there
    wrong = reference.from_float64(
        decode_reference_without_token(q, k, v, tables, lens, dtype, seq, int(lens[seq]) // 2),
        dtype,
    )
    batch_err = np.linalg.norm(as_float64(wrong, dtype) - want) / np.linalg.norm(want)
    assert batch_err < 1e-2  # what the suite's former whole-batch check accepted
    with pytest.raises(AssertionError):
        assert_attention_close(wrong, want, dtype, "dropped token")


@pytest.mark.parametrize("dtype", DTYPES)
def test_unwritten_rows_fail(dtype):
    *_, want = _case(dtype)
    got = reference.from_float64(want, dtype)
    nan_bits = {"float16": 0x7E00, "bfloat16": 0x7FC0}[dtype]
    got.view(np.uint16)[3, 5, 7] = nan_bits
    with pytest.raises(
        AssertionError, match=r"1 of 56 rows .*worst row \(3, 5\).*1 rows unwritten"
    ):
        assert_attention_close(got, want, dtype, "poisoned")


def test_shape_mismatch_and_empty_outputs():
    *_, want = _case("float16")
    with pytest.raises(AssertionError, match="shape"):
        assert_attention_close(reference.from_float64(want[:2], "float16"), want, "float16", "x")
    empty = np.zeros((0, HQ, D))
    assert assert_attention_close(empty.astype(np.float16), empty, "float16", "empty") == 0.0


def test_wrong_block_helper_refuses_blocks_the_sequence_does_not_use():
    _, _, _, tables, lens, num_blocks, _ = _case("float16")
    with pytest.raises(ValueError, match="uses blocks"):
        table_with_wrong_block(tables, lens, BLOCK_SIZE, num_blocks, 0, 1)
