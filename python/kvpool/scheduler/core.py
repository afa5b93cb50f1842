"""The continuous-batching loop, shared by the paged and the contiguous scheduler.

One call to `Scheduler.step()` is one forward pass of the model:

1. requests whose arrival time has come join the waiting queue;
2. every running sequence that has finished its prefill decodes one token, with one batched
   call to the KV backend; if the backend lacks room, the policy's victim is preempted until
   the batch fits: by recompute (its KV is freed, it goes back to the waiting queue and later
   re-prefills its prompt plus the tokens it had generated) or, with a swapper (swap.py), by
   swap (its KV moves to the host tier and comes back when it is readmitted, no prefill);
3. sequences still in prefill get the next chunk of their prompt, within the token budget
   (chunked prefill), preempting victims the same way when the pool is dry;
4. waiting sequences are admitted in policy order while the budget, the running limit and
   the backend allow it; admission stops at the first one that does not fit (no skipping,
   so the policy order is the admission order). A backend with a prefix cache reports the
   leading tokens it holds already (`seq.num_cached_tokens`); the prefill starts after them.

Semantics of a request: its prompt is prefilled (possibly over several steps), then it decodes
`output_tokens` steps, each appending one token of KV and emitting one token. Time is modelled
(kvpool.sim.costmodel); wall-clock time of the simulator and of the allocator calls is measured.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvpool.scheduler.metrics import StepMetrics
from kvpool.scheduler.policies import Policy, make_policy
from kvpool.scheduler.request import Request
from kvpool.scheduler.seq import Seq


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_model_len: int = 4096
    max_running_seqs: int = 256
    max_tokens_per_step: int = 2048  # decode tokens + prefill chunk tokens per step
    watermark: float = 0.01  # fraction of the pool's blocks admission leaves free for growth
    policy: str = "fcfs"
    max_steps: int = 10_000_000  # a guard against a scheduler that stops making progress

    def validate(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_running_seqs < 1:
            raise ValueError(f"max_running_seqs must be >= 1, got {self.max_running_seqs}")
        if self.max_tokens_per_step < self.max_running_seqs:
            raise ValueError(
                f"max_tokens_per_step ({self.max_tokens_per_step}) must be >= max_running_seqs "
                f"({self.max_running_seqs}): every running sequence decodes one token per step"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        make_policy(self.policy)


@dataclass(slots=True)
class StepPlan:
    """What one `Scheduler.step()` asked of the model: the sequences that decode one token and
    the prefill chunks `(seq, start, num_tokens)`, after this step's preemptions. A real model
    runs exactly this; the simulator only counts it."""

    decode: list[Seq]
    prefill: list[tuple[Seq, int, int]]


class KvBackend(Protocol):
    """Where the KV of running sequences lives. Implementations time their allocator calls."""

    name: str
    alloc_s: float  # seconds spent in allocator calls, accumulated; the scheduler reads it

    def validate(self, config: SchedulerConfig) -> None: ...
    def try_admit(
        self, seq: Seq, first_chunk: int, watermark_blocks: int
    ) -> bool: ...  # sets seq.num_cached_tokens
    def prefill_shortfall(self, seq: Seq, n: int) -> int: ...
    def extend(self, seq: Seq, n: int) -> None: ...
    def decode_shortfall(self, seqs: Sequence[Seq]) -> int: ...
    def decode(self, seqs: Sequence[Seq]) -> None: ...
    def release(self, seq: Seq) -> None: ...
    def usage(self) -> tuple[int, int]: ...  # (blocks used, token slots allocated)
    def watermark_blocks(self, fraction: float) -> int: ...
    def check_drained(self) -> None: ...


class Swapper(Protocol):
    """Preemption by swap (swap.HostTierSwapper): optional; without one, every preemption
    recomputes."""

    def preempt(self, seq: Seq) -> bool: ...  # True: swapped out; False: recompute it
    def try_swap_in(self, seq: Seq, watermark_blocks: int) -> bool: ...
    def take_copy_seconds(self) -> float: ...  # modelled copy time to add to this step
    def check_drained(self) -> None: ...
    def summary(self) -> dict[str, object]: ...  # the host-tier figures of the report


StepCost = Callable[[int, int, int], float]  # (prefill tokens, decode seqs, KV tokens read) -> s
# Called after each decode step with the step's (block table, seq_lens), e.g. to time the
# attention kernel over them (kvpool.sim.measured.DecodeProbe).
DecodeObserver = Callable[[np.ndarray, np.ndarray], object]


class Scheduler:
    """Continuous batching over one KV backend. `run()` serves a whole workload."""

    def __init__(
        self,
        backend: KvBackend,
        requests: Sequence[Request],
        config: SchedulerConfig = SchedulerConfig(),
        step_cost: StepCost | None = None,
        record_events: bool = False,
        swapper: Swapper | None = None,
    ) -> None:
        config.validate()
        backend.validate(config)
        self.config = config
        self._ids: set[int] = set()
        for r in requests:
            self._check_request(r)
            self._ids.add(r.request_id)
        self.backend = backend
        self.policy: Policy = make_policy(config.policy)
        self.step_cost = step_cost or (lambda prefill, decode, kv: 1.0)
        self.seqs = [Seq(r) for r in sorted(requests, key=lambda r: (r.arrival_s, r.request_id))]
        self._next_arrival = 0
        self.waiting: list[tuple[tuple, int, Seq]] = []  # heap by (admission key, request id)
        self.running: list[Seq] = []  # admission order
        self.now_s = 0.0
        self.step_index = 0
        self.num_finished = 0
        self.num_preemptions = 0
        self.swapper = swapper
        self.recomputed_tokens = 0  # tokens whose KV a recompute preemption dropped
        self.num_queried_tokens = 0  # tokens to prefill at admission (prefix cache queries)
        self.num_cached_tokens = 0  # of which the backend's prefix cache held the KV
        self.metrics = StepMetrics()
        self.events: list[tuple] | None = [] if record_events else None
        self._watermark_blocks = backend.watermark_blocks(config.watermark)
        self.last_plan = StepPlan([], [])

    def _check_request(self, r: Request) -> None:
        if r.request_id in self._ids:
            raise ValueError(f"duplicate request id {r.request_id}: every request needs its own id")
        if r.prompt_tokens + r.output_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {r.request_id}: prompt {r.prompt_tokens} + output {r.output_tokens} "
                f"tokens exceed max_model_len {self.config.max_model_len}"
            )

    def add(self, request: Request) -> None:
        """Submit a request while the scheduler runs (an online arrival): it joins the
        waiting queue at the first step at or after its arrival_s, which must not be before
        the arrival of any request submitted already."""
        self._check_request(request)
        last = self.seqs[-1].request.arrival_s if self.seqs else 0.0
        if request.arrival_s < last:
            raise ValueError(
                f"request {request.request_id} arrives at {request.arrival_s}, before the last "
                f"submitted one ({last})"
            )
        self._ids.add(request.request_id)
        self.seqs.append(Seq(request))

    # ---- bookkeeping ---------------------------------------------------------------------

    def _event(self, *event: object) -> None:
        if self.events is not None:
            self.events.append((self.step_index, *event))

    def _enqueue(self, seq: Seq) -> None:
        heapq.heappush(self.waiting, (self.policy.admission_key(seq), seq.request_id, seq))

    def _arrive(self) -> None:
        seqs = self.seqs
        while (
            self._next_arrival < len(seqs)
            and seqs[self._next_arrival].request.arrival_s <= self.now_s
        ):
            seq = seqs[self._next_arrival]
            self._next_arrival += 1
            self._enqueue(seq)
            self._event("arrive", seq.request_id)

    def _preempt(self, victim: Seq) -> None:
        self._event("preempt", victim.request_id, tuple(s.request_id for s in self.running))
        plan = self.last_plan
        if victim in plan.decode:
            plan.decode.remove(victim)
        plan.prefill = [c for c in plan.prefill if c[0] is not victim]
        self.running.remove(victim)
        victim.running = False
        victim.num_preemptions += 1
        self.num_preemptions += 1
        if self.swapper is not None and self.swapper.preempt(victim):
            victim.swapped = True  # keeps its KV, prefill progress and decoding state
            self._event("swap_out", victim.request_id)
        else:
            self.backend.release(victim)
            self.recomputed_tokens += victim.kv_tokens
            victim.decoding = False
            victim.prefilled = victim.kv_tokens = 0
            victim.prefill_target = victim.request.prompt_tokens + victim.generated
        self._enqueue(victim)

    def _pick_victim(self) -> Seq:
        return max(self.running, key=self.policy.victim_key)

    def _finish(self, seq: Seq) -> None:
        self.backend.release(seq)
        seq.running = seq.decoding = False
        seq.kv_tokens = 0
        seq.num_finishes += 1
        self.num_finished += 1
        self._event("finish", seq.request_id)

    def stop(self, seq: Seq) -> None:
        """Finish a running sequence now (it met a stop condition the workload did not know,
        e.g. an end-of-sequence token): its KV is released before the next step."""
        if not seq.running:
            raise ValueError(f"request {seq.request_id} is not running")
        self.running.remove(seq)
        self._finish(seq)

    @property
    def done(self) -> bool:
        return self.num_finished == len(self.seqs)

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> None:
        """One forward pass: decode, continue prefills, admit; then advance the modelled clock."""
        wall0 = time.perf_counter()
        alloc0 = self.backend.alloc_s
        preempt0 = self.num_preemptions
        queried0, cached0 = self.num_queried_tokens, self.num_cached_tokens
        self.last_plan = StepPlan([], [])
        self._arrive()
        if not self.running and not self.waiting and self._next_arrival < len(self.seqs):
            self.now_s = self.seqs[self._next_arrival].request.arrival_s  # idle until the next one
            self._arrive()
        budget = self.config.max_tokens_per_step
        decoded = self._decode()
        budget -= len(decoded)
        finished = [s for s in decoded if s.generated == s.request.output_tokens]
        for seq in finished:  # their blocks are free for this step's prefills
            self.running.remove(seq)
            self._finish(seq)
        prefill_tokens = self._continue_prefills(budget)
        prefill_tokens += self._admit(budget - prefill_tokens)
        kv_tokens = sum(s.kv_tokens for s in self.running)
        dt = self.step_cost(prefill_tokens, len(decoded), kv_tokens)
        if self.swapper is not None:
            dt += self.swapper.take_copy_seconds()
        end_s = self.now_s + dt
        for seq in decoded:
            if seq.generated == 1:
                seq.first_token_s = end_s
        for seq in finished:
            seq.finish_s = end_s
        self.now_s = end_s
        blocks, slots = self.backend.usage()
        self.metrics.record(
            time_s=end_s,
            running=len(self.running),
            waiting=len(self.waiting),
            preempted=self.num_preemptions - preempt0,
            blocks_used=blocks,
            tokens_stored=kv_tokens,
            slots_allocated=slots,
            prefill_tokens=prefill_tokens,
            decode_tokens=len(decoded),
            queried_tokens=self.num_queried_tokens - queried0,
            cached_tokens=self.num_cached_tokens - cached0,
            alloc_s=self.backend.alloc_s - alloc0,
            wall_s=time.perf_counter() - wall0,
        )
        self.step_index += 1

    def _mark_scheduled(self, seq: Seq) -> None:
        seq.last_scheduled_s = self.now_s
        seq.times_scheduled += 1

    def _decode(self) -> list[Seq]:
        batch = [s for s in self.running if s.decoding]
        while batch and self.backend.decode_shortfall(batch) > 0:
            victim = self._pick_victim()
            self._preempt(victim)
            if victim in batch:
                batch.remove(victim)
        if batch:
            self.backend.decode(batch)
        self.last_plan.decode = list(batch)
        for seq in batch:
            seq.kv_tokens += 1
            seq.generated += 1
            self._mark_scheduled(seq)
        return batch

    def _continue_prefills(self, budget: int) -> int:
        used = 0
        for seq in [s for s in self.running if not s.decoding]:
            if used >= budget:
                break
            if not seq.running:  # preempted by an earlier sequence of this loop
                continue
            n = min(seq.prefill_target - seq.prefilled, budget - used)
            while self.backend.prefill_shortfall(seq, n) > 0:
                victim = self._pick_victim()
                self._preempt(victim)
                if victim is seq:
                    break
            if not seq.running:
                continue
            self.backend.extend(seq, n)
            self._prefilled(seq, n)
            used += n
        return used

    def _prefilled(self, seq: Seq, n: int) -> None:
        if n:
            self.last_plan.prefill.append((seq, seq.prefilled, n))
        seq.prefilled += n
        seq.kv_tokens += n
        self._mark_scheduled(seq)
        if seq.prefilled == seq.prefill_target:
            seq.decoding = True

    def _admit(self, budget: int) -> int:
        used = 0
        limit = self.config.max_running_seqs
        while self.waiting and len(self.running) < limit and used < budget:
            seq = self.waiting[0][2]
            n = min(seq.prefill_target, budget - used)
            watermark = self._watermark_blocks if self.running else 0  # an idle pool admits anyone
            if seq.swapped:
                if not self._swap_in(seq, watermark):
                    break
                continue
            if not self.backend.try_admit(seq, n, watermark):
                self._event("blocked", seq.request_id)
                break
            heapq.heappop(self.waiting)
            self._event("admit", seq.request_id)
            seq.running = True
            self.running.append(seq)
            n = self._skip_cached(seq, budget - used)
            self._prefilled(seq, n)
            used += n
        return used

    def _swap_in(self, seq: Seq, watermark: int) -> bool:
        """Readmit a swapped-out sequence: its blocks come back, it uses no prefill budget."""
        assert self.swapper is not None
        if not self.swapper.try_swap_in(seq, watermark):
            self._event("blocked", seq.request_id)
            return False
        heapq.heappop(self.waiting)
        self._event("swap_in", seq.request_id)
        seq.swapped = False
        seq.running = True
        self.running.append(seq)
        return True

    def _skip_cached(self, seq: Seq, budget: int) -> int:
        """Prompt tokens the backend found in its prefix cache at admission need no prefill:
        the sequence starts after them. Returns the first chunk to compute within `budget`."""
        cached = seq.num_cached_tokens
        self.num_queried_tokens += seq.prefill_target
        self.num_cached_tokens += cached
        seq.prefilled = seq.kv_tokens = cached
        return min(seq.prefill_target - cached, budget)

    # ---- the whole run -------------------------------------------------------------------

    def run(self, progress: Callable[[int, int], None] | None = None) -> StepMetrics:
        """Step until every request has finished; `progress(finished, total)` after each step."""
        while not self.done:
            if self.step_index >= self.config.max_steps:
                raise RuntimeError(
                    f"{self.backend.name}: no completion after {self.step_index} steps"
                )
            self.step()
            if progress is not None:
                progress(self.num_finished, len(self.seqs))
        return self.metrics
