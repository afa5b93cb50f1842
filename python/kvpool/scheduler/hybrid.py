"""The hybrid KV backend: a model of several KV groups in one pool, through kvpool.HybridTables.

Each running sequence holds, per group of its model's `kvpool.ModelKvSpec`, the pages its
future queries read: every page of a full-attention or MLA group, the pages inside the
window of a sliding-window group and inside the current chunk of a chunked-local group
(the tables release the others as the sequence grows), and one state slot per state group
(design: rust/core/src/hybrid/hybrid.md). The loop (core.py) drives it as it drives
PagedKv; what differs is how many pages a call takes:

- a call takes all its new pages before it releases the ones its window left (the core's
  `append` is all-or-nothing: alloc, then free), so a shortfall counts the new pages
  against the free ones only;
- decoding one token takes a new page in each token group whose last page is full, the
  same for a window group (its window slides, the page it leaves is released after);
- admission asks room for the most pages the sequence holds during its prefill, prefilled
  in chunks of the step's token budget (a window group holds the window and two chunks
  while a chunk is appended, not the whole prompt), plus its state slots; as PagedKv asks
  room for its whole prefill.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

import kvpool
from kvpool.scheduler.core import SchedulerConfig
from kvpool.scheduler.seq import Seq


class HybridKv:
    """Each running sequence holds one table per group of the model, in one pool."""

    name = "hybrid"

    def __init__(self, pool: kvpool.Pool, spec: kvpool.ModelKvSpec) -> None:
        self.pool = pool
        self.spec = spec
        self.tables = kvpool.HybridTables(pool, spec)
        groups = range(spec.num_groups)
        # Token groups' tokens per page; state groups hold a fixed slot and take nothing
        # as a sequence grows.
        self.token_groups = [g for g in groups if spec.block_size(g) is not None]
        self.block_sizes = np.array([spec.block_size(g) for g in self.token_groups], np.int64)
        self.alloc_s = 0.0
        self.max_chunk = 1  # tokens one prefill call appends at most (validate sets it)

    def validate(self, config: SchedulerConfig) -> None:
        self.max_chunk = config.max_tokens_per_step
        needed = self.pages_for_prefill(config.max_model_len)
        if needed > self.pool.num_blocks:
            raise ValueError(
                f"the pool has {self.pool.num_blocks} pages, fewer than the {needed} one "
                f"sequence of max_model_len {config.max_model_len} holds at the end of its prefill"
            )

    def watermark_blocks(self, fraction: float) -> int:
        return int(fraction * self.pool.num_blocks)

    def pages_for_prefill(self, num_tokens: int) -> int:
        return prefill_peak_pages(self.spec, num_tokens, self.max_chunk)

    def try_admit(self, seq: Seq, first_chunk: int, watermark_blocks: int) -> bool:
        if self.pages_for_prefill(seq.prefill_target) + watermark_blocks > self.pool.num_free:
            return False
        t0 = time.perf_counter()
        self.tables.add(seq.request_id, first_chunk)
        self.alloc_s += time.perf_counter() - t0
        return True

    def _new_pages(self, seq: Seq, n: int) -> int:
        """Pages appending `n` tokens to `seq` takes: per token group, the live pages past
        the end of its table (no page is shared, so there is nothing to copy)."""
        rid, num_tokens = seq.request_id, seq.kv_tokens
        total = 0
        for g in self.token_groups:
            first_page, page_ids, _ = self.tables.table(rid, g)
            start, stop = self.spec.live_pages(g, num_tokens + n, num_tokens)
            total += max(0, stop - max(start, first_page + len(page_ids)))
        return total

    def prefill_shortfall(self, seq: Seq, n: int) -> int:
        return max(0, self._new_pages(seq, n) - self.pool.num_free)

    def extend(self, seq: Seq, n: int) -> None:
        t0 = time.perf_counter()
        self.tables.append_tokens(seq.request_id, n)
        self.alloc_s += time.perf_counter() - t0

    def decode_shortfall(self, seqs: Sequence[Seq]) -> int:
        # The next token (at position kv_tokens) opens a page where the last one is full.
        lens = np.fromiter((s.kv_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        need = int((lens[:, None] % self.block_sizes[None, :] == 0).sum())
        return max(0, need - self.pool.num_free)

    def decode(self, seqs: Sequence[Seq]) -> None:
        ids = np.fromiter((s.request_id for s in seqs), dtype=np.int64, count=len(seqs))
        t0 = time.perf_counter()
        self.tables.append_tokens_many(ids, 1)
        self.alloc_s += time.perf_counter() - t0

    def release(self, seq: Seq) -> None:
        t0 = time.perf_counter()
        self.tables.free(seq.request_id)
        self.alloc_s += time.perf_counter() - t0

    def usage(self) -> tuple[int, int]:
        """(pages used, pages used): token slots are not one number across groups whose
        pages hold different tokens, so the loop's token utilization is not defined here;
        the hybrid simulation measures bytes needed over bytes held instead."""
        used = self.pool.num_used
        return used, used

    def check_drained(self) -> None:
        """After a run: no request left, every page back on the free list, invariants hold."""
        if len(self.tables) != 0:
            raise AssertionError(f"hybrid tables still hold {len(self.tables)} requests")
        self.tables.check_invariants()
        if self.pool.num_free != self.pool.num_blocks:
            raise AssertionError(f"{self.pool.num_blocks - self.pool.num_free} pages leaked")
        self.pool.check_invariants()


def prefill_peak_pages(spec: kvpool.ModelKvSpec, num_tokens: int, chunk: int) -> int:
    """The most pages a sequence of `num_tokens` prompt tokens holds while its last prefill
    chunk (of at most `chunk` tokens) is appended, state slots included: an append takes
    its new pages before it releases those its window left, so a window group holds, for
    that moment, the pages of the chunk before too."""
    last_start = max(0, num_tokens - chunk)  # where the last chunk's queries start
    total = 0
    for g in range(spec.num_groups):
        _, stop = spec.live_pages(g, num_tokens, last_start)
        if last_start == 0:
            total += stop
            continue
        before, _ = spec.live_pages(g, last_start, max(0, last_start - chunk))
        total += stop - min(before, stop)
    return total
