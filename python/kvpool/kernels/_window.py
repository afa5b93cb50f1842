"""Sliding-window, chunked local attention and attention sinks: the argument checks the decode
and prefill plans share.

Conventions (the same in the kernels, `cuda/decode_common.cuh`'s key_start, and in
:func:`kvpool.reference.key_start`): the query at position p sees

- with ``window=w`` (transformers' ``sliding_window`` of gpt-oss, 128, and Gemma 3, 1024:
  ``kv_idx > q_idx - sliding_window``) the keys in (p - w, p], w keys with its own
  (FlashInfer's ``window_left`` is w - 1);
- with ``chunk=c`` (Llama 4's ``attention_chunk_size``, 8192) the keys in
  [floor(p / c) * c, p];
- with neither, every key up to p.

``first_page`` (int32 [num_seqs]) says which page of the sequence each table row starts with:
a window group's table (``HybridTables.table(id, group)`` returns ``(first_page, page_ids,
num_tokens)``) holds only the pages its window still needs, so its entry 0 is the sequence's
page ``first_page``; position p is then at entry ``p // block_size - first_page``. Left out,
every row starts at page 0 (a full table). The kernels read only the pages from the window's
first one on (whole pages before it are skipped without a load), and an entry outside the row
reads as a missing token (zero, masked), never past the row.

``sinks`` (float32 [num_q_heads], gpt-oss's per-head learned ``sinks`` of one layer, given per
run) are logits in the scaled domain of q.k * scale that join each head's softmax
denominator only: out = sum_j exp(l_j - m) v_j / (exp(s_h - m) + sum_j exp(l_j - m)).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.exceptions import InvalidArgumentError
from kvpool.kernels._args import ArrayView, check_int_array, check_ptr, index_arg
from kvpool.kernels._args import dev as _dev
from kvpool.kernels._args import view as _view
from kvpool.kernels._common import host_array

# Keys past the window start that the kernels may touch (the decode rounds the window's start
# down to its 16-token tile; those rows are masked without a load): sizes the split plans.
WINDOW_SLACK = 15


def check_window(window: Any, chunk: Any) -> tuple[int, int]:
    """(window, chunk) as kernel integers (0: none); at most one, each >= 1 and < 2^31."""
    w = 0 if window is None else index_arg(window, "window")
    c = 0 if chunk is None else index_arg(chunk, "chunk")
    for name, x, given in (("window", w, window), ("chunk", c, chunk)):
        if given is not None and not 1 <= x < 2**31:
            raise InvalidArgumentError(f"{name} must be in 1 .. 2^31 - 1 tokens, got {x}")
    if w and c:
        raise InvalidArgumentError(
            "a layer has a sliding window or a chunk, not both: give window or chunk"
        )
    return w, c


def key_extent(window: int, chunk: int) -> int | None:
    """The most keys one query sees (None: the whole sequence)."""
    return window or chunk or None


def bind_first_page(first_page: Any, num_seqs: int, cuda: bool, device_id: int) -> Any:
    """The plan's first_page: None, a checked host int64 copy (host pool), or the ArrayView
    of the caller's device int32 [num_seqs] array (read at every run)."""
    if first_page is None:
        return None
    if not cuda:
        if hasattr(first_page, "__cuda_array_interface__"):
            raise InvalidArgumentError("first_page is a device array but the pool is on the host")
        a = host_array(first_page, "first_page")
        if a.dtype.kind not in "iu" or a.shape != (num_seqs,):
            raise InvalidArgumentError(
                f"first_page must be an integer array of [{num_seqs}], got {a.dtype} {a.shape}"
            )
        if (a < 0).any():
            raise InvalidArgumentError("first_page holds a negative page index")
        return a.astype(np.int64)
    v = _view(first_page, "first_page")
    d = _dev(v, "first_page")
    check_int_array(d, "first_page", 4, 1)
    if d.shape[0] != num_seqs:
        raise InvalidArgumentError(f"first_page must have {num_seqs} entries, got {d.shape[0]}")
    if num_seqs:
        check_ptr(v.ptr, "first_page", device_id)
    return v


def device_sinks(sinks: Any, num_q_heads: int, device_id: int) -> tuple[int, ArrayView | None]:
    """The device pointer of a run's sinks (0 and None when not given), checked: a contiguous
    float32 [num_q_heads] array on the plan's device."""
    if sinks is None:
        return 0, None
    v = _view(sinks, "sinks")
    a = _dev(v, "sinks")
    if a.typestr[1:] != "f4" or a.shape != (num_q_heads,) or a.strides != (1,):
        raise InvalidArgumentError(
            f"sinks must be a contiguous float32 [{num_q_heads}] array (one logit per query "
            f"head), got {a.typestr} {a.shape}"
        )
    check_ptr(v.ptr, "sinks", device_id)
    return v.ptr, v


def host_sinks(sinks: Any, num_q_heads: int) -> np.ndarray | None:
    """A host run's sinks as float64 [num_q_heads] (float32 values, as the kernels take)."""
    if sinks is None:
        return None
    a = host_array(sinks, "sinks")
    if a.dtype != np.float32 or a.shape != (num_q_heads,):
        raise InvalidArgumentError(
            f"sinks must be a float32 [{num_q_heads}] array (one logit per query head), got "
            f"{a.dtype} {a.shape}"
        )
    return a.astype(np.float64)


def check_host_window_rows(
    tables: np.ndarray,
    lens: np.ndarray,
    first_page: np.ndarray | None,
    starts: np.ndarray,
    block_size: int,
    num_blocks: int,
) -> None:
    """Every page a host run reads (positions starts[i] .. lens[i] - 1 of each sequence) has
    an entry in its table row that holds a pool block."""
    for i, (lo, n) in enumerate(zip(starts, lens, strict=True)):
        if n <= lo:
            continue
        p0 = 0 if first_page is None else int(first_page[i])
        a, b = int(lo) // block_size - p0, (int(n) - 1) // block_size - p0
        if a < 0 or b >= tables.shape[1]:
            raise InvalidArgumentError(
                f"sequence {i} reads pages {a + p0}..{b + p0}; its table row holds pages "
                f"{p0}..{p0 + tables.shape[1] - 1}"
            )
        row = tables[i, a : b + 1]
        if ((row < 0) | (row >= num_blocks)).any():
            raise InvalidArgumentError(f"block table row {i} holds an id outside the pool")
