"""Seq: the serving state of one request, shared by the loop (core.py), the KV backends and the
policies (which read it to order admissions and pick victims)."""

from __future__ import annotations

from kvpool.scheduler.request import Request


class Seq:
    """The serving state of one request."""

    __slots__ = (
        "decoding",
        "finish_s",
        "first_token_s",
        "generated",
        "kv_tokens",
        "last_scheduled_s",
        "num_cached_tokens",
        "num_finishes",
        "num_preemptions",
        "prefill_target",
        "prefilled",
        "request",
        "running",
        "swapped",
        "times_scheduled",
    )

    def __init__(self, request: Request) -> None:
        self.request = request
        self.prefill_target = request.prompt_tokens  # prompt (+ generated tokens after preemption)
        self.prefilled = 0
        self.generated = 0
        self.kv_tokens = 0  # tokens whose KV the backend holds for this sequence
        self.decoding = False
        self.running = False
        self.last_scheduled_s = request.arrival_s
        self.times_scheduled = 0
        self.first_token_s = -1.0
        self.finish_s = -1.0
        self.num_preemptions = 0
        self.num_finishes = 0
        self.swapped = False  # preempted by swap: its KV waits on the host tier
        self.num_cached_tokens = 0  # of prefill_target, found in the prefix cache at admission

    @property
    def request_id(self) -> int:
        return self.request.request_id
