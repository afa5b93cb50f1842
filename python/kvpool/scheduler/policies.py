"""Admission order and victim choice, as pluggable policies.

A policy gives two keys for a sequence. Admission takes the waiting sequence with the smallest
`admission_key`; preemption takes the running sequence with the largest `victim_key`. Keys are
built only from fields that do not change while a sequence waits, so the waiting queue can be a
heap. Ties always fall back to arrival time and then request id, so every order is total.

- fcfs: first come, first admitted; the latest arrival is preempted first (vLLM's default).
- priority: lowest priority value first; the highest value (then the latest arrival) is preempted.
- lru: the least recently scheduled sequence goes first, both into the batch and out of it.
  A sequence that has never run counts its arrival as its last use, so a preempted sequence is
  readmitted before requests that arrived after it was preempted.
- lfu: the least frequently scheduled (fewest steps run) goes first, both ways; preempting it
  throws away the least work.
"""

from __future__ import annotations

from typing import Protocol

from kvpool.scheduler.seq import Seq


class Policy(Protocol):
    name: str

    def admission_key(self, seq: Seq) -> tuple: ...

    def victim_key(self, seq: Seq) -> tuple: ...


class Fcfs:
    name = "fcfs"

    def admission_key(self, seq: Seq) -> tuple:
        return (seq.request.arrival_s, seq.request.request_id)

    def victim_key(self, seq: Seq) -> tuple:
        return (seq.request.arrival_s, seq.request.request_id)


class Priority:
    name = "priority"

    def admission_key(self, seq: Seq) -> tuple:
        return (seq.request.priority, seq.request.arrival_s, seq.request.request_id)

    def victim_key(self, seq: Seq) -> tuple:
        return (seq.request.priority, seq.request.arrival_s, seq.request.request_id)


class Lru:
    name = "lru"

    def admission_key(self, seq: Seq) -> tuple:
        return (seq.last_scheduled_s, seq.request.arrival_s, seq.request.request_id)

    def victim_key(self, seq: Seq) -> tuple:
        return (-seq.last_scheduled_s, seq.request.arrival_s, seq.request.request_id)


class Lfu:
    name = "lfu"

    def admission_key(self, seq: Seq) -> tuple:
        return (seq.times_scheduled, seq.request.arrival_s, seq.request.request_id)

    def victim_key(self, seq: Seq) -> tuple:
        return (-seq.times_scheduled, seq.request.arrival_s, seq.request.request_id)


POLICIES: dict[str, type] = {p.name: p for p in (Fcfs, Priority, Lru, Lfu)}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
