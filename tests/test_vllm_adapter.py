"""The vLLM-shaped adapter driven as vLLM's scheduler drives its KV cache manager:
admission with computed blocks, chunked prefill, decode growth, preemption and prefix hits."""

from dataclasses import dataclass, field

from kvpool import KvLayout
from kvpool.integrations.vllm import KvPoolKVCacheManager

BS = 4
LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=BS, dtype="float16")


@dataclass
class Request:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    max_tokens: int = 6
    output: list[int] = field(default_factory=list)


class Scheduler:
    """vLLM's scheduling loop, reduced: running requests first (preempting the newest on a
    failed allocation), then waiting ones admitted with their prefix hits, chunked by a
    token budget."""

    def __init__(self, manager, token_budget):
        self.m, self.budget = manager, token_budget
        self.waiting, self.running, self.finished = [], [], []
        self.preemptions = 0
        self.hits = {}

    def step(self):
        budget = self.budget
        for req in list(self.running):
            if req not in self.running:
                continue
            n = min(len(req.all_token_ids) - req.num_computed_tokens, budget)
            while self.m.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self.m.free(victim)
                victim.num_computed_tokens = 0
                self.waiting.insert(0, victim)
                self.preemptions += 1
                if victim is req:
                    break
            else:
                req._scheduled = n
                budget -= n
        while self.waiting and budget > 0:
            req = self.waiting[0]
            _, num_computed, _ = self.m.get_computed_blocks(req)
            n = min(len(req.all_token_ids) - num_computed, budget)
            if self.m.allocate_slots(req, n, num_computed) is None:
                break
            self.waiting.pop(0)
            self.hits[req.request_id] = num_computed
            req.num_computed_tokens = num_computed
            req._scheduled = n
            self.running.append(req)
            budget -= n
        # The "model" ran: scheduled tokens are computed; a request past its prompt samples.
        for req in list(self.running):
            req.num_computed_tokens += req._scheduled
            req._scheduled = 0
            if req.num_computed_tokens == len(req.all_token_ids):
                token = 1000 + len(req.output)
                req.output.append(token)
                req.all_token_ids.append(token)
                self.m.cache_blocks(req, req.num_computed_tokens)
                if len(req.output) == req.max_tokens:
                    self.running.remove(req)
                    self.m.free(req)
                    self.finished.append(req)
        self.m.pool.check_invariants(exact_refs=True)


def prompt(prefix, n):
    return [*prefix, *range(500 + 100 * n, 500 + 100 * n + 7)]


def test_a_synthetic_vllm_schedule_runs_with_hits_chunking_and_preemption():
    m = KvPoolKVCacheManager(
        LAYOUT, 14, max_num_seqs=8, max_model_len=64, enable_kv_cache_events=True
    )
    shared = list(range(16))  # four full blocks every request shares
    s = Scheduler(m, token_budget=40)
    first = Request("r0", prompt(shared, 0), 23)
    s.waiting.append(first)
    for _ in range(10):
        s.step()
    assert first in s.finished
    assert m.take_events()
    for i in range(1, 7):
        s.waiting.append(Request(f"r{i}", prompt(shared, i), 23))
    for _ in range(80):
        s.step()
        assert 0.0 <= m.usage <= 1.0
        if not s.waiting and not s.running:
            break
    assert len(s.finished) == 7
    assert all(len(r.output) == r.max_tokens for r in s.finished)
    # Later requests hit the shared head computed by the first.
    assert s.hits["r1"] == 16
    assert s.preemptions > 0, "the pool is small enough that decode growth preempts"
    assert m.pool.num_used == 0
    assert m.reset_prefix_cache()
    m.pool.check_invariants()


def test_get_computed_blocks_is_a_pure_query_and_admission_takes_the_hits():
    m = KvPoolKVCacheManager(LAYOUT, 16, max_num_seqs=4, max_model_len=64)
    a = Request("a", list(range(13)), 13)
    assert m.allocate_slots(a, 13) is not None
    m.free(a)
    b = Request("b", list(range(13)), 13, cache_salt=None)
    stats = m.pool.prefix_cache_stats()
    blocks, hit, _ = m.get_computed_blocks(b)
    assert (blocks.get_block_ids(), hit) == (([],), 12)
    assert m.pool.prefix_cache_stats() == stats
    new = m.allocate_slots(b, 1, hit)
    assert new is not None
    assert len(m.get_block_ids("b")[0]) == 4
    salted = Request("c", list(range(13)), 13, cache_salt="tenant")
    assert m.get_computed_blocks(salted)[1] == 0
    # Out of blocks: None, and nothing changed.
    big = Request("d", list(range(100, 164)), 64)
    used = m.pool.num_used
    assert m.allocate_slots(big, 64) is None
    assert m.pool.num_used == used
