"""Continuous-batching generation over a kvpool pool, driven by kvpool.scheduler.

Every step the scheduler decides, on the real pool and block tables, which running sequences
decode a token, which prompts get a prefill chunk, which waiting requests join and which are
preempted when the pool runs dry (by recompute, or by swap into a host tier when a swapper is
given: a swapped request resumes decoding from its copied-back KV, without a prefill); the
model runner then executes exactly that step. Requests finish (EOS or max_new_tokens) between
steps and their blocks return at once.

Two forms: `generate(runner, pool, requests)` serves a fixed list to completion;
`GenerationSession` is the online form: `add()` a request at any time, `step()` runs one
forward pass and returns the tokens it produced (`TokenEvent`s), `close()` checks the pool
and returns the result. Both time every request on the wall clock (TTFT and latency, from
its submission).

Mapping onto the scheduler's units (scheduler/request.py: `prompt_tokens` are prefilled, then
`output_tokens` decodes each emit one token): the chunk that completes a prompt samples the
first output token from its last row, as a real server does; each decode feeds the previous
output token and emits the next. A request with a prompt of P tokens and max_new_tokens N is a
scheduler request of P prefilled tokens and N - 1 decodes. So the KV a sequence holds is
always its known tokens minus the last one, and a preempted sequence re-prefills exactly that
(its re-prefill samples nothing: the next token is known).

On a pool made with enable_prefix_caching=True the backend adds each request with its token
ids (kvpool.scheduler.prefix): the cached blocks of its longest cached prefix are reused and
the prefill starts after them, and the blocks its prompt and answer fill are cached in turn.

The scheduler finishes a sequence in the step of its last decode, before the model has run
that step; the backend keeps the sequence's blocks and table row until the step has run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

import kvpool
from kvpool.generation.batch import StepBatch, build_step
from kvpool.generation.hybrid_batch import build_hybrid_step
from kvpool.scheduler.core import Scheduler, SchedulerConfig, Swapper
from kvpool.scheduler.hybrid import HybridKv
from kvpool.scheduler.paged import PagedKv
from kvpool.scheduler.prefix import PrefixCachedKv
from kvpool.scheduler.request import Request
from kvpool.scheduler.seq import Seq


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A prompt (token ids) and how to continue it. temperature 0 is greedy decoding."""

    request_id: int
    prompt: Sequence[int]
    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    seed: int = 0


class ModelRunner(Protocol):
    """Runs one step on the pool the loop was given: writes the step's K/V at
    batch.slot_mapping in every layer, attends over the paged cache, and returns the sampled
    token (int64) of each of the batch's sampled rows (batch.sample_rows: the decode rows,
    then the last row of each prefill chunk that completes a prompt)."""

    def run(self, batch: StepBatch) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One token a step produced for a request; `finish_reason` ("eos" or "length") on the
    request's last token, None before."""

    request_id: int
    token: int
    finish_reason: str | None = None


@dataclass(slots=True)
class GenerationResult:
    outputs: dict[int, list[int]]  # request_id -> generated tokens
    finish_reasons: dict[int, str]  # "eos" or "length"
    num_steps: int = 0
    peak_running: int = 0
    num_preemptions: int = 0
    running_per_step: list[int] = field(default_factory=list)
    # Wall-clock seconds from a request's submission to its first token / its last token
    # (the step that produced it returned).
    ttft_s: dict[int, float] = field(default_factory=dict)
    latency_s: dict[int, float] = field(default_factory=dict)
    # Tokens the admissions asked to prefill (prompts, and recomputed KV after preemption),
    # and of those the ones found in the pool's prefix cache (0 without prefix caching).
    num_queried_tokens: int = 0
    num_cached_tokens: int = 0
    # Tokens the model ran a prefill for (queried minus cached).
    num_prefill_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.outputs.values())


class _StepRelease:
    """Mixin of the loop's backends: a sequence the scheduler finishes during a step (by its
    last decode) keeps its blocks until `release_finished()`, which the loop calls once the
    model has run the step: that step still reads and writes its KV, so the step's prefills
    must not be given its blocks. Everything else (a preemption, a stop between steps) is
    released at once. The scheduler releases a finished sequence while it is still marked
    running, a preempted one after clearing the mark."""

    in_step = False
    _finished: list[Seq]

    def release(self, seq: Seq) -> None:
        if self.in_step and seq.running:
            self._finished.append(seq)
        else:
            super().release(seq)  # type: ignore[misc]

    def release_finished(self) -> None:
        for seq in self._finished:
            super().release(seq)  # type: ignore[misc]
        self._finished.clear()


class _StepKv(_StepRelease, PagedKv):
    def __init__(self, pool: kvpool.Pool, max_seqs: int, max_model_len: int) -> None:
        # Room for max_seqs running rows plus as many rows held by sequences that just finished.
        super().__init__(pool, 2 * max_seqs, max_model_len)
        self._finished = []


