"""The continuous-batching generation loop on a host pool with the NumPy toy model: every
request completes, outputs equal running each request alone, no block leaks, EOS and sampling."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from kvpool.generation import (
    GenerationRequest,
    GenerationSession,
    StepBatch,
    ToyModel,
    generate,
    gumbel_noise,
    sample,
)
from kvpool.generation.loop import scheduler_request
from kvpool.scheduler import Request

VOCAB = 61


def make_pool(num_blocks: int, block_size: int = 4) -> kvpool.Pool:
    layout = kvpool.KvLayout(
        num_layers=2, num_kv_heads=2, head_dim=8, block_size=block_size, dtype="float32"
    )
    return kvpool.Pool(layout, num_blocks, device="host")


def requests(n: int, seed: int, temperature: float = 0.0, eos: tuple[int, ...] = ()):
    rng = np.random.default_rng(seed)
    return [
        GenerationRequest(
            request_id=i,
            prompt=rng.integers(0, VOCAB, int(rng.integers(1, 30))).tolist(),
            max_new_tokens=int(rng.integers(1, 24)),
            eos_token_ids=eos,
            temperature=temperature,
            seed=1000 + i,
        )
        for i in range(n)
    ]


def alone(reqs, block_size: int = 4):
    pool = make_pool(64, block_size)
    model = ToyModel(pool, VOCAB, seed=3)
    return {r.request_id: generate(model, pool, [r]).outputs[r.request_id] for r in reqs}


def test_200_requests_through_a_small_pool_match_running_alone():
    reqs = requests(200, seed=1)
    pool = make_pool(40)  # 160 token slots: far fewer than the workload needs at once
    res = generate(
        ToyModel(pool, VOCAB, seed=3), pool, reqs, max_running_seqs=32, max_tokens_per_step=64
    )
    assert set(res.outputs) == {r.request_id for r in reqs}
    for r in reqs:
        assert len(res.outputs[r.request_id]) == r.max_new_tokens
        assert res.finish_reasons[r.request_id] == "length"
    assert res.num_preemptions > 0 and res.peak_running > 1  # the pool was the limit
    assert pool.num_free == pool.num_blocks
    pool.check_invariants()
    assert res.outputs == alone(reqs)


def test_eos_stops_a_request_and_frees_its_blocks():
    reqs = requests(40, seed=2)
    free_run = alone(reqs)
    eos = free_run[0][0]  # a token the model does emit
    stopped = [GenerationRequest(r.request_id, r.prompt, r.max_new_tokens, (eos,)) for r in reqs]
    pool = make_pool(30)
    res = generate(ToyModel(pool, VOCAB, seed=3), pool, stopped, max_running_seqs=8)
    assert res.finish_reasons[0] == "eos" and res.outputs[0] == [eos]
    for r in reqs:
        full = free_run[r.request_id]
        out = res.outputs[r.request_id]
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert out == full[:cut]
    assert pool.num_free == pool.num_blocks


def test_sampling_is_batch_independent_and_not_greedy():
    reqs = requests(30, seed=4, temperature=1.0)
    pool = make_pool(24)
    res = generate(ToyModel(pool, VOCAB, seed=3), pool, reqs, max_running_seqs=8)
    assert res.outputs == alone(reqs)
    greedy = alone([GenerationRequest(r.request_id, r.prompt, r.max_new_tokens) for r in reqs])
    assert res.outputs != greedy


class CorruptDecodeSlots:
    """Mutation: decode tokens write their K/V one slot off; the check below must see it."""

    def __init__(self, model: ToyModel) -> None:
        self.model = model

    def run(self, batch: StepBatch) -> np.ndarray:
        slots = batch.slot_mapping.copy()
        slots[: batch.num_decode] = np.where(
            slots[: batch.num_decode] > 0, slots[: batch.num_decode] - 1, 0
        )
        fields = {f: getattr(batch, f) for f in StepBatch.__dataclass_fields__}
        return self.model.run(StepBatch(**{**fields, "slot_mapping": slots}))


def test_a_wrong_slot_changes_the_outputs():
    reqs = requests(20, seed=5)
    pool = make_pool(64)
    res = generate(CorruptDecodeSlots(ToyModel(pool, VOCAB, seed=3)), pool, reqs)
    assert res.outputs != alone(reqs)


def test_scheduler_plan_matches_the_tokens_fed():
    reqs = requests(12, seed=6)
    pool = make_pool(16)
    fed: dict[int, list[int]] = {}

    class Recorder:
        def __init__(self, inner):
            self.inner = inner

        def run(self, batch: StepBatch) -> np.ndarray:
            assert (np.diff(batch.prefill_qo_indptr) > 0).all()
            for i, p in enumerate(batch.positions.tolist()):
                tok = int(batch.input_ids[i])
                fed.setdefault(p, []).append(tok)
            assert (batch.slot_mapping >= 0).all()
            return self.inner.run(batch)

    res = generate(Recorder(ToyModel(pool, VOCAB, seed=3)), pool, reqs, max_running_seqs=4)
    total = sum(len(r.prompt) - 1 + r.max_new_tokens for r in reqs)  # KV each request wrote
    assert sum(len(v) for v in fed.values()) >= total  # preemption recomputes, never skips
    assert res.num_output_tokens == sum(r.max_new_tokens for r in reqs)


def test_bad_requests_are_refused():
    pool = make_pool(8)
    model = ToyModel(pool, VOCAB)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, pool, [GenerationRequest(0, [], 4)])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, pool, [GenerationRequest(0, [1], 0)])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, pool, [GenerationRequest(0, [1], True)])
    assert pool.num_free == pool.num_blocks


def test_max_model_len_counts_the_prompt_and_the_new_tokens():
    # A prompt of 4 tokens and 5 new ones is a sequence of 9 tokens: max_model_len 9 serves
    # it, 8 refuses it, and the refusal names the request's own counts.
    pool = make_pool(16)
    model = ToyModel(pool, VOCAB, seed=3)
    req = GenerationRequest(7, [1, 2, 3, 4], 5)
    assert len(generate(model, pool, [req], max_model_len=9).outputs[7]) == 5
    with pytest.raises(ValueError, match=r"request 7: prompt 4 \+ max_new_tokens 5 tokens exceed"):
        generate(model, pool, [req], max_model_len=8)
    assert pool.num_free == pool.num_blocks


def test_the_scheduler_serves_the_first_token_from_the_prefill():
    # The prompt's last row samples the first output: P prefilled tokens, N - 1 decodes.
    req = GenerationRequest(3, [5, 6, 7, 8], 6)
    assert scheduler_request(req) == Request(3, 0.0, 4, 5)


def test_no_slot_is_written_twice_in_one_step():
    # A sequence finishing in a step still writes and reads its blocks in that step: they
    # must not go to a prefill of the same step (a tight pool makes the reuse likely).
    reqs = requests(30, seed=8)
    pool = make_pool(24)

    class SlotChecker:
        def __init__(self, inner):
            self.inner = inner

        def run(self, batch: StepBatch) -> np.ndarray:
            assert len(np.unique(batch.slot_mapping)) == batch.num_tokens
            return self.inner.run(batch)

    res = generate(SlotChecker(ToyModel(pool, VOCAB, seed=3)), pool, reqs, max_running_seqs=6)
    assert res.outputs == alone(reqs)


def test_gumbel_noise_depends_on_seed_and_position_only():
    seeds, pos = np.array([1, 1, 2]), np.array([5, 6, 5])
    g = gumbel_noise(seeds, pos, 100)
    assert np.isfinite(g).all()
    assert np.array_equal(g[0], gumbel_noise(seeds[:1], pos[:1], 100)[0])
    assert not np.array_equal(g[0], g[1]) and not np.array_equal(g[0], g[2])
    logits = np.zeros((3, 100))
    logits[:, 7] = 1e9
    assert sample(logits, np.array([0.0, 1.0, 2.0]), seeds, pos).tolist() == [7, 7, 7]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_requests_swapped_to_a_host_tier_resume_with_the_same_tokens(temperature):
    from kvpool.scheduler.swap import HostTierSwapper

    reqs = requests(120, seed=4, temperature=temperature)
    pool = make_pool(40)
    swappers = []

    def make_swapper(backend):
        swappers.append(
            HostTierSwapper(
                backend, 256, mode="swap", prefill_s_per_token=1.0, block_bytes=pool.block_bytes
            )
        )
        return swappers[0]

    res = generate(
        ToyModel(pool, VOCAB, seed=3),
        pool,
        reqs,
        max_running_seqs=32,
        max_tokens_per_step=64,
        make_swapper=make_swapper,
    )
    counts = swappers[0].counts
    assert counts.swapped_out > 0 and counts.swapped_in == counts.swapped_out
    # A victim holding no KV yet (a one-token prompt before its first decode) has nothing to swap.
    assert all(c.reason == "no KV" for _, c in swappers[0].choices if c.kind == "recompute")
    assert res.num_preemptions == counts.swapped_out + counts.recomputed
    assert res.outputs == alone(reqs)  # the KV came back byte for byte
    assert pool.num_free == pool.num_blocks


class CountingRunner:
    """Records what every step asked of the model: prefill tokens fed, sampled rows."""

    def __init__(self, inner):
        self.inner, self.prefill_tokens, self.steps = inner, 0, []

    def run(self, batch: StepBatch) -> np.ndarray:
        self.prefill_tokens += batch.num_tokens - batch.num_decode
        self.steps.append((batch.num_decode, batch.num_prefill, batch.num_sampled))
        return self.inner.run(batch)


def test_the_first_token_comes_from_the_prefill_step():
    """A prompt of P tokens and N new ones: one prefill step that samples the first token
    from the prompt's last row, then N - 1 decode steps; a one-token answer needs no decode."""
    pool = make_pool(16)
    for n in (1, 5):
        runner = CountingRunner(ToyModel(pool, VOCAB, seed=3))
        res = generate(runner, pool, [GenerationRequest(0, [4, 9, 2, 7, 1], n)])
        assert len(res.outputs[0]) == n and res.finish_reasons[0] == "length"
        assert runner.steps == [(0, 1, 1)] + [(1, 0, 1)] * (n - 1)
        assert runner.prefill_tokens == 5
    one = generate(ToyModel(pool, VOCAB, seed=3), pool, [GenerationRequest(1, [8], 3)])
    assert len(one.outputs[1]) == 3  # a one-token prompt: its prefill is that token
    assert pool.num_free == pool.num_blocks


