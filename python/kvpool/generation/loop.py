"""Continuous-batching generation over a kvpool pool, driven by kvpool.scheduler.

Every step the scheduler decides, on the real pool and block tables, which running sequences
decode a token, which prompts get a prefill chunk, which waiting requests join and which are
preempted when the pool runs dry (by recompute, or by swap into a host tier when a swapper is
given: a swapped request resumes decoding from its copied-back KV, without a prefill); the model runner then executes exactly that
step. Requests finish (EOS or max_new_tokens) between steps and their blocks return at once.

Mapping onto the scheduler's units: a request with a prompt of P tokens is a scheduler request
of P - 1 prompt tokens; its first decode feeds the last prompt token and emits the first output
token, each later decode feeds the previous output token. So the KV a sequence holds is always
its known tokens minus the last one, and a preempted sequence re-prefills exactly that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvpool.generation.batch import StepBatch, build_step
from kvpool.scheduler.core import Scheduler, SchedulerConfig, Swapper
from kvpool.scheduler.paged import PagedKv
from kvpool.scheduler.request import Request


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


def _check(requests: Sequence[GenerationRequest]) -> None:
    for r in requests:
        if len(r.prompt) < 1:
            raise ValueError(f"request {r.request_id}: the prompt is empty")
        if isinstance(r.max_new_tokens, bool) or r.max_new_tokens < 1:
            raise ValueError(f"request {r.request_id}: max_new_tokens must be >= 1")
        if r.temperature < 0:
            raise ValueError(f"request {r.request_id}: temperature must be >= 0")


def generate(
    runner: ModelRunner,
    pool,
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
    _check(requests)
    longest = max((len(r.prompt) + r.max_new_tokens for r in requests), default=2)
    config = SchedulerConfig(
        max_model_len=max_model_len or max(longest, 2),
        max_running_seqs=max_running_seqs,
        max_tokens_per_step=max_tokens_per_step,
        watermark=watermark,
        policy=policy,
    )
    backend = PagedKv(pool, max_running_seqs, config.max_model_len)
    swapper = None if make_swapper is None else make_swapper(backend)
    sched = Scheduler(
        backend,
        [Request(r.request_id, 0.0, len(r.prompt) - 1, r.max_new_tokens + 1) for r in requests],
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
        decode = [
            (s.request_id, tokens[s.request_id][s.kv_tokens - 1], s.kv_tokens - 1)
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
            continue
        reqs = [by_id[d[0]] for d in decode]
        batch = build_step(
            backend.tables, decode, prefill, [r.temperature for r in reqs], [r.seed for r in reqs]
        )
        new = runner.run(batch)
        for seq, token in zip(plan.decode, np.asarray(new).tolist()):
            r = by_id[seq.request_id]
            tokens[r.request_id].append(int(token))
            out = result.outputs[r.request_id]
            out.append(int(token))
            if int(token) in r.eos_token_ids or len(out) == r.max_new_tokens:
                eos = int(token) in r.eos_token_ids
                result.finish_reasons[r.request_id] = "eos" if eos else "length"
                sched.stop(seq)
    result.num_preemptions = sched.num_preemptions
    backend.check_drained()
    if swapper is not None:
        swapper.check_drained()
    return result