class _StepPrefixKv(_StepRelease, PrefixCachedKv):
    """The prefix-cached backend over the loop's own token lists: a request is added with
    everything it knows (prompt, and after a preemption its outputs so far) and each decode
    appends the token it feeds, so the blocks a prompt and an answer fill are cached."""

    def __init__(
        self, pool: kvpool.Pool, max_seqs: int, max_model_len: int, tokens: dict[int, list[int]]
    ) -> None:
        super().__init__(pool, 2 * max_seqs, max_model_len)
        self._finished = []
        self._tokens = tokens

    def _token_ids(self, seq: Seq) -> list[int]:  # type: ignore[override]
        # The loop's live list: the decodes of later steps index the tokens appended meanwhile.
        return self._tokens[seq.request_id]


class _StepHybridKv(_StepRelease, HybridKv):
    """The hybrid backend (one table per group of a ModelKvSpec, window groups holding only
    their live pages) with the loop's release at the end of a step."""

    def __init__(self, pool: kvpool.Pool, spec: kvpool.ModelKvSpec) -> None:
        super().__init__(pool, spec)
        self._finished = []


def _check(r: GenerationRequest, max_model_len: int | None) -> None:
    if len(r.prompt) < 1:
        raise ValueError(f"request {r.request_id}: the prompt is empty")
    if isinstance(r.max_new_tokens, bool) or r.max_new_tokens < 1:
        raise ValueError(f"request {r.request_id}: max_new_tokens must be >= 1")
    if r.temperature < 0:
        raise ValueError(f"request {r.request_id}: temperature must be >= 0")
    if max_model_len is not None and len(r.prompt) + r.max_new_tokens > max_model_len:
        raise ValueError(
            f"request {r.request_id}: prompt {len(r.prompt)} + max_new_tokens "
            f"{r.max_new_tokens} tokens exceed max_model_len {max_model_len}"
        )


def scheduler_request(r: GenerationRequest, arrival_s: float = 0.0) -> Request:
    """What the scheduler serves for `r` (module docstring): P prefilled tokens, whose last
    row samples the first output, then N - 1 decodes."""
    return Request(r.request_id, arrival_s, len(r.prompt), r.max_new_tokens - 1)


