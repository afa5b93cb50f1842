"""Scheduler invariants on Hypothesis-generated workloads, paged and contiguous."""

from __future__ import annotations

import kvpool
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvpool.scheduler import (
    POLICIES,
    ContiguousKv,
    PagedKv,
    Request,
    Scheduler,
    SchedulerConfig,
)
from kvpool.sim import generate

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
TOKEN_BYTES = 256  # contiguous baseline: bytes per token


def make_pool(num_blocks: int) -> kvpool.Pool:
    return kvpool.Pool(kvpool.KvLayout(1, 1, 16, BLOCK_SIZE), num_blocks, device="host")


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 24))
    reqs = []
    for i in range(n):
        prompt = draw(st.integers(1, MAX_MODEL_LEN - 1))
        output = draw(st.integers(1, MAX_MODEL_LEN - prompt))
        arrival = draw(st.integers(0, 30)) / 4.0
        reqs.append(Request(i, arrival, prompt, output, draw(st.integers(0, 3))))
    return reqs


@st.composite
def configs(draw):
    max_running = draw(st.integers(1, 8))
    return SchedulerConfig(
        max_model_len=MAX_MODEL_LEN,
        max_running_seqs=max_running,
        max_tokens_per_step=draw(st.integers(max_running, 80)),
        watermark=draw(st.sampled_from([0.0, 0.05, 0.2])),
        policy=draw(st.sampled_from(sorted(POLICIES))),
        max_steps=100_000,
    )


class CheckedScheduler(Scheduler):
    """Checks the limits and the allocator's invariants after every step."""

    def step(self) -> None:
        super().step()
        cfg = self.config
        assert len(self.running) <= cfg.max_running_seqs
        m = self.metrics.columns
        assert m["prefill_tokens"][-1] + m["decode_tokens"][-1] <= cfg.max_tokens_per_step
        backend = self.backend
        if isinstance(backend, PagedKv):
            backend.pool.check_invariants()
            assert len(backend.tables) == len(self.running)
            for seq in self.running:
                assert backend.tables.num_tokens(seq.request_id) == seq.kv_tokens
            assert m["tokens_stored"][-1] <= m["slots_allocated"][-1]
        else:
            backend.space.check_invariants()
            assert len(backend.regions) == len(self.running)


def served_exactly_once(sched: Scheduler, requests: list[Request]) -> None:
    assert sched.done
    assert sorted(s.request_id for s in sched.seqs) == sorted(r.request_id for r in requests)
    for seq in sched.seqs:
        assert seq.num_finishes == 1
        assert seq.generated == seq.request.output_tokens
        assert seq.finish_s >= seq.first_token_s >= seq.request.arrival_s
    finishes = [e[2] for e in sched.events if e[1] == "finish"]
    assert sorted(finishes) == sorted(r.request_id for r in requests)


@given(
    requests=workloads(), config=configs(), num_blocks=st.integers(MAX_MODEL_LEN // BLOCK_SIZE, 48)
)
def test_paged_serves_everything_once_without_leaks(requests, config, num_blocks):
    pool = make_pool(num_blocks)
    backend = PagedKv(pool, config.max_running_seqs, config.max_model_len)
    sched = CheckedScheduler(backend, requests, config, record_events=True)
    sched.run()
    served_exactly_once(sched, requests)
    assert pool.num_free == pool.num_blocks and pool.num_used == 0
    pool.check_invariants()
    backend.check_drained()
    # a preempted request came back and finished
    for seq in sched.seqs:
        if seq.num_preemptions:
            assert [e for e in sched.events if e[1] == "admit" and e[2] == seq.request_id][
                seq.num_preemptions :
            ]


@given(
    requests=workloads(),
    config=configs(),
    slots=st.integers(1, 4),
    reserve=st.sampled_from(["max_model_len", "request"]),
)
def test_contiguous_serves_everything_once(requests, config, slots, reserve):
    backend = ContiguousKv(
        slots * MAX_MODEL_LEN * TOKEN_BYTES + 100, TOKEN_BYTES, MAX_MODEL_LEN, reserve
    )
    sched = CheckedScheduler(backend, requests, config, record_events=True)
    sched.run()
    served_exactly_once(sched, requests)
    assert sched.num_preemptions == 0  # a reservation never runs dry
    backend.check_drained()
    if reserve == "max_model_len":
        assert max(sched.metrics.columns["running"]) <= slots


def waiting_replay(sched: Scheduler):
    """Yield (event, waiting set before it, running set before it) from the event log."""
    waiting: set[int] = set()
    running: set[int] = set()
    for _, kind, rid, *_ in sched.events:
        yield kind, rid, set(waiting), set(running)
        if kind in ("arrive",):
            waiting.add(rid)
        elif kind == "admit":
            waiting.discard(rid)
            running.add(rid)
        elif kind == "preempt":
            running.discard(rid)
            waiting.add(rid)
        elif kind == "finish":
            running.discard(rid)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@given(requests=workloads(), num_blocks=st.integers(16, 24))
def test_policy_order_is_respected(policy, requests, num_blocks):
    config = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN, max_running_seqs=4, max_tokens_per_step=32, policy=policy
    )
    by_id = {r.request_id: r for r in requests}

    def key(rid: int) -> tuple:
        r = by_id[rid]
        return (r.arrival_s, rid) if policy == "fcfs" else (r.priority, r.arrival_s, rid)

    sched = Scheduler(
        PagedKv(make_pool(num_blocks), 4, MAX_MODEL_LEN), requests, config, record_events=True
    )
    sched.run()
    for kind, rid, waiting, running in waiting_replay(sched):
        if kind == "admit":
            assert key(rid) == min(key(w) for w in waiting)
        elif kind == "preempt":
            assert key(rid) == max(key(r) for r in running)


