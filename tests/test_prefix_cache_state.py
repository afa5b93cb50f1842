"""Prefix caching against a plain-Python model of the whole cache, driven by Hypothesis.

The model keeps, per block, its ref count and the content key it is cached under (the
request's salt, LoRA id and every token up to the block's end: what the hash chain stands
for); the evictable blocks in LRU order; the free set; and the stats counters. The pool picks
block ids, so the model predicts which ids are possible (any free id while the free list
suffices; otherwise every free id plus exactly the least recently used evictable blocks) and
checks the ids the tables report against that. Hits are predicted exactly: the block ids
of a hit are the model's cached blocks. Settings come from the profile tests/conftest.py loads.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kvpool import (
    BlockTables,
    CacheInUseError,
    CapacityError,
    DuplicateRequestError,
    KvLayout,
    OutOfBlocksError,
    Pool,
)
from prefix_model import PoolModel

BS = 4
NUM_BLOCKS = 20
MAX_SEQS = 6
MAX_BLOCKS = 8
LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=BS)

# Three documents with a common head, so prompts share prefixes of many lengths.
DOCS = [[1, 2, 3, 4, 5, 6, 7, 8] + [10 * d + i for i in range(24)] for d in range(3)]
SALTS = st.sampled_from([None, "tenant-a", b"tenant-a", "tenant-b"])
LORAS = st.sampled_from([None, 7])
REQUEST_IDS = st.integers(0, 9)
# The order in which a freed request's blocks become evictable: tail first. The mutation
# test flips it to prove the machine notices a wrong eviction order.
RELEASE_ORDER = reversed


@st.composite
def prompts(draw: st.DrawFn) -> list[int]:
    doc = draw(st.sampled_from(DOCS))
    head = doc[: draw(st.integers(0, len(doc)))]
    tail = draw(st.lists(st.integers(0, 3), max_size=5))
    return head + tail


def blocks_for(n: int) -> int:
    return -(-n // BS)


def salt_bytes(salt: str | bytes | None) -> bytes | None:
    return salt.encode() if isinstance(salt, str) else salt


@dataclass
class Req:
    blocks: list[int]
    num_tokens: int
    tokens: list[int] | None  # None once tokens of unknown content were appended
    salt: bytes | None
    lora: int | None

    def key(self, j: int) -> tuple[object, ...]:
        """What block j's hash stands for."""
        assert self.tokens is not None
        return (self.salt, self.lora, tuple(self.tokens[: (j + 1) * BS]))