class GenerationSession:
    """Online continuous batching through `runner` on `pool` (all its blocks free at the
    start; with prefix caching, none used): `add()` requests at any time, `step()` one forward
    pass at a time (it returns the step's tokens), `stream()` steps until every added request
    has finished, yielding each step's tokens; `close()` checks that every block came back
    and returns the GenerationResult. max_model_len (prompt + new tokens of any request) fixes
    the block tables' width. `make_swapper(backend)` (e.g. a kvpool.scheduler.swap.
    HostTierSwapper over the backend's tables) lets preemption swap into a host tier.
    `clock` (seconds) times TTFT and latency. `spec` (a kvpool.ModelKvSpec, e.g. a hybrid
    runner's `runner.spec`) serves a hybrid model: the requests hold one table per group of
    the spec in `pool` (a pool of its pages) through kvpool.HybridTables, and the runner is
    given kvpool.generation.hybrid_batch.HybridStepBatch steps; no swapper, no prefix
    caching."""

    def __init__(
        self,
        runner: ModelRunner,
        pool: kvpool.Pool,
        *,
        max_model_len: int,
        max_running_seqs: int = 256,
        max_tokens_per_step: int = 2048,
        policy: str = "fcfs",
        watermark: float = 0.01,
        make_swapper: Callable[[PagedKv], Swapper] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        spec: kvpool.ModelKvSpec | None = None,
    ) -> None:
        self.config = SchedulerConfig(
            max_model_len=max(max_model_len, 2),
            max_running_seqs=max_running_seqs,
            max_tokens_per_step=max_tokens_per_step,
            watermark=watermark,
            policy=policy,
        )
        self.runner, self.pool, self.clock = runner, pool, clock
        self._tokens: dict[int, list[int]] = {}  # request -> prompt + outputs so far
        self.backend: _StepKv | _StepPrefixKv | _StepHybridKv
        if spec is not None:
            if make_swapper is not None or pool.prefix_caching:
                raise ValueError("a hybrid spec runs without a swapper and without prefix caching")
            self.backend = _StepHybridKv(pool, spec)
        elif pool.prefix_caching:
            self.backend = _StepPrefixKv(
                pool, max_running_seqs, self.config.max_model_len, self._tokens
            )
        else:
            self.backend = _StepKv(pool, max_running_seqs, self.config.max_model_len)
        self.swapper = None
        if make_swapper is not None and not isinstance(self.backend, _StepHybridKv):
            self.swapper = make_swapper(self.backend)
        self.scheduler = Scheduler(self.backend, [], self.config, swapper=self.swapper)
        self._requests: dict[int, GenerationRequest] = {}
        self._submitted_s: dict[int, float] = {}
        self.result = GenerationResult({}, {})

    def add(self, request: GenerationRequest) -> None:
        """Submit a request; it joins at the next step."""
        _check(request, self.config.max_model_len)
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        self.scheduler.add(scheduler_request(request, self.scheduler.now_s))
        rid = request.request_id
        self._requests[rid] = request
        self._tokens[rid] = list(request.prompt)
        self.result.outputs[rid] = []
        self._submitted_s[rid] = self.clock()

    @property
    def idle(self) -> bool:
        """Every request added so far has finished."""
        return self.scheduler.done

    def step(self) -> list[TokenEvent]:
        """One forward pass; the tokens it produced, in the batch's row order."""
        sched, backend, result = self.scheduler, self.backend, self.result
        if sched.done:
            return []
        if sched.step_index >= self.config.max_steps:
            raise RuntimeError(f"no completion after {sched.step_index} steps")
        backend.in_step = True
        try:
            sched.step()
        finally:
            backend.in_step = False
        plan, tokens = sched.last_plan, self._tokens
        result.num_steps += 1
        result.running_per_step.append(len(sched.running))
        result.peak_running = max(result.peak_running, len(sched.running))
        # A decode feeds the last known token (a sequence that finished in this step has
        # had its kv_tokens reset already, so the position comes from the tokens).
        decode = [
            (s.request_id, tokens[s.request_id][-1], len(tokens[s.request_id]) - 1)
            for s in plan.decode
        ]
        prefill = [(s.request_id, tokens[s.request_id][a : a + n], a) for s, a, n in plan.prefill]
        # A chunk that completes a prompt samples the first output token; a re-prefill after
        # a preemption completes known tokens and samples nothing.
        first = [
            a + n == s.prefill_target and not result.outputs[s.request_id]
            for s, a, n in plan.prefill
        ]
        sampled = list(plan.decode) + [c[0] for c, f in zip(plan.prefill, first) if f]
        if not decode and not prefill:
            backend.release_finished()
            return []
        reqs = [self._requests[s.request_id] for s in sampled]
        temps, seeds = [r.temperature for r in reqs], [r.seed for r in reqs]
        if isinstance(backend, _StepHybridKv):
            hybrid = build_hybrid_step(backend.tables, decode, prefill, temps, seeds, first)
            # A hybrid session's runner (spec=) runs HybridStepBatch steps.
            new = np.asarray(self.runner.run(hybrid)).tolist()  # type: ignore[arg-type]
        else:
            batch = build_step(backend.tables, decode, prefill, temps, seeds, sample_prefill=first)
            new = np.asarray(self.runner.run(batch)).tolist()  # one token per sampled row
        backend.release_finished()
        now = self.clock()
        return [self._emit(seq, int(token), now) for seq, token in zip(sampled, new)]

    def _emit(self, seq: Seq, token: int, now: float) -> TokenEvent:
        rid = seq.request_id
        r, out, result = self._requests[rid], self.result.outputs[rid], self.result
        self._tokens[rid].append(token)
        out.append(token)
        if len(out) == 1:
            result.ttft_s[rid] = now - self._submitted_s[rid]
        reason = None
        if token in r.eos_token_ids:
            reason = "eos"
        elif len(out) == r.max_new_tokens:
            reason = "length"
        if reason is not None:
            result.finish_reasons[rid] = reason
            result.latency_s[rid] = now - self._submitted_s[rid]
            if seq.running:  # not already finished by the scheduler (its last decode)
                self.scheduler.stop(seq)
        return TokenEvent(rid, token, reason)

    def stream(self) -> Iterator[list[TokenEvent]]:
        """Step until every request added so far (or while iterating) has finished, yielding
        each step's tokens."""
        while not self.idle:
            yield self.step()

    def close(self) -> GenerationResult:
        """Check that every request finished and every block came back (the host tier's too),
        and return the result. With prefix caching the cache is reset here."""
        if not self.idle:
            raise RuntimeError("requests are still running: step until idle before close")
        sched, result = self.scheduler, self.result
        result.num_preemptions = sched.num_preemptions
        result.num_queried_tokens = sched.num_queried_tokens
        result.num_cached_tokens = sched.num_cached_tokens
        result.num_prefill_tokens = sched.num_queried_tokens - sched.num_cached_tokens
        self.backend.check_drained()
        if self.swapper is not None:
            self.swapper.check_drained()
        return result


def generate(
    runner: ModelRunner,
    pool: kvpool.Pool,
    requests: Sequence[GenerationRequest],
    *,
    max_running_seqs: int = 256,
    max_tokens_per_step: int = 2048,
    max_model_len: int | None = None,
    policy: str = "fcfs",
    watermark: float = 0.01,
    make_swapper: Callable[[PagedKv], Swapper] | None = None,
    spec: kvpool.ModelKvSpec | None = None,
) -> GenerationResult:
    """Serve every request to completion through `runner` on `pool` (all its blocks free at
    the start, and again at the end: checked), all submitted at once. Returns the generated
    tokens per request, their TTFT and latency. See GenerationSession for the arguments
    (`spec=` for a hybrid model)."""
    for r in requests:
        _check(r, max_model_len)
    longest = max((len(r.prompt) + r.max_new_tokens for r in requests), default=2)
    session = GenerationSession(
        runner,
        pool,
        max_model_len=max_model_len or longest,
        max_running_seqs=max_running_seqs,
        max_tokens_per_step=max_tokens_per_step,
        policy=policy,
        watermark=watermark,
        make_swapper=make_swapper,
        spec=spec,
    )
    for r in requests:
        session.add(r)
    for _ in session.stream():
        pass
    return session.close()
