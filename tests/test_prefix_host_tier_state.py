"""The prefix cache with a host tier, against a plain-Python model of both tiers, driven by
Hypothesis.

Two host pools stand in for the tiers (the pool is a host `Pool`; its prefix cache's second
tier is plain host memory), so the whole protocol runs without CUDA: add with shared
prefixes, append (with ids), free, eviction under pressure (which spills cached blocks to the
host tier, dropping the host's least recently used ones when it is full), a hit on a
host-resident block (copied back into a fresh pool block) and reset. Every token's K and V
in every layer carry a code derived from the content the token stands for (salt and every
token up to it), written when the token is computed; after every rule each request's bytes
are read back, so a hit, on either tier, must bring exactly the KV of that content.
Settings come from the profile tests/conftest.py loads.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
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
    InvalidArgumentError,
    KvLayout,
    OutOfBlocksError,
    Pool,
)
from kvpool.metrics import snapshot
from prefix_model import PoolModel

BS = 4
LAYERS = 2
LAYOUT = KvLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=8, block_size=BS)
NUM_BLOCKS = 12
HOST_BLOCKS = 5
MAX_SEQS = 4
MAX_BLOCKS = 6

DOCS = [[1, 2, 3, 4, 5, 6, 7, 8] + [10 * d + i for i in range(12)] for d in range(3)]
SALTS = st.sampled_from([None, "tenant-a"])
REQUEST_IDS = st.integers(0, 6)
# Which evicted blocks the host tier keeps when it cannot take all: the most recently used.
# The mutation test flips it to prove the machine notices.
KEEP_ON_SPILL = "newest"


@st.composite
def prompts(draw: st.DrawFn) -> list[int]:
    doc = draw(st.sampled_from(DOCS))
    return doc[: draw(st.integers(0, len(doc)))] + draw(st.lists(st.integers(0, 3), max_size=3))


def blocks_for(n: int) -> int:
    return -(-n // BS)


def code(salt: str | None, tokens: tuple[int, ...], layer: int, part: int) -> int:
    """The 16-bit code of the last of `tokens` (its KV depends on all of them and the salt)."""
    digest = hashlib.blake2b(repr((salt, tokens, layer, part)).encode(), digest_size=2).digest()
    return int.from_bytes(digest, "little")


@dataclass
class Req:
    blocks: list[int]
    tokens: list[int]
    salt: str | None

    def key(self, j: int) -> tuple[object, ...]:
        return (self.salt, tuple(self.tokens[: (j + 1) * BS]))


class Model(PoolModel):
    """Both tiers. The pool (`PoolModel`), and the host tier: the keys it holds in LRU order
    (a host block holds nothing else), and blocks taken out for a swap-in in progress."""

    def __init__(self) -> None:
        super().__init__(NUM_BLOCKS)
        self.requests: dict[int, Req] = {}
        self.host: OrderedDict[tuple[object, ...], None] = OrderedDict()
        self.host_taken = 0
        self.host_stored = self.host_evictions = self.swapped_in = 0

    def take(self, got: list[int], exclude: set[int] = frozenset()) -> list[tuple[object, ...]]:  # type: ignore[assignment]
        """The pool handed out `got`; the keys it evicted spill to the host tier."""
        evicted = super().take(got, exclude)
        self.spill(evicted)
        return evicted

    def spill(self, evicted: list[tuple[object, ...]]) -> None:
        if not evicted:
            return
        host_free = HOST_BLOCKS - len(self.host) - self.host_taken
        room = host_free + len(self.host)
        keep = min(len(evicted), room)
        kept = evicted[len(evicted) - keep :] if KEEP_ON_SPILL == "newest" else evicted[:keep]
        event(f"spill: {len(kept)} of {len(evicted)} kept")
        for _ in range(keep - min(host_free, keep)):
            self.host.popitem(last=False)
            self.host_evictions += 1
        for key in kept:
            if key not in self.host:
                self.host[key] = None
                self.host_stored += 1


class PrefixHostTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool(
            LAYOUT,
            NUM_BLOCKS,
            device="host",
            enable_prefix_caching=True,
            prefix_cache_host_blocks=HOST_BLOCKS,
        )
        self.pool.enable_kv_cache_events()
        self.tables = BlockTables(self.pool, MAX_SEQS, MAX_BLOCKS)
        self.model = Model()
        self.held: list[int] = []
        self.live: Counter[bytes] = Counter()  # cached hashes on either tier, from the events

    def _write(self, req: Req, start: int, slots: np.ndarray) -> None:
        """Computes positions start.. of `req`: writes each token's code at its slot."""
        for i, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, BS)
            prefix = tuple(req.tokens[: start + i + 1])
            for layer in range(LAYERS):
                for part, view in enumerate((self.pool.k_view(layer), self.pool.v_view(layer))):
                    view.view(np.uint16)[block, offset] = code(req.salt, prefix, layer, part)

    @rule(rid=REQUEST_IDS, tokens=prompts(), salt=SALTS)
    def add_request(self, rid: int, tokens: list[int], salt: str | None) -> None:
        m = self.model
        n = len(tokens)
        req = Req([], list(tokens), salt)
        max_hits = (n - 1) // BS if n else 0
        hits: list[int] = []
        while len(hits) < max_hits and req.key(len(hits)) in m.cache:
            hits.append(m.cache[req.key(len(hits))])
        host_hits: list[tuple[object, ...]] = []
        while (
            len(hits) + len(host_hits) < max_hits and req.key(len(hits) + len(host_hits)) in m.host
        ):
            host_hits.append(req.key(len(hits) + len(host_hits)))
        fresh = blocks_for(n) - len(hits)
        if rid in m.requests:
            return
        if len(m.requests) == MAX_SEQS or blocks_for(n) > MAX_BLOCKS:
            with pytest.raises(CapacityError):
                self.tables.add_request(rid, tokens, cache_salt=salt)
            return
        if fresh > m.available(set(hits)):
            with pytest.raises(OutOfBlocksError):
                self.tables.add_request(rid, tokens, cache_salt=salt)
            return
        event(f"add_request: {min(len(hits), 2)}+ pool hits, {min(len(host_hits), 2)}+ host hits")
        result = self.tables.add_request(rid, np.array(tokens, dtype=np.int32), cache_salt=salt)
        cached = len(hits) + len(host_hits)
        assert result.num_cached_tokens == cached * BS
        blocks = self.tables.blocks(rid).tolist()
        assert blocks[: len(hits)] == hits
        for b in hits:
            m.lru.pop(b, None)
            m.ref_cnt[b] += 1
        for key in host_hits:
            del m.host[key]
        m.host_taken = len(host_hits)
        m.take(blocks[len(hits) :], exclude=set(hits))
        m.host_taken = 0
        m.swapped_in += len(host_hits)
        req.blocks = blocks
        for j in range(len(hits), n // BS):
            m.store(req, j)
        m.requests[rid] = req
        m.queries += n
        m.hits += cached * BS
        self._write(req, cached * BS, result.slot_mapping)

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        m = self.model
        rids = data.draw(st.permutations(sorted(m.requests)))
        rids = rids[: data.draw(st.integers(1, len(rids)))]
        new = [data.draw(st.lists(st.integers(0, 3), max_size=BS + 1)) for _ in rids]
        counts = [len(t) for t in new]
        if any(
            blocks_for(len(m.requests[r].tokens) + c) > MAX_BLOCKS for r, c in zip(rids, counts)
        ):
            return
        needed = sum(
            blocks_for(len(m.requests[r].tokens) + c) - blocks_for(len(m.requests[r].tokens))
            for r, c in zip(rids, counts)
        )
        flat = [t for toks in new for t in toks]
        if needed > m.available():
            with pytest.raises(OutOfBlocksError):
                self.tables.append_tokens_many(rids, counts, flat)
            return
        slots, copies = self.tables.append_tokens_many(rids, counts, flat)
        assert len(copies) == 0, "nothing is shared but full cached blocks"
        fresh: list[int] = []
        for rid in rids:
            req = m.requests[rid]
            now = self.tables.blocks(rid).tolist()
            assert now[: len(req.blocks)] == req.blocks
            fresh += now[len(req.blocks) :]
            req.blocks = now
        m.take(fresh)
        at = 0
        for rid, toks in zip(rids, new):
            req = m.requests[rid]
            before = len(req.tokens)
            req.tokens += toks
            for j in range(before // BS, len(req.tokens) // BS):
                m.store(req, j)
            self._write(req, before, slots[at : at + len(toks)])
            at += len(toks)

    @precondition(lambda self: self.model.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model.requests)))
        self.tables.free(rid)
        for b in reversed(self.model.requests.pop(rid).blocks):
            self.model.drop(b)

    @rule(n=st.integers(1, NUM_BLOCKS))
    def pressure(self, n: int) -> None:
        """Blocks taken straight from the pool evict (and spill) cached blocks, then return."""
        m = self.model
        if n > m.available():
            with pytest.raises(OutOfBlocksError):
                self.pool.alloc_many(n)
            return
        got = self.pool.alloc_many(n).tolist()
        m.take(got)
        self.pool.free_many(got)
        for b in got:
            m.drop(b)

    @rule()
    def reset(self) -> None:
        m = self.model
        in_use = sum(1 for b in m.key_of if m.ref_cnt[b] > 0)
        if in_use:
            with pytest.raises(CacheInUseError):
                self.pool.reset_prefix_cache()
            return
        assert self.pool.reset_prefix_cache() == len(m.lru)
        m.free |= set(m.lru)
        m.lru.clear()
        m.cache.clear()
        m.key_of.clear()
        m.host.clear()

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def checks_pass(self) -> None:
        self.tables.check_invariants()
        self.pool.check_invariants(exact_refs=True)

    @invariant()
    def both_tiers_equal_the_model(self) -> None:
        m = self.model
        assert [self.pool.ref_cnt(b) for b in range(NUM_BLOCKS)] == [
            m.ref_cnt[b] for b in range(NUM_BLOCKS)
        ]
        assert (self.pool.num_free, self.pool.num_evictable) == (len(m.free), len(m.lru))
        assert self.pool.num_free + self.pool.num_evictable + self.pool.num_used == NUM_BLOCKS
        s = self.pool.prefix_cache_stats()
        assert (s["num_cached_blocks"], s["num_evictable_blocks"]) == (len(m.cache), len(m.lru))
        assert (s["queries"], s["hits"], s["evictions"], s["stored_blocks"]) == (
            m.queries,
            m.hits,
            m.evictions,
            m.stored,
        )
        assert s["host_num_blocks"] == HOST_BLOCKS
        assert s["host_num_cached_blocks"] == len(m.host)
        assert (s["host_stored_blocks"], s["host_evictions"], s["swapped_in_blocks"]) == (
            m.host_stored,
            m.host_evictions,
            m.swapped_in,
        )

    @invariant()
    def every_token_holds_the_kv_of_its_content(self) -> None:
        for rid, req in self.model.requests.items():
            blocks = self.tables.blocks(rid).tolist()
            for p in range(len(req.tokens)):
                prefix = tuple(req.tokens[: p + 1])
                for layer in range(LAYERS):
                    for part, view in enumerate((self.pool.k_view(layer), self.pool.v_view(layer))):
                        got = view.view(np.uint16)[blocks[p // BS], p % BS]
                        assert (got == code(req.salt, prefix, layer, part)).all(), (
                            f"request {rid} token {p}"
                        )

    @invariant()
    def events_replay_to_both_tiers(self) -> None:
        for e in self.pool.take_kv_events():
            name = type(e).__name__
            if name == "BlockStored":
                assert e.medium == "CPU" and e.block_size == BS
                # The host tier reports as vLLM's CPU offloading does: no parent, no tokens.
                assert len(e.token_ids) in (0, len(e.block_hashes) * BS)
                self.live.update(e.block_hashes)
            elif name == "BlockRemoved":
                for h in e.block_hashes:
                    assert self.live[h] > 0, "a removed hash was never stored"
                    self.live[h] -= 1
            else:
                self.live.clear()
        assert sum(self.live.values()) == len(self.model.cache) + len(self.model.host)


test_prefix_host_tier_state = PrefixHostTierMachine.TestCase


def test_the_machine_catches_a_wrong_spill_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: a model that keeps the oldest evicted blocks must disagree with the pool."""
    monkeypatch.setattr(__import__(__name__), "KEEP_ON_SPILL", "oldest", raising=True)
    no_shrinking = settings(settings.default, phases=[Phase.generate])
    with pytest.raises(AssertionError):
        run_state_machine_as_test(PrefixHostTierMachine, settings=no_shrinking)


def test_a_hit_on_the_host_tier_brings_the_kv_back() -> None:
    """The plain story: a prompt computed, evicted to the host, hit again, byte for byte."""
    pool = Pool(LAYOUT, 4, device="host", enable_prefix_caching=True, prefix_cache_host_blocks=4)
    tables = BlockTables(pool, 2, 4)
    pool.enable_kv_cache_events()
    prompt = list(range(9))  # 2 full blocks + 1 token
    first = tables.add_request(1, prompt)
    k = pool.k_view(0).view(np.uint16)
    for p, slot in enumerate(first.slot_mapping.tolist()):
        k[slot // BS, slot % BS] = 100 + p
    tables.free(1)
    (stored,) = pool.take_kv_events()
    pool.alloc_many(4)  # evicts both cached blocks: they spill to the host tier
    removed, spilled = pool.take_kv_events()
    # Tail first, as the pool evicts them, and reported on both tiers.
    assert removed.block_hashes == spilled.block_hashes == stored.block_hashes[::-1]
    assert spilled.medium == "CPU" and spilled.token_ids == [] and spilled.parent_block_hash is None
    s = pool.prefix_cache_stats()
    assert (s["num_cached_blocks"], s["host_num_cached_blocks"]) == (0, 2)
    pool.free_many(np.arange(4))
    k[:] = 0  # the pool's copies are gone; only the host tier has the KV
    again = tables.add_request(2, prompt)
    assert again.num_cached_tokens == 8 and len(again.slot_mapping) == 1
    blocks = tables.blocks(2).tolist()
    assert [int(k[blocks[p // BS], p % BS][0, 0]) for p in range(8)] == [100 + p for p in range(8)]
    s = pool.prefix_cache_stats()
    assert (s["num_cached_blocks"], s["host_num_cached_blocks"], s["swapped_in_blocks"]) == (
        2,
        0,
        2,
    )
    pool.check_invariants(exact_refs=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prefix_cache_host_blocks": 4}, "enable_prefix_caching"),
        (
            {"enable_prefix_caching": True, "prefix_cache_host_blocks": -1},
            "prefix_cache_host_blocks",
        ),
        ({"enable_prefix_caching": True, "prefix_cache_host_blocks": True}, "not bool"),
    ],
)
def test_a_host_tier_needs_prefix_caching_and_a_count(
    kwargs: dict[str, object], match: str
) -> None:
    error = TypeError if match == "not bool" else InvalidArgumentError  # a wrong type
    with pytest.raises(error, match=match):
        Pool(LAYOUT, 8, device="host", **kwargs)  # type: ignore[arg-type]


def test_metrics_export_the_host_tier() -> None:
    pool = Pool(LAYOUT, 2, device="host", enable_prefix_caching=True, prefix_cache_host_blocks=2)
    tables = BlockTables(pool, 1, 2)
    tables.add_request(1, range(5))
    tables.free(1)
    pool.free_many(pool.alloc_many(2))  # spills the cached block
    tables.add_request(2, range(5))  # and brings it back
    got = {s.name: s.value for s in snapshot(pool)}
    assert (
        got["kvpool:prefix_cache_host_cached_blocks"],
        got["kvpool:prefix_cache_swapped_in_blocks"],
    ) == (0, 1)