class Model(PoolModel):
    def __init__(self) -> None:
        super().__init__(NUM_BLOCKS)
        self.requests: dict[int, Req] = {}


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool(LAYOUT, NUM_BLOCKS, device="host", enable_prefix_caching=True)
        self.pool.enable_kv_cache_events()
        self.tables = BlockTables(self.pool, MAX_SEQS, MAX_BLOCKS)
        self.model = Model()
        self.held: list[int] = []  # blocks taken straight from the pool
        self.live: set[bytes] = set()  # cached hashes, as the KV events tell them

    def existing(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.model.requests)))

    @rule(rid=REQUEST_IDS, tokens=prompts(), salt=SALTS, lora=LORAS, as_array=st.booleans())
    def add_request(
        self,
        rid: int,
        tokens: list[int],
        salt: str | bytes | None,
        lora: int | None,
        as_array: bool,
    ) -> None:
        m = self.model
        n = len(tokens)
        req = Req([], n, list(tokens), salt_bytes(salt), lora)
        hits: list[int] = []
        for j in range((n - 1) // BS if n else 0):
            b = m.cache.get(req.key(j))
            if b is None:
                break
            hits.append(b)
        fresh = blocks_for(n) - len(hits)
        if rid in m.requests:
            error: type[Exception] | None = DuplicateRequestError
        elif len(m.requests) == MAX_SEQS or blocks_for(n) > MAX_BLOCKS:
            error = CapacityError
        elif fresh > m.available(set(hits)):
            error = OutOfBlocksError
        else:
            error = None
        event(f"add_request: {error.__name__ if error else 'ok'}, {min(len(hits), 2)}+ hits")
        arg = np.array(tokens, dtype=np.int64) if as_array else tokens
        if error is not None:
            with pytest.raises(error):
                self.tables.add_request(rid, arg, cache_salt=salt, lora_id=lora)
            return
        result = self.tables.add_request(rid, arg, cache_salt=salt, lora_id=lora)
        blocks = self.tables.blocks(rid).tolist()
        assert result.num_cached_tokens == len(hits) * BS
        assert blocks[: len(hits)] == hits, "a hit must be the cached block of that content"
        for b in hits:
            if b in m.lru:
                del m.lru[b]
            m.ref_cnt[b] += 1
        m.take(blocks[len(hits) :], exclude=set(hits))
        req.blocks = blocks
        for j in range(len(hits), n // BS):
            m.store(req, j)
        m.requests[rid] = req
        m.queries += n
        m.hits += len(hits) * BS
        start = len(hits) * BS
        assert result.slot_mapping.tolist() == [
            blocks[p // BS] * BS + p % BS for p in range(start, n)
        ]

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data(), with_ids=st.booleans())
    def append(self, data: st.DataObject, with_ids: bool) -> None:
        m = self.model
        ids = data.draw(st.permutations(sorted(m.requests)))
        ids = ids[: data.draw(st.integers(1, len(ids)))]
        counts = data.draw(st.lists(st.integers(0, BS + 2), min_size=len(ids), max_size=len(ids)))
        new_tokens = [
            data.draw(st.lists(st.integers(0, 3), min_size=c, max_size=c)) for c in counts
        ]
        # Plan as the tables do: copy a shared partial last block while someone else holds it.
        unshared: Counter[int] = Counter()
        copying: set[int] = set()
        needed = 0
        for rid, count in zip(ids, counts):
            req = m.requests[rid]
            if blocks_for(req.num_tokens + count) > MAX_BLOCKS:
                with pytest.raises(CapacityError):
                    self.tables.append_tokens_many(ids, counts)
                return
            needed += blocks_for(req.num_tokens + count) - blocks_for(req.num_tokens)
            if count > 0 and req.num_tokens % BS:
                last = req.blocks[-1]
                if m.ref_cnt[last] - unshared[last] > 1:
                    unshared[last] += 1
                    copying.add(rid)
                    needed += 1
        flat = [t for toks in new_tokens for t in toks]
        if needed > m.available():
            with pytest.raises(OutOfBlocksError):
                self.tables.append_tokens_many(ids, counts, flat if with_ids else None)
            return
        if len(ids) == 1:
            _, copies = self.tables.append_tokens(ids[0], counts[0], flat if with_ids else None)
        else:
            _, copies = self.tables.append_tokens_many(ids, counts, flat if with_ids else None)
        fresh: list[int] = []
        released: list[int] = []
        for rid in ids:
            req = m.requests[rid]
            now = self.tables.blocks(rid).tolist()
            old = len(req.blocks)
            if rid in copying:
                assert now[: old - 1] == req.blocks[:-1]
                fresh.append(now[old - 1])
                released.append(req.blocks[-1])
            else:
                assert now[:old] == req.blocks
            fresh.extend(now[old:])
            req.blocks = now
        assert len(copies) == len(copying)
        m.take(fresh)
        for b in released:
            m.drop(b)
            assert m.ref_cnt[b] >= 1, "a copied-from block is still shared"
        for rid, count, toks in zip(ids, counts, new_tokens):
            req = m.requests[rid]
            before = req.num_tokens
            req.num_tokens += count
            if req.tokens is None:
                continue
            if not with_ids:
                if count:
                    req.tokens = None
                continue
            req.tokens += toks
            for j in range(before // BS, req.num_tokens // BS):
                m.store(req, j)

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data(), child=REQUEST_IDS)
    def fork(self, data: st.DataObject, child: int) -> None:
        m = self.model
        parent = self.existing(data)
        if child in m.requests or len(m.requests) == MAX_SEQS:
            with pytest.raises((DuplicateRequestError, CapacityError)):
                self.tables.fork(parent, child)
            return
        self.tables.fork(parent, child)
        p = m.requests[parent]
        m.requests[child] = Req(
            list(p.blocks),
            p.num_tokens,
            None if p.tokens is None else list(p.tokens),
            p.salt,
            p.lora,
        )
        for b in p.blocks:
            m.ref_cnt[b] += 1

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        m = self.model
        rid = self.existing(data)
        self.tables.free(rid)
        # Cached blocks become evictable tail first; the others go back to the free list.
        for b in RELEASE_ORDER(m.requests.pop(rid).blocks):
            m.drop(b)

    @rule(n=st.integers(1, 6))
    def pool_alloc(self, n: int) -> None:
        """Allocation straight from the pool evicts under pressure too."""
        m = self.model
        if n > m.available():
            with pytest.raises(OutOfBlocksError):
                self.pool.alloc_many(n)
            return
        got = self.pool.alloc_many(n).tolist()
        m.take(got)
        self.held += got

    @precondition(lambda self: self.held)
    @rule()
    def pool_free(self) -> None:
        self.pool.free_many(self.held)
        for b in self.held:
            self.model.drop(b)
        self.held = []

    @rule()
    def reset(self) -> None:
        m = self.model
        in_use = sum(1 for b in m.key_of if m.ref_cnt[b] > 0)
        if in_use:
            with pytest.raises(CacheInUseError) as e:
                self.pool.reset_prefix_cache()
            assert e.value.in_use == in_use
            return
        assert self.pool.reset_prefix_cache() == len(m.lru)
        m.free |= set(m.lru)
        m.lru.clear()
        m.cache.clear()
        m.key_of.clear()

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def checks_pass(self) -> None:
        self.tables.check_invariants()
        self.pool.check_invariants(exact_refs=not self.held)

    @invariant()
    def counts_and_refs_equal_the_model(self) -> None:
        m = self.model
        assert [self.pool.ref_cnt(b) for b in range(NUM_BLOCKS)] == [
            m.ref_cnt[b] for b in range(NUM_BLOCKS)
        ]
        assert (self.pool.num_free, self.pool.num_evictable) == (len(m.free), len(m.lru))
        assert self.pool.num_free + self.pool.num_evictable + self.pool.num_used == NUM_BLOCKS
        assert not any(m.ref_cnt[b] for b in m.lru), "a referenced block is evictable"
        s = self.pool.prefix_cache_stats()
        assert (s["num_cached_blocks"], s["num_evictable_blocks"]) == (len(m.cache), len(m.lru))
        assert (s["queries"], s["hits"], s["evictions"], s["stored_blocks"]) == (
            m.queries,
            m.hits,
            m.evictions,
            m.stored,
        )

    @invariant()
    def requests_equal_the_model(self) -> None:
        m = self.model
        for rid, req in m.requests.items():
            assert self.tables.blocks(rid).tolist() == req.blocks
            assert self.tables.num_tokens(rid) == req.num_tokens
            # A cached block a request holds stands for exactly that request's content.
            if req.tokens is not None:
                for j, b in enumerate(req.blocks[: req.num_tokens // BS]):
                    if b in m.key_of:
                        assert m.key_of[b] == req.key(j)

    @invariant()
    def events_replay_to_the_cache(self) -> None:
        """Stored minus removed hashes, replayed from the events, is the cache's size."""
        for e in self.pool.take_kv_events():
            name = type(e).__name__
            if name == "BlockStored":
                assert len(e.token_ids) == len(e.block_hashes) * BS and e.block_size == BS
                self.live |= set(e.block_hashes)
            elif name == "BlockRemoved":
                assert set(e.block_hashes) <= self.live
                self.live -= set(e.block_hashes)
            else:
                self.live = set()
        assert len(self.live) == len(self.model.cache)


test_prefix_cache_state = PrefixCacheMachine.TestCase


def test_the_machine_catches_a_wrong_eviction_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: a model that evicts a freed request's head first must disagree with the pool."""
    monkeypatch.setattr(__import__(__name__), "RELEASE_ORDER", list, raising=True)
    no_shrinking = settings(settings.default, phases=[Phase.generate])
    with pytest.raises(AssertionError, match="expected the free"):
        run_state_machine_as_test(PrefixCacheMachine, settings=no_shrinking)