def test_an_eos_sampled_from_the_prefill_ends_the_request():
    pool = make_pool(16)
    first = alone([GenerationRequest(0, [3, 1, 4, 1, 5], 4)])[0][0]
    res = generate(
        ToyModel(pool, VOCAB, seed=3), pool, [GenerationRequest(0, [3, 1, 4, 1, 5], 4, (first,))]
    )
    assert res.outputs[0] == [first] and res.finish_reasons[0] == "eos"
    assert pool.num_free == pool.num_blocks


def shared_prefix_requests(n: int, prefix_len: int, seed: int):
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, prefix_len).tolist()
    return [
        GenerationRequest(
            i, system + rng.integers(0, VOCAB, int(rng.integers(1, 9))).tolist(), 6, seed=i
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_prefix_caching_skips_the_shared_prompt_and_changes_no_token(temperature):
    reqs = [
        GenerationRequest(r.request_id, r.prompt, r.max_new_tokens, temperature=temperature)
        for r in shared_prefix_requests(12, 17, seed=9)
    ]
    layout = make_pool(1).layout
    outs, fed = {}, {}
    for caching in (False, True):
        pool = kvpool.Pool(layout, 48, device="host", enable_prefix_caching=caching)
        runner = CountingRunner(ToyModel(pool, VOCAB, seed=3))
        res = generate(runner, pool, reqs, max_running_seqs=4, max_tokens_per_step=32)
        outs[caching], fed[caching] = res.outputs, runner.prefill_tokens
        assert res.num_prefill_tokens == runner.prefill_tokens
        if caching:
            assert pool.num_used == 0 and pool.num_free == pool.num_blocks
            # every request but the first finds the system prompt's 4 full blocks
            assert res.num_cached_tokens >= (len(reqs) - 4) * 16
        else:
            assert res.num_cached_tokens == 0
    assert outs[True] == outs[False]
    assert fed[True] < fed[False] - 100


def test_prefix_caching_reuses_the_blocks_of_an_answer_in_a_later_turn():
    """A second turn whose prompt is the first turn's prompt + answer hits the answer's
    blocks (the decodes appended their tokens with ids)."""
    layout = make_pool(1).layout
    pool = kvpool.Pool(layout, 32, device="host", enable_prefix_caching=True)
    model = ToyModel(pool, VOCAB, seed=3)
    session = GenerationSession(model, pool, max_model_len=64)
    turn1 = GenerationRequest(0, list(range(1, 10)), 12)
    session.add(turn1)
    for _ in session.stream():
        pass
    answer = session.result.outputs[0]
    session.add(GenerationRequest(1, list(turn1.prompt) + answer + [5], 3))
    for _ in session.stream():
        pass
    res = session.close()
    # turn 2's prompt: 9 + 12 + 1 tokens; the 20 tokens with KV from turn 1 fill 5 blocks
    assert res.num_cached_tokens == 20
    plain = make_pool(32)
    want = generate(
        ToyModel(plain, VOCAB, seed=3),
        plain,
        [GenerationRequest(1, list(turn1.prompt) + answer + [5], 3)],
    )
    assert res.outputs[1] == want.outputs[1]


def test_a_session_takes_requests_while_it_runs_and_streams_each_steps_tokens():
    reqs = requests(16, seed=12)
    pool = make_pool(40)
    session = GenerationSession(
        ToyModel(pool, VOCAB, seed=3), pool, max_model_len=64, max_running_seqs=6
    )
    streamed: dict[int, list[int]] = {}
    finished: dict[int, str] = {}
    pending = list(reqs)
    session.add(pending.pop(0))
    for events in session.stream():
        if pending:  # one more request joins after every step, while others run
            session.add(pending.pop(0))
        for e in events:
            assert e.request_id not in finished  # nothing after the last token
            streamed.setdefault(e.request_id, []).append(e.token)
            if e.finish_reason is not None:
                finished[e.request_id] = e.finish_reason
    res = session.close()
    assert not pending and streamed == res.outputs == alone(reqs)
    assert finished == res.finish_reasons
    assert res.peak_running > 1
    assert pool.num_free == pool.num_blocks


def test_ttft_and_latency_are_timed_from_each_requests_submission():
    ticks = iter(range(1000))
    pool = make_pool(40)
    session = GenerationSession(
        ToyModel(pool, VOCAB, seed=3), pool, max_model_len=64, clock=lambda: float(next(ticks))
    )
    session.add(GenerationRequest(0, [1, 2, 3], 4))  # clock 0
    session.step()  # clock 1: request 0's first token
    session.add(GenerationRequest(1, [4, 5], 2))  # clock 2
    while not session.idle:
        session.step()  # clocks 3, 4, 5: request 1's first token at 3
    res = session.close()
    assert res.ttft_s == {0: 1.0, 1: 1.0}
    assert res.latency_s == {0: 5.0, 1: 2.0}  # 0: 4 tokens at clocks 1, 3, 4, 5


def test_a_session_refuses_what_it_cannot_serve():
    pool = make_pool(8)
    session = GenerationSession(ToyModel(pool, VOCAB), pool, max_model_len=10)
    session.add(GenerationRequest(0, [1, 2], 3))
    with pytest.raises(ValueError, match="duplicate"):
        session.add(GenerationRequest(0, [1, 2], 3))
    with pytest.raises(ValueError, match="exceed max_model_len 10"):
        session.add(GenerationRequest(1, [1] * 8, 3))
    with pytest.raises(RuntimeError, match="still running"):
        session.close()
    for _ in session.stream():
        pass
    assert session.close().outputs.keys() == {0}
