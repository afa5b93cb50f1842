"""Continuous-batching generation over a kvpool pool, driven by kvpool.scheduler.

Every step the scheduler decides, on the real pool and block tables, which running sequences
decode a token, which prompts get a prefill chunk, which waiting requests join and which are
preempted when the pool runs dry (by recompute, or by swap into a host tier when a swapper is
given: a swapped request resumes decoding from its copied-back KV, without a prefill); the model runner then executes exactly that
step. Requests finish (EOS or max_new_tokens) between steps and their blocks return at once.

Mapping onto the scheduler's units (scheduler/request.py: `prompt_tokens` are prefilled, then
`output_tokens` decodes each emit one token): a model runner samples decode rows only, so the
prompt's last token is fed by the first decode. A request with a prompt of P tokens and
max_new_tokens N is a scheduler request of P - 1 prefilled tokens and N decodes; the first
decode emits the first output token, each later one feeds the previous output token. So the KV
a sequence holds is always its known tokens minus the last one, and a preempted sequence
re-prefills exactly that. Every request is there when the loop starts (arrival 0 on the
scheduler's clock, which counts steps here).

The scheduler finishes a sequence in the step of its N-th decode, before the model has run
that step; `_StepKv` keeps the sequence's blocks and table row until the step has run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

import kvpool
from kvpool.generation.batch import StepBatch, build_step
from kvpool.scheduler.core import Scheduler, SchedulerConfig, Swapper
from kvpool.scheduler.paged import PagedKv
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
    token (int64) of each of the batch.num_decode decode rows."""

    def run(self, batch: StepBatch) -> np.ndarray: ...


@dataclass(slots=True)
class GenerationResult:
    outputs: dict[int, list[int]]  # request_id -> generated tokens
    finish_reasons: dict[int, str]  # "eos" or "length"
    num_steps: int = 0
    peak_running: int = 0
    num_preemptions: int = 0
    running_per_step: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.outputs.values())


class _StepKv(PagedKv):
    """PagedKv whose sequences finished by their last decode keep their blocks until
    `release_finished()`, which the loop calls once the model has run the step: that step still
    reads and writes their KV, so its prefills must not be given their blocks. A preempted or
    stopped sequence is not in the step it leaves and is released at once."""

    def __init__(self, pool: kvpool.Pool, max_seqs: int, max_model_len: int) -> None:
        # Room for max_seqs running rows plus as many rows held by sequences that just finished.
        super().__init__(pool, 2 * max_seqs, max_model_len)
        self._finished: list[Seq] = []

    def release(self, seq: Seq) -> None:
        if seq.generated == seq.request.output_tokens:
            self._finished.append(seq)
        else:
            super().release(seq)

    def release_finished(self) -> None:
        for seq in self._finished:
            super().release(seq)
        self._finished.clear()


def _check(requests: Sequence[GenerationRequest], max_model_len: int | None) -> None:
    for r in requests:
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


def scheduler_request(r: GenerationRequest) -> Request:
    """What the scheduler serves for `r` (module docstring): P - 1 prefilled tokens, N decodes."""
    return Request(r.request_id, 0.0, len(r.prompt) - 1, r.max_new_tokens)


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
) -> GenerationResult:
    """Serve every request to completion through `runner` on `pool` (all its blocks free at
    the start, and again at the end: checked). Returns the generated tokens per request.
    `make_swapper(backend)` (e.g. a kvpool.scheduler.swap.HostTierSwapper over the backend's
    tables) lets preemption swap into a host tier; its tier is checked drained at the end."""
    _check(requests, max_model_len)
    longest = max((len(r.prompt) + r.max_new_tokens for r in requests), default=2)
    config = SchedulerConfig(
        max_model_len=max_model_len or max(longest, 2),
        max_running_seqs=max_running_seqs,
        max_tokens_per_step=max_tokens_per_step,
        watermark=watermark,
        policy=policy,
    )
    backend = _StepKv(pool, max_running_seqs, config.max_model_len)
    swapper = None if make_swapper is None else make_swapper(backend)
    sched = Scheduler(
        backend,
        [scheduler_request(r) for r in requests],
        config,
        swapper=swapper,
    )
    by_id = {r.request_id: r for r in requests}
    tokens = {r.request_id: list(r.prompt) for r in requests}
    result = GenerationResult({r.request_id: [] for r in requests}, {})
    while not sched.done:
        if sched.step_index >= config.max_steps:
            raise RuntimeError(f"no completion after {sched.step_index} steps")
        sched.step()
        plan = sched.last_plan
        # A decode feeds the last known token (a sequence that finished in this step has
        # had its kv_tokens reset already, so the position comes from the tokens).
        decode = [
            (s.request_id, tokens[s.request_id][-1], len(tokens[s.request_id]) - 1)
            for s in plan.decode
        ]
        prefill = [
            (s.request_id, tokens[s.request_id][start : start + n], start)
            for s, start, n in plan.prefill
        ]
        result.num_steps += 1
        result.running_per_step.append(len(sched.running))
        result.peak_running = max(result.peak_running, len(sched.running))
        if not decode and not prefill:
            backend.release_finished()
            continue
        reqs = [by_id[d[0]] for d in decode]
        batch = build_step(
            backend.tables, decode, prefill, [r.temperature for r in reqs], [r.seed for r in reqs]
        )
        new = runner.run(batch)
        backend.release_finished()
        for seq, token in zip(plan.decode, np.asarray(new).tolist()):
            r = by_id[seq.request_id]
            tokens[r.request_id].append(int(token))
            out = result.outputs[r.request_id]
            out.append(int(token))
            if int(token) in r.eos_token_ids:
                result.finish_reasons[r.request_id] = "eos"
                if seq.running:  # not already finished by its N-th decode
                    sched.stop(seq)
            elif len(out) == r.max_new_tokens:  # the scheduler finished it in this step
                result.finish_reasons[r.request_id] = "length"
    result.num_preemptions = sched.num_preemptions
    backend.check_drained()
    if swapper is not None:
        swapper.check_drained()
    return result
