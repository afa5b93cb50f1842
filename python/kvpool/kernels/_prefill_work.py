"""Host-side work planning for paged prefill attention.

The prefill kernel's grid is (work item, KV head x query-head tile, KV split). A work item is one
query tile of one sequence: (sequence, first query token of the tile), int32 pairs uploaded once
per plan, so the launch is a plain 1-D list that a CUDA graph can replay. Items are ordered by
decreasing work (keys seen), so the longest tiles start first and the short ones fill the tail.

When the items x heads do not fill one wave of the GPU (few queries over long contexts: a
speculative verification, a short chunk on a long cached prefix), every tile's key range is
also cut into `num_splits` runs of whole KV tiles, merged afterwards by log-sum-exp. The work
depends only on host numbers (qo_indptr, seq_lens, head counts), never on the data;
:class:`kvpool.kernels.PrefillPlan` holds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool import reference
from kvpool.exceptions import InvalidArgumentError

MIN_SPLIT_TILES = 4  # KV tiles per split at least: shorter runs cost more in the merge
# Automatic KV splits of one prefill launch at most: past this the merge's traffic outweighs
# the fill it buys (a forced num_splits may go up to the key tiles of the longest tile).
MAX_PREFILL_AUTO_SPLITS = 32


@dataclass(eq=False)
class PrefillWork:
    """The work of one prefill launch: `work` int32 [num_items, 2] (sequence, first query
    token), the KV split count and the tile shape it was made for."""

    work: np.ndarray
    num_splits: int
    num_seqs: int
    total_q: int
    max_seq_len: int
    num_q_heads: int
    num_kv_heads: int
    head_tile: int
    q_tile_tokens: int
    rows_per_cta: int
    kv_tile: int
    causal: bool

    @property
    def num_items(self) -> int:
        return int(self.work.shape[0])

    @property
    def split(self) -> bool:
        return self.num_splits > 1


def host_lengths(qo_indptr: Any, seq_lens: Any) -> tuple[np.ndarray, np.ndarray]:
    """Checked int64 copies of qo_indptr [num_seqs + 1] and seq_lens [num_seqs]: indptr starts
    at 0 and never decreases, and every sequence holds at least its query tokens."""
    indptr = np.asarray(qo_indptr)
    lens = np.asarray(seq_lens)
    for name, a in (("qo_indptr", indptr), ("seq_lens", lens)):
        if a.dtype.kind not in "iu" or a.ndim != 1:
            raise InvalidArgumentError(
                f"{name} must be a 1-d integer array, got {a.dtype} {a.shape}"
            )
    if indptr.shape[0] != lens.shape[0] + 1:
        raise InvalidArgumentError(
            f"qo_indptr has {indptr.shape[0]} entries; seq_lens has {lens.shape[0]} (needs one more)"
        )
    indptr = indptr.astype(np.int64)
    lens = lens.astype(np.int64)
    qo_lens = np.diff(indptr)
    if indptr[0] != 0 or (qo_lens < 0).any():
        raise InvalidArgumentError("qo_indptr must start at 0 and never decrease")
    if (lens < qo_lens).any():
        i = int(np.argmax(lens < qo_lens))
        raise InvalidArgumentError(
            f"sequence {i} has {int(qo_lens[i])} query tokens but seq_len {int(lens[i])}: the "
            "queries must already be in the cache (append_kv first)"
        )
    return indptr, lens


def head_tile(group: int, rows: int) -> int:
    """Query heads of one GQA group per CTA of `rows` rows: the whole group when it fits, else
    its largest divisor that does."""
    return max(d for d in range(1, min(group, rows) + 1) if group % d == 0)


def padded_rows(qo_lens: np.ndarray, group: int, rows: int) -> int:
    """Rows (valid and padding) that tiles of `rows` rows spend on these query lengths."""
    gh = head_tile(group, rows)
    tiles = -(-np.asarray(qo_lens, dtype=np.int64) // (rows // gh))
    return int(tiles.sum()) * (group // gh) * rows


def choose_rows(qo_indptr: Any, group: int, wide: int, narrow: int) -> int:
    """`narrow` rows per CTA when wide tiles would spend at least twice the rows (mostly
    padding: a few query tokens per sequence, as in decode or speculative verification)."""
    qo_lens = np.diff(np.asarray(qo_indptr, dtype=np.int64))
    spent_wide = padded_rows(qo_lens, group, wide)
    if spent_wide and 2 * padded_rows(qo_lens, group, narrow) <= spent_wide:
        return narrow
    return wide


def plan_work(
    qo_indptr: Any,
    seq_lens: Any,
    num_q_heads: int,
    num_kv_heads: int,
    head_tile: int,
    rows_per_cta: int,
    kv_tile: int,
    num_sms: int,
    ctas_per_sm: int,
    *,
    causal: bool = True,
    num_splits: int | None = None,
    window: int = 0,
    chunk: int = 0,
) -> PrefillWork:
    """The work items and split count for host copies of qo_indptr and seq_lens. With a
    sliding `window` or a `chunk` (0: none; causal only) a tile's keys start at its first
    query's window start rounded down to a KV tile, as the kernel reads them."""
    indptr, lens = host_lengths(qo_indptr, seq_lens)
    qo_lens = np.diff(indptr)
    q_tile = rows_per_cta // head_tile
    tiles_per_seq = -(-qo_lens // q_tile)
    seq = np.repeat(np.arange(len(lens), dtype=np.int64), tiles_per_seq)
    first = np.arange(int(tiles_per_seq.sum()), dtype=np.int64)
    first -= np.repeat(np.cumsum(tiles_per_seq) - tiles_per_seq, tiles_per_seq)
    qt0 = first * q_tile
    if causal:  # keys the tile's last query sees
        keys = lens[seq] - qo_lens[seq] + np.minimum(qt0 + q_tile, qo_lens[seq])
        if window or chunk:  # ... less those before the first query's window (whole tiles)
            lo = reference.key_start(lens[seq] - qo_lens[seq] + qt0, window or None, chunk or None)
            keys = keys - lo // kv_tile * kv_tile
    else:
        keys = lens[seq]
    order = np.argsort(-keys, kind="stable")
    work = np.stack([seq[order], qt0[order]], axis=1).astype(np.int32)
    heads = num_kv_heads * (num_q_heads // num_kv_heads // head_tile)
    max_tiles = int(-(-keys.max() // kv_tile)) if len(keys) else 0
    if num_splits is None:
        ctas = max(len(work) * heads, 1)
        num_splits = round(num_sms * ctas_per_sm / ctas)
        num_splits = min(num_splits, max_tiles // MIN_SPLIT_TILES, MAX_PREFILL_AUTO_SPLITS)
    num_splits = max(1, min(int(num_splits), max(max_tiles, 1)))
    return PrefillWork(
        work=np.ascontiguousarray(work),
        num_splits=num_splits,
        num_seqs=len(lens),
        total_q=int(indptr[-1]),
        max_seq_len=int(lens.max()) if len(lens) else 0,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_tile=head_tile,
        q_tile_tokens=q_tile,
        rows_per_cta=rows_per_cta,
        kv_tile=kv_tile,
        causal=bool(causal),
    )
