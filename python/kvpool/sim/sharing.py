"""Workloads whose requests share prompt prefixes: token streams and multi-turn conversations.

`with_token_streams` gives every request the token ids its sharing implies (tokens.py):
requests of one prefix group share their first `prefix_tokens` ids, and the turns of one
conversation read one stream, so each turn's prompt is the earlier turns' prompts and answers
followed by the new user tokens. `generate_multiturn` makes such conversations.

Turns arrive on a schedule (open loop, as recorded traces do): a conversation starts at an
arrival of the --rate process and each later turn arrives a think time (exponential, mean
`think_time_s`) after the one before, whether or not its answer has finished. A turn that
arrives before the previous answer is complete finds less of its context cached.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from kvpool.scheduler.request import Request
from kvpool.sim.tokens import ANSWER, PREFIX, USER, TokenStream, prefix_stream, private_stream
from kvpool.sim.workload import LENGTH_MODELS, TraceError, _lognormal, arrival_times

MULTITURN = "multiturn"
DEFAULT_TURNS = 4
DEFAULT_THINK_TIME_S = 10.0


def with_token_streams(requests: Iterable[Request], seed: int = 0) -> list[Request]:
    """The requests with token streams (those that have one keep it). Raises TraceError when
    a conversation's turn does not hold the previous turn (prompt shorter than the previous
    prompt + output) or its turns disagree on the prefix group."""
    requests = list(requests)
    conversations: dict[int, list[Request]] = defaultdict(list)
    out: dict[int, Request] = {}
    for r in requests:
        if r.tokens is not None:
            out[r.request_id] = r
        elif r.conversation_id >= 0:
            conversations[r.conversation_id].append(r)
        elif r.prefix_id >= 0:
            stream = prefix_stream(
                seed, r.request_id, r.prefix_id, r.prefix_tokens, r.prompt_tokens + r.output_tokens
            )
            out[r.request_id] = dataclasses.replace(r, tokens=stream)
        else:
            out[r.request_id] = dataclasses.replace(
                r, tokens=private_stream(seed, r.request_id, r.prompt_tokens + r.output_tokens)
            )
    for conversation, turns in conversations.items():
        stream = conversation_stream(seed, conversation, turns)
        for r in turns:
            out[r.request_id] = dataclasses.replace(r, tokens=stream)
    return [out[r.request_id] for r in requests]


def conversation_stream(seed: int, conversation: int, turns: list[Request]) -> TokenStream:
    """One stream for all turns: [system prefix], then user tokens and answer per turn."""
    turns = sorted(turns, key=lambda r: (r.arrival_s, r.request_id))
    first = turns[0]
    segments: list[tuple[tuple[int, ...], int]] = []
    held = 0  # tokens of the conversation so far
    if first.prefix_id >= 0 and first.prefix_tokens > 0:
        segments.append(((PREFIX, first.prefix_id), first.prefix_tokens))
        held = first.prefix_tokens
    for k, r in enumerate(turns):
        if (r.prefix_id, r.prefix_tokens) != (first.prefix_id, first.prefix_tokens):
            raise TraceError(
                f"conversation {conversation}: request {r.request_id} has another prefix group than its first turn"
            )
        new_user = r.prompt_tokens - held
        if new_user < 1:
            raise TraceError(
                f"conversation {conversation}: request {r.request_id} has prompt_tokens {r.prompt_tokens}, which "
                f"does not hold the {held} tokens of the earlier turns and their answers plus a new one"
            )
        segments += [
            ((USER, conversation, k), new_user),
            ((ANSWER, conversation, k), r.output_tokens),
        ]
        held = r.prompt_tokens + r.output_tokens
    return TokenStream(seed, tuple(segments))


def shares_prefixes(requests: Iterable[Request]) -> bool:
    """Whether two requests share at least one token of stream (a segment key other than
    their own private one): then prefix caching is on by default."""
    seen: set[tuple[int, ...]] = set()
    for r in requests:
        if not isinstance(r.tokens, TokenStream):  # no ids, or ids that say nothing of sharing
            continue
        keys = {key for key, n in r.tokens.segments if n > 0 and key[0] != 0}
        if keys & seen:
            return True
        seen |= keys
    return False


def generate_multiturn(
    num_requests: int,
    *,
    turns: int = DEFAULT_TURNS,
    think_time_s: float = DEFAULT_THINK_TIME_S,
    seed: int = 0,
    rate: float | None = None,
    arrival: str = "poisson",
    burst_size: int = 64,
    max_model_len: int = 4096,
    num_prefixes: int = 0,
    prefix_tokens: int = 0,
    lengths: str = "sharegpt",
) -> list[Request]:
    """`num_requests` turns of conversations of up to `turns` turns each (a conversation
    ends early when its next turn would not fit in max_model_len). User messages and answers
    follow the `lengths` model (ShareGPT: 161 and 338 tokens on average); a conversation
    of prefix group g starts with that group's `prefix_tokens`. Seeded; with token streams."""
    if turns < 1 or not think_time_s >= 0 or num_requests < 1:
        raise ValueError(
            f"need turns >= 1, think_time_s >= 0 and num_requests >= 1, got {turns}, {think_time_s}, {num_requests}"
        )
    if max_model_len < prefix_tokens + 2:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for a prompt and an output")
    model = LENGTH_MODELS[lengths]
    rng = np.random.default_rng(seed)
    starts = arrival_times(rng, num_requests, rate, arrival, burst_size)
    user = _lognormal(rng, model.prompt_mean, model.prompt_sigma, num_requests)
    answer = _lognormal(rng, model.output_mean, model.output_sigma, num_requests)
    gaps = (
        rng.exponential(think_time_s, num_requests) if think_time_s > 0 else np.zeros(num_requests)
    )
    groups = (
        rng.integers(0, num_prefixes, num_requests)
        if num_prefixes > 0
        else np.full(num_requests, -1)
    )
    out: list[Request] = []
    conversation = 0
    while len(out) < num_requests:
        group = int(groups[conversation])
        shared = prefix_tokens if group >= 0 else 0
        held, t = shared, float(starts[conversation])
        for k in range(turns):
            i = len(out)
            if i == num_requests:
                break
            prompt = held + int(user[i])
            output = int(answer[i])
            if prompt + output > max_model_len:
                if k > 0:
                    break  # the conversation outgrew max_model_len: it ends here
                prompt = min(prompt, max_model_len - 1)  # a first turn is clipped to fit
                output = min(output, max_model_len - prompt)
            out.append(Request(i, t, prompt, output, 0, group, shared, conversation))
            held = prompt + output
            t += float(gaps[i])
        conversation += 1
    return with_token_streams(out, seed)
