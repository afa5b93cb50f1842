"""The paged KV backend with prefix caching: requests join through `BlockTables.add_request`.

The pool is made with `enable_prefix_caching=True`. Admission adds the request with the token
ids of everything it has to prefill (its prompt, plus the tokens it had generated when it
was preempted): the cache answers how many leading tokens are cached (a multiple of
block_size, never the last token) and allocates the rest of the prompt's blocks at once.
The loop (core.py) starts the prefill after the cached tokens, so they cost no prefill
compute; decode steps append each new token with its id, so the blocks an answer fills are
cached too. A finished or preempted request's cached blocks stay in the pool as evictable
until an allocation needs them.

Admission and the watermark: how many blocks a request needs is known only after the cache
was asked (its hits on blocks other requests hold cost nothing), and asking caches the
prompt's new blocks, so it cannot be undone. Admission therefore counts no hit as room: a
request is added when all its prompt's blocks fit in the free and evictable blocks beyond
the watermark, as without caching (a hit on an evictable block takes that block out of the
evictable set, so the add cannot then fail). This is conservative: a request that would fit
only thanks to hits on blocks other requests hold waits until the blocks are there without
them, which understates caching's gain in concurrency by at most one request's shared
blocks. (Admitting whenever the add succeeds would ignore the watermark exactly when the
pool is nearly full: on the multi-turn workload of the `prefix_sim` benchmark routine that preempted
7x as often as caching off.)

A request's blocks are cached as soon as it is added, as vLLM caches them when it schedules
them: a later request that hits blocks of a prompt still in chunked prefill reads KV that the
same or an earlier step writes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

import kvpool
from kvpool.scheduler.paged import PagedKv
from kvpool.scheduler.seq import Seq


class PrefixCachedKv(PagedKv):
    """PagedKv over a pool with prefix caching; hits skip prefill, freed blocks stay cached."""

    name = "paged_prefix_caching"

    def __init__(self, pool: kvpool.Pool, max_seqs: int, max_model_len: int) -> None:
        if not pool.prefix_caching:
            raise ValueError("PrefixCachedKv needs a pool made with enable_prefix_caching=True")
        super().__init__(pool, max_seqs, max_model_len)
        self._ids: dict[int, np.ndarray] = {}  # running request -> its prompt + output ids
        self.stats_at_end: dict[str, int | float] = {}  # the cache's stats before the final reset

    def _token_ids(self, seq: Seq) -> np.ndarray:
        r = seq.request
        num_tokens = r.prompt_tokens + r.output_tokens
        if r.tokens is None:
            return _private_ids(r.request_id, num_tokens)
        return r.tokens.ids(num_tokens)

    def _allocatable(self) -> int:
        return self.pool.num_free + self.pool.num_evictable

    def try_admit(self, seq: Seq, first_chunk: int, watermark_blocks: int) -> bool:
        if self._blocks_for(seq.prefill_target) + watermark_blocks > self._allocatable():
            return False
        ids = self._token_ids(seq)
        t0 = time.perf_counter()
        result = self.tables.add_request(seq.request_id, ids[: seq.prefill_target])
        self.alloc_s += time.perf_counter() - t0
        self._ids[seq.request_id] = ids
        seq.num_cached_tokens = result.num_cached_tokens
        return True

    def prefill_shortfall(self, seq: Seq, n: int) -> int:
        # add_request allocated the whole prompt: later chunks only compute.
        return 0

    def extend(self, seq: Seq, n: int) -> None:
        if seq.kv_tokens + n > self.tables.num_tokens(seq.request_id):
            raise AssertionError(
                f"request {seq.request_id}: prefill past the tokens added at admission"
            )

    def decode_shortfall(self, seqs: Sequence[Seq]) -> int:
        bs = self.block_size
        need = sum(1 for s in seqs if s.kv_tokens % bs == 0)
        return max(0, need - self._allocatable())

    def decode(self, seqs: Sequence[Seq]) -> None:
        rids = np.fromiter((s.request_id for s in seqs), dtype=np.int64, count=len(seqs))
        new_ids = np.fromiter(
            (self._ids[s.request_id][s.kv_tokens] for s in seqs), dtype=np.int64, count=len(seqs)
        )
        t0 = time.perf_counter()
        self.tables.append_tokens_many(rids, 1, new_ids)
        self.alloc_s += time.perf_counter() - t0
        if self.probe is not None:
            self.probe(self.tables.block_table(rids), self.tables.seq_lens(rids))

    def release(self, seq: Seq) -> None:
        super().release(seq)
        del self._ids[seq.request_id]

    def check_drained(self) -> None:
        """After a run: no row left, every block free or evictable; a reset of the cache then
        returns every block to the free list, and the invariants hold throughout."""
        if len(self.tables) != 0 or self._ids:
            raise AssertionError(f"block tables still hold {len(self.tables)} requests")
        self.pool.check_invariants()
        if self.pool.num_used != 0 or self._allocatable() != self.pool.num_blocks:
            raise AssertionError(f"{self.pool.num_used} blocks still in use after the run")
        self.stats_at_end = self.pool.prefix_cache_stats()
        self.pool.reset_prefix_cache()
        if self.pool.num_free != self.pool.num_blocks:
            raise AssertionError(f"{self.pool.num_blocks - self.pool.num_free} blocks leaked")
        self.pool.check_invariants()


def _private_ids(request_id: int, num_tokens: int) -> np.ndarray:
    """Ids for a request that brings none: drawn from a generator seeded by its id, so they
    are the same on every admission (a preempted request finds its own blocks again) and
    share nothing with another request (two 16-token blocks coincide with probability
    32000**-16). They equal kvpool.sim.tokens.private_stream(0, request_id, n)."""
    rng = np.random.default_rng([0, 0, request_id])
    return rng.integers(0, 32_000, num_tokens, dtype=np.int64)
