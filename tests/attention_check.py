"""One check for every attention kernel test: the output against the float64 reference, per row.

A row is one (sequence, query head) for decode, one (token, query head) for prefill: every
leading index of an output ``[..., head_dim]``. Each row's relative L2 error must stay under
the dtype's bound, so one wrong row fails even in a large batch (a norm over the whole batch
would average it away). The bounds sit above the errors measured on an H200 (worst whole-batch
relative error over the decode suite in bench/results/2026-11-30_bee02ac_h200/decode_errors.json:
float16 2.8e-4, bfloat16 2.3e-3, both at one sequence of 20000 tokens; rounding the float64
reference to bfloat16 alone costs about 2e-3 per row) and below what a one-token bug costs at the
lengths the suites use (tests/test_attention_check.py proves the check fails on such bugs).

The mutation helpers build those bugs on the reference side: a reference that leaves out one
token of one sequence, and a block table with one block swapped for a wrong one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from kvpool import reference

# Largest allowed relative L2 error of one output row, per KV/output dtype.
TOLERANCE = {"float16": 1e-3, "bfloat16": 5e-3}


def as_float64(out: Any, dtype: str) -> np.ndarray:
    """A kernel output (NumPy, or anything with .get() like CuPy) as float64: float16 data, or
    bfloat16 as 2-byte bit patterns; float64 arrays (a reference) pass unchanged."""
    host = out.get() if hasattr(out, "get") and not isinstance(out, np.ndarray) else out
    host = np.asarray(host)
    if host.dtype == np.float64:
        return host
    if host.itemsize != 2:
        raise TypeError(f"expected 2-byte elements of {dtype}, got {host.dtype}")
    return reference.to_float64(host.view(np.float16 if dtype == "float16" else np.uint16), dtype)


def row_errors(got: Any, want: np.ndarray, dtype: str) -> np.ndarray:
    """Relative L2 error of every row (all leading indices), shape ``want.shape[:-1]``; a row
    with a NaN or infinity in the output counts as infinitely wrong."""
    got64 = as_float64(got, dtype)
    want = np.asarray(want, dtype=np.float64)
    if got64.shape != want.shape:
        raise AssertionError(f"output shape {got64.shape} != reference shape {want.shape}")
    diff = np.linalg.norm(got64 - want, axis=-1)
    norm = np.maximum(np.linalg.norm(want, axis=-1), np.finfo(np.float64).tiny)
    err = diff / norm
    err[~np.isfinite(got64).all(axis=-1)] = np.inf
    return err


def assert_attention_close(got: Any, want: np.ndarray, dtype: str, what: str) -> float:
    """Fail unless every row of `got` is within TOLERANCE[dtype] of the float64 `want`
    (relative L2 per row, see row_errors); returns the largest row error, for reports."""
    bound = TOLERANCE[dtype]
    err = row_errors(got, want, dtype)
    if err.size == 0:
        return 0.0
    worst = np.unravel_index(int(np.argmax(err)), err.shape)
    max_err = float(err[worst])
    bad = int((err > bound).sum())
    if bad:
        non_finite = int(np.isinf(err).sum())
        raise AssertionError(
            f"{what}: {bad} of {err.size} rows exceed the {dtype} bound {bound:g} "
            f"(worst row {tuple(int(i) for i in worst)}: relative error {max_err:.3g}; "
            f"{non_finite} rows unwritten or not finite)"
        )
    return max_err


# --- mutations: what a one-token or one-block bug looks like on the reference side -----------


def without_token(k: np.ndarray, v: np.ndarray, token: int) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous K and V ([L, kv_heads, head_dim]) with row `token` left out."""
    return np.delete(k, token, axis=0), np.delete(v, token, axis=0)


def decode_reference_without_token(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    dtype: str,
    seq: int,
    token: int,
    scale: float | None = None,
) -> np.ndarray:
    """reference.paged_attention_decode, except that sequence `seq` does not see `token`."""
    want = reference.paged_attention_decode(
        q, k_cache, v_cache, block_tables, seq_lens, dtype, scale
    )
    q64 = reference.to_float64(q, dtype)
    if scale is None:
        scale = 1.0 / np.sqrt(q64.shape[-1])
    n = int(seq_lens[seq])
    k = reference.to_float64(reference.gather_kv(k_cache, block_tables[seq], n), dtype)
    v = reference.to_float64(reference.gather_kv(v_cache, block_tables[seq], n), dtype)
    want[seq] = reference.attention_decode(q64[seq], *without_token(k, v, token), scale)
    return want


def table_with_wrong_block(
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    num_blocks: int,
    seq: int,
    index: int,
) -> np.ndarray:
    """A copy of the tables in which sequence `seq`'s `index`-th block is replaced by a block
    that sequence does not use (the next such id after it)."""
    used = -(-int(seq_lens[seq]) // block_size)
    if not 0 <= index < used:
        raise ValueError(f"sequence {seq} uses blocks 0..{used - 1}, not {index}")
    own = {int(b) for b in block_tables[seq, :used]}
    if len(own) == num_blocks:
        raise ValueError("the sequence uses every block: no wrong one to swap in")
    wrong = int(block_tables[seq, index])
    while wrong in own:
        wrong = (wrong + 1) % num_blocks
    tables = np.array(block_tables, copy=True)
    tables[seq, index] = wrong
    return tables