def test_preempted_requests_resume_and_finish():
    # 6 long requests in a pool that holds about two of them: decode must preempt
    requests = [Request(i, 0.0, 30, 30) for i in range(6)]
    config = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN, max_running_seqs=6, max_tokens_per_step=200, watermark=0.0
    )
    pool = make_pool(32)
    sched = CheckedScheduler(PagedKv(pool, 6, MAX_MODEL_LEN), requests, config, record_events=True)
    sched.run()
    assert sched.num_preemptions > 0
    served_exactly_once(sched, requests)
    assert pool.num_free == 32


def test_lru_and_lfu_pick_the_least_scheduled():
    from kvpool.scheduler import Seq, make_policy

    a, b = Seq(Request(0, 0.0, 4, 4)), Seq(Request(1, 1.0, 4, 4))
    a.last_scheduled_s, b.last_scheduled_s = 5.0, 3.0
    a.times_scheduled, b.times_scheduled = 1, 9
    lru, lfu = make_policy("lru"), make_policy("lfu")
    assert max([a, b], key=lru.victim_key) is b and min([a, b], key=lru.admission_key) is b
    assert max([a, b], key=lfu.victim_key) is a and min([a, b], key=lfu.admission_key) is a


def test_chunked_prefill_respects_the_token_budget():
    requests = [Request(0, 0.0, 60, 2), Request(1, 0.0, 50, 2)]
    config = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN, max_running_seqs=2, max_tokens_per_step=16
    )
    sched = CheckedScheduler(PagedKv(make_pool(40), 2, MAX_MODEL_LEN), requests, config)
    sched.run()
    prefill = sched.metrics.columns["prefill_tokens"]
    assert max(prefill) == 16 and sum(prefill) == 110


def test_paged_beats_contiguous_at_equal_memory():
    requests = generate("sharegpt", 300, seed=0, max_model_len=1024)
    config = SchedulerConfig(max_model_len=1024, max_running_seqs=128, max_tokens_per_step=1024)
    num_blocks = 1024  # 4096 tokens: 4 contiguous reservations of 1024, ~8 mean-length sequences
    paged = Scheduler(PagedKv(make_pool(num_blocks), 128, 1024), requests, config)
    contiguous = Scheduler(
        ContiguousKv(num_blocks * BLOCK_SIZE * TOKEN_BYTES, TOKEN_BYTES, 1024), requests, config
    )
    mp, mc = paged.run().arrays(), contiguous.run().arrays()
    assert mp["running"].mean() >= 2 * mc["running"].mean()
    assert mp["tokens_stored"].sum() / mp["slots_allocated"].sum() > 0.9


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        SchedulerConfig(max_running_seqs=8, max_tokens_per_step=4).validate()
    with pytest.raises(ValueError, match="unknown policy"):
        SchedulerConfig(policy="random").validate()
    with pytest.raises(ValueError, match="exceed max_model_len"):
        Scheduler(
            ContiguousKv(10**6, 1, 16), [Request(0, 0.0, 10, 10)], SchedulerConfig(max_model_len=16)
        )
    with pytest.raises(ValueError, match="the pool has 2 blocks, fewer than the 16 one sequence"):
        PagedKv(make_pool(2), 4, MAX_MODEL_LEN).validate(
            SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_running_seqs=4)
        )


def test_pool_size_is_checked_against_max_model_len_not_the_table_width():
    # Tables 32 blocks wide (128 tokens), max_model_len 64 (16 blocks): a 20-block pool holds
    # one full-length sequence, so it is accepted; a 15-block pool is refused, quoting 16.
    config = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_running_seqs=4)
    PagedKv(make_pool(20), 4, 2 * MAX_MODEL_LEN).validate(config)
    with pytest.raises(ValueError, match="the pool has 15 blocks, fewer than the 16 one sequence"):
        PagedKv(make_pool(15), 4, 2 * MAX_MODEL_LEN).validate(config)
    with pytest.raises(ValueError, match="4 rows, fewer than max_running_seqs 8"):
        PagedKv(make_pool(64), 4, MAX_MODEL_LEN).validate(
            SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_running_seqs=8)
        )
    with pytest.raises(
        ValueError, match="blocks per row"
    ):  # tables sized for a shorter max_model_len
        PagedKv(make_pool(64), 4, MAX_MODEL_LEN // 2).validate(
            SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_running_seqs=4)
        )


def test_duplicate_request_ids_are_rejected():
    requests = [Request(0, 0.0, 4, 4), Request(7, 0.0, 4, 4), Request(7, 1.0, 2, 2)]
    config = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_running_seqs=4)
    with pytest.raises(ValueError, match="duplicate request id 7"):
        Scheduler(PagedKv(make_pool(64), 4, MAX_MODEL_LEN), requests, config)
    with pytest.raises(ValueError, match="duplicate request id 7"):
        Scheduler(ContiguousKv(10**6, 1, MAX_MODEL_LEN), requests, config)
