"""Request: what the scheduler is asked to serve (lengths in tokens, an arrival time), and the
token ids a prefix cache keys on.

The scheduler's units: the prompt's `prompt_tokens` are prefilled (possibly over several
steps), then the request decodes `output_tokens` steps, each appending one token of KV and
emitting one token. `arrival_s` is on the scheduler's clock (core.Scheduler.now_s).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class TokenIds(Protocol):
    """The token ids of a request's prompt + output, read from the front (kvpool.sim.tokens
    makes them for simulated requests)."""

    def __len__(self) -> int: ...

    def ids(self, num_tokens: int) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class Request:
    """One request: what arrives, not how it is served."""

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    priority: int = 0
    prefix_id: int = -1  # requests with the same prefix_id start with the same prefix_tokens
    prefix_tokens: int = 0
    conversation_id: int = -1  # turns of one conversation: each prompt holds the earlier turns
    # The token ids of prompt + output (prefix caching needs them; kvpool.sim.sharing gives them)
    tokens: TokenIds | None = field(default=None, compare=False, repr=False)
