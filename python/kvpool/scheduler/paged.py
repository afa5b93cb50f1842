"""The paged KV backend: kvpool.Pool blocks handed out through kvpool.BlockTables."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import kvpool
from kvpool.scheduler.core import DecodeObserver, Scheduler, SchedulerConfig
from kvpool.scheduler.request import Request
from kvpool.scheduler.seq import Seq


class PagedKv:
    """Each running sequence owns a row of the block table; blocks come and go one at a time."""

    name = "paged"

    def __init__(self, pool: kvpool.Pool, max_seqs: int, max_model_len: int) -> None:
        self.pool = pool
        self.block_size = pool.layout.block_size
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.tables = kvpool.BlockTables(pool, max_seqs, self.max_blocks_per_seq)
        self.alloc_s = 0.0
        self.probe: DecodeObserver | None = None  # optional; run after each decode step

    def validate(self, config: SchedulerConfig) -> None:
        if self.max_seqs < config.max_running_seqs:
            raise ValueError(
                f"the block tables have {self.max_seqs} rows, fewer than max_running_seqs "
                f"{config.max_running_seqs}"
            )
        needed = -(-config.max_model_len // self.block_size)
        if self.max_blocks_per_seq < needed:
            raise ValueError(
                f"the block tables have {self.max_blocks_per_seq} blocks per row, fewer than the "
                f"{needed} blocks of {self.block_size} tokens one sequence of max_model_len "
                f"{config.max_model_len} needs"
            )
        if self.pool.num_blocks < needed:
            raise ValueError(
                f"the pool has {self.pool.num_blocks} blocks, fewer than the "
                f"{needed} one sequence of max_model_len {config.max_model_len} needs"
            )

    def watermark_blocks(self, fraction: float) -> int:
        return int(fraction * self.pool.num_blocks)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def try_admit(self, seq: Seq, first_chunk: int, watermark_blocks: int) -> bool:
        # Admission asks room for the whole prefill (as vLLM does), but allocates only the chunk.
        if self._blocks_for(seq.prefill_target) + watermark_blocks > self.pool.num_free:
            return False
        t0 = time.perf_counter()
        self.tables.add(seq.request_id, first_chunk)
        self.alloc_s += time.perf_counter() - t0
        return True

    def prefill_shortfall(self, seq: Seq, n: int) -> int:
        need = self._blocks_for(seq.kv_tokens + n) - self._blocks_for(seq.kv_tokens)
        return max(0, need - self.pool.num_free)

    def extend(self, seq: Seq, n: int) -> None:
        t0 = time.perf_counter()
        self.tables.append_tokens(seq.request_id, n)
        self.alloc_s += time.perf_counter() - t0

    def decode_shortfall(self, seqs: Sequence[Seq]) -> int:
        bs = self.block_size
        need = sum(1 for s in seqs if s.kv_tokens % bs == 0)
        return max(0, need - self.pool.num_free)

    def decode(self, seqs: Sequence[Seq]) -> None:
        ids = np.fromiter((s.request_id for s in seqs), dtype=np.int64, count=len(seqs))
        t0 = time.perf_counter()
        self.tables.append_tokens_many(ids, 1)
        self.alloc_s += time.perf_counter() - t0
        if self.probe is not None:
            self.probe(self.tables.block_table(ids), self.tables.seq_lens(ids))

    def release(self, seq: Seq) -> None:
        t0 = time.perf_counter()
        self.tables.free(seq.request_id)
        self.alloc_s += time.perf_counter() - t0

    def usage(self) -> tuple[int, int]:
        used = self.pool.num_used
        return used, used * self.block_size

    def check_drained(self) -> None:
        """After a run: no row left, every block back on the free list, invariants hold."""
        if len(self.tables) != 0:
            raise AssertionError(f"block tables still hold {len(self.tables)} requests")
        if self.pool.num_free != self.pool.num_blocks:
            raise AssertionError(f"{self.pool.num_blocks - self.pool.num_free} blocks leaked")
        self.pool.check_invariants()


def paged_scheduler(
    pool: kvpool.Pool,
    requests: Sequence[Request],
    config: SchedulerConfig = SchedulerConfig(),
    **kw: Any,
) -> Scheduler:
    return Scheduler(
        PagedKv(pool, config.max_running_seqs, config.max_model_len), requests, config, **kw
    )
