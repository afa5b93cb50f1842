"""A reference adapter: vLLM's ``KVCacheManager`` call shapes over a metadata-only kvpool.

vLLM's scheduler (``vllm/v1/core/sched/scheduler.py``) drives its KV cache manager
(``vllm/v1/core/kv_cache_manager.py``, read at vllm-project/vllm commit
003df2961dd8830c317a61f9745ccd557da9fa06) with a handful of calls per step:

- admission: ``get_computed_blocks(request) -> (KVCacheBlocks, num_computed_tokens,
  shared_prefix_boundary)``, then ``allocate_slots(request, num_new_tokens,
  num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens, ...)``, which
  returns the newly allocated ``KVCacheBlocks`` or ``None`` when the blocks do not fit;
- each running step (chunked prefill, decode): ``allocate_slots(request, num_new_tokens)``;
  on ``None`` the scheduler preempts a request with ``free(request)`` and retries;
- ``cache_blocks(request, num_computed_tokens)`` where computed blocks become reusable,
  ``free(request)`` on finish or preemption, ``get_block_ids(request_id)`` for the worker's
  block table, ``usage`` for metrics, ``reset_prefix_cache()``, ``take_events()``.

:class:`KvPoolKVCacheManager` answers those calls from one kvpool ``BlockTables`` over a
pool made with ``device="none"`` (ids, tables, prefix cache and events; the KV itself is
vLLM's tensors). What differs, by design:

- ``get_computed_blocks`` is ``Pool.lookup_prefix``: a pure query. The hit blocks are
  referenced by the ``allocate_slots`` that admits the request (``BlockTables.add_request``
  finds the same hits: nothing runs in between in vLLM's single-threaded scheduler), so
  the ``KVCacheBlocks`` it returns is empty and ``num_computed_tokens`` carries the answer.
- Blocks are cached as they fill (kvpool hashes token ids when they are appended), so
  ``cache_blocks`` has nothing left to do.
- One KV cache group (a uniform model); lookahead slots and external (connector) tokens
  are not modelled (``num_lookahead_tokens`` and ``num_external_computed_tokens`` must be 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import kvpool

__all__ = ["KVCacheBlocks", "KvPoolKVCacheManager", "RequestLike"]


class RequestLike(Protocol):
    """The fields of vLLM's ``Request`` the adapter reads."""

    request_id: str
    all_token_ids: Sequence[int]
    num_computed_tokens: int
    cache_salt: str | None


@dataclass(frozen=True)
class KVCacheBlocks:
    """vLLM's ``KVCacheBlocks`` reduced to ids: ``blocks[g]`` is group g's block ids."""

    blocks: tuple[list[int], ...] = field(default_factory=lambda: ([],))

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(list(group) for group in self.blocks)


class KvPoolKVCacheManager:
    """vLLM's KV cache manager interface over a metadata-only kvpool pool."""

    def __init__(
        self,
        layout: kvpool.KvLayout,
        num_blocks: int,
        max_num_seqs: int,
        max_model_len: int,
        *,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        prefix_hash_key: bytes | None = None,
    ) -> None:
        self.block_size = layout.block_size
        self.pool = kvpool.Pool(
            layout,
            num_blocks,
            device="none",
            enable_prefix_caching=enable_caching,
            prefix_hash_key=prefix_hash_key,
        )
        max_blocks = -(-max_model_len // self.block_size)
        self.tables = kvpool.BlockTables(self.pool, max_num_seqs, max_blocks)
        if enable_kv_cache_events:
            self.pool.enable_kv_cache_events()
        self._ids: dict[str, int] = {}
        self._next_id = 0

    @property
    def usage(self) -> float:
        """Blocks referenced by requests over all blocks (evictable cache counts as free)."""
        return self.pool.num_used / self.pool.num_blocks

    def get_computed_blocks(self, request: RequestLike) -> tuple[KVCacheBlocks, int, int]:
        """(no blocks, tokens cached for this prompt, 0): see the module docstring."""
        tokens = list(request.all_token_ids)
        hit = self.pool.lookup_prefix(tokens, cache_salt=request.cache_salt)
        return KVCacheBlocks(), hit, 0

    def allocate_slots(
        self,
        request: RequestLike,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        **_ignored: Any,
    ) -> KVCacheBlocks | None:
        """Slots for tokens up to ``num_computed_tokens + num_new_computed_tokens +
        num_new_tokens``; the new blocks, or None (changing nothing) when they do not fit."""
        if num_lookahead_tokens or num_external_computed_tokens:
            raise NotImplementedError("lookahead and connector tokens are not modelled")
        rid = self._ids.get(request.request_id)
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        tokens = list(request.all_token_ids)
        try:
            if rid is None:
                rid = self._next_id
                self.tables.add_request(rid, tokens[:end], cache_salt=request.cache_salt)
                self._next_id += 1
                self._ids[request.request_id] = rid
                return KVCacheBlocks((self.tables.blocks(rid).tolist(),))
            before = len(self.tables.blocks(rid))
            have = self.tables.num_tokens(rid)
            if end > have:
                known = tokens[have:end] if end <= len(tokens) else None
                self.tables.append_tokens(rid, end - have, known)
            return KVCacheBlocks((self.tables.blocks(rid)[before:].tolist(),))
        except kvpool.OutOfBlocksError:
            return None

    def cache_blocks(self, request: RequestLike, num_computed_tokens: int) -> None:
        """Nothing to do: kvpool caches each block as its tokens are appended."""

    def free(self, request: RequestLike) -> None:
        """Drops the request's blocks (finished or preempted); cached ones stay reusable."""
        rid = self._ids.pop(request.request_id, None)
        if rid is not None:
            self.tables.free(rid)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return (self.tables.blocks(self._ids[request_id]).tolist(),)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Not tracked: 0 for the one group (vLLM uses it only for cascade attention)."""
        return [0]

    def reset_prefix_cache(self) -> bool:
        try:
            self.pool.reset_prefix_cache()
        except kvpool.CacheInUseError:
            return False
        return True

    def take_events(
        self,
    ) -> list[kvpool.BlockStored | kvpool.BlockRemoved | kvpool.AllBlocksCleared]:
        return self.pool.take_kv_events()
