"""The pool side of a prefix cache, as plain Python, for the state machines that check it
(`test_prefix_cache_state.py`, and `test_prefix_host_tier_state.py` which adds the host tier).

Reference counts, the cache (content key -> block), evictable blocks in LRU order (least
recently used first) and free blocks. A request type supplies `blocks` and `key(j)`: what
block j's hash stands for.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Protocol

from hypothesis import event

Key = tuple[object, ...]


class CachedRequest(Protocol):
    blocks: list[int]

    def key(self, j: int) -> Key: ...


class PoolModel:
    def __init__(self, num_blocks: int) -> None:
        self.ref_cnt: Counter[int] = Counter()
        self.cache: dict[Key, int] = {}
        self.key_of: dict[int, Key] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.free: set[int] = set(range(num_blocks))
        self.queries = self.hits = self.evictions = self.stored = 0

    def available(self, exclude: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        return len(self.free) + sum(1 for b in self.lru if b not in exclude)

    def take(self, got: list[int], exclude: set[int] = frozenset()) -> list[Key]:  # type: ignore[assignment]
        """The pool handed out `got` as fresh blocks, from the free list first, then evicting
        LRU blocks not in `exclude`: check them, record them, and return the evicted keys
        (least recently used first)."""
        assert len(set(got)) == len(got), f"one block handed out twice: {got}"
        evicted: list[Key] = []
        if len(got) <= len(self.free):
            assert set(got) <= self.free, f"{got} are not all free"
            event("alloc: from the free list")
        else:
            evict = [b for b in self.lru if b not in exclude][: len(got) - len(self.free)]
            assert set(got) == self.free | set(evict), (
                f"expected the free {self.free} and LRU {evict}, got {got}"
            )
            event("alloc: evicted")
            for b in evict:
                del self.lru[b]
                key = self.key_of.pop(b)
                del self.cache[key]
                evicted.append(key)
                self.evictions += 1
        for b in got:
            self.free.discard(b)
            assert self.ref_cnt[b] == 0
            self.ref_cnt[b] = 1
        return evicted

    def drop(self, b: int) -> None:
        """One reference to `b` dropped: at 0 it becomes evictable if cached, else free."""
        self.ref_cnt[b] -= 1
        assert self.ref_cnt[b] >= 0
        if self.ref_cnt[b] == 0:
            del self.ref_cnt[b]
            if b in self.key_of:
                self.lru[b] = None
            else:
                self.free.add(b)

    def store(self, req: CachedRequest, j: int) -> None:
        """Block j of `req` is full: cached under its key unless that key already is."""
        key = req.key(j)
        if key not in self.cache:
            self.cache[key] = req.blocks[j]
            self.key_of[req.blocks[j]] = key
            self.stored += 1
