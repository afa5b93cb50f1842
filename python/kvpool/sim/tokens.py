"""Token ids for simulated requests: what makes prefix caching see real sharing.

The simulator has no text, only lengths; the prefix cache needs token ids, and requests that
share a prefix must carry exactly the same ids for it. A `TokenStream` is a sequence of
*segments*, each a (key, length) pair; a segment's ids are drawn from a generator seeded by
(seed, key), so the same key always gives the same ids and different keys give unrelated ids
(two unrelated 16-token blocks coincide with probability VOCAB**-16: never). Sharing is then
said by keys:

- a request of prefix group g: ``[(PREFIX, g) x prefix_tokens, (PRIVATE, request_id) x rest]``;
- every turn of conversation c reads one stream ``[(USER, c, 0), (ANSWER, c, 0), (USER, c, 1),
  ...]``: turn k's prompt is its first prompt_tokens ids (earlier turns and their answers,
  then the new user tokens) and its output the next output_tokens ids;
- a Mooncake row: one (HASH, hash_id) segment per 512-token block of its hash_ids.

A request's stream covers its prompt and its output: decode steps append the output's ids,
so the blocks an answer fills are cached for the next turn, and a preempted request that is
re-admitted re-adds its prompt plus the tokens it had generated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VOCAB = 32_000  # ids are uniform in [0, VOCAB); only their equality matters to the cache

# Segment kinds (the first word of a key).
PRIVATE, PREFIX, USER, ANSWER, HASH = range(5)


@dataclass(frozen=True, slots=True)
class TokenStream:
    """Deterministic token ids: `segments` ((key, num_tokens), ...) under one `seed`."""

    seed: int
    segments: tuple[tuple[tuple[int, ...], int], ...]

    def __len__(self) -> int:
        return sum(n for _, n in self.segments)

    def ids(self, num_tokens: int) -> np.ndarray:
        """The first `num_tokens` ids (int64); refuses more than the stream holds."""
        if not 0 <= num_tokens <= len(self):
            raise ValueError(f"the token stream holds {len(self)} ids, asked for {num_tokens}")
        parts, left = [], num_tokens
        for key, n in self.segments:
            if left == 0:
                break
            take = min(n, left)
            parts.append(segment_ids(self.seed, key, n)[:take])
            left -= take
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def segment_ids(seed: int, key: tuple[int, ...], num_tokens: int) -> np.ndarray:
    """The ids of one segment: a prefix of a segment with the same key is the same ids."""
    rng = np.random.default_rng([seed & (2**63 - 1), *key])
    return rng.integers(0, VOCAB, num_tokens, dtype=np.int64)


def private_stream(seed: int, request_id: int, num_tokens: int) -> TokenStream:
    """Ids shared with no other request."""
    return TokenStream(seed, (((PRIVATE, request_id), num_tokens),))


def prefix_stream(
    seed: int, request_id: int, group: int, prefix_tokens: int, num_tokens: int
) -> TokenStream:
    """Group `group`'s `prefix_tokens` shared ids, then ids of this request only."""
    if not 0 <= prefix_tokens <= num_tokens:
        raise ValueError(f"prefix_tokens must be in [0, {num_tokens}], got {prefix_tokens}")
    return TokenStream(
        seed,
        (((PREFIX, group), prefix_tokens), ((PRIVATE, request_id), num_tokens - prefix_tokens)),
    )
