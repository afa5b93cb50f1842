"""A padded [batch, width] forward as a packed kvpool step (NumPy only: no torch here).

transformers' `generate` runs a batch of ragged prompts as one [batch, width] tensor with left
padding: row b's real tokens are its last ones. kvpool's kernels take a packed step instead:
decode rows (one new token on a cached prefix) first, then prefill chunks (several new tokens,
causal over the cached prefix and themselves). `plan_padded_step` says which row is which and
where each packed token sits in the flattened [batch * width] input, so the attention function
gathers the rows' real tokens, runs the packed step and scatters the outputs back (padding gets
zeros: its outputs are never read).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class PaddedStep:
    """One forward of a padded batch as a packed step.

    - decode_rows / prefill_rows (int64): the batch rows in packed order (decode first);
    - new_lens (int64 [batch]): new tokens of each row in this forward (0 for a finished row);
    - gather (int64 [num_tokens]): flat index b * width + t of each packed token."""

    decode_rows: np.ndarray
    prefill_rows: np.ndarray
    new_lens: np.ndarray
    gather: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.gather.shape[0])


def prompt_lens(positions: np.ndarray) -> np.ndarray:
    """Real tokens per row of a left-padded first forward, from generate's position ids
    (cumsum of the attention mask - 1, padding at 0): the last position + 1."""
    positions = np.asarray(positions)
    if positions.ndim != 2 or positions.shape[1] == 0:
        raise ValueError(f"position ids must be [batch, width >= 1], got {positions.shape}")
    lens = positions.max(axis=1).astype(np.int64) + 1
    if (positions[:, -1] != lens - 1).any():
        raise ValueError("the batch is not left padded: a row's last position is not its largest")
    return lens


def plan_padded_step(cached_lens: np.ndarray, new_lens: np.ndarray, width: int) -> PaddedStep:
    """Rows with one new token on a cached prefix decode; rows with more (or a first token)
    are prefill chunks; rows with none (finished) are left out. Row b's new tokens are the last
    new_lens[b] of its `width` columns."""
    cached = np.asarray(cached_lens, np.int64)
    new = np.asarray(new_lens, np.int64)
    if cached.shape != new.shape or cached.ndim != 1:
        raise ValueError(f"cached_lens {cached.shape} and new_lens {new.shape} must be [batch]")
    if (new < 0).any() or (new > width).any() or (cached < 0).any():
        raise ValueError(f"new tokens per row must be in 0..{width}, cached lengths >= 0")
    rows = np.arange(len(new), dtype=np.int64)
    is_decode = (new == 1) & (cached > 0)
    decode, prefill = rows[is_decode], rows[~is_decode & (new > 0)]
    parts = [
        b * width + np.arange(width - new[b], width, dtype=np.int64)
        for b in np.concatenate([decode, prefill])
    ]
    gather = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return PaddedStep(decode, prefill, new, gather)
