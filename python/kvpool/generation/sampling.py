"""Batch-independent sampling: the Gumbel-max trick with noise from a counter-based hash.

A token sampled at temperature t > 0 is argmax(logits / t + g) where g is Gumbel noise drawn
from hash(seed, position, vocab index). The noise depends on nothing but the request's seed and
the position, so a request draws the same noise alone or in any batch, and the NumPy and
torch versions agree bit for bit on the noise (the integer hash is exact in both).
"""

from __future__ import annotations

import numpy as np

MASK = (1 << 63) - 1  # keep the hash in non-negative int64, so NumPy and torch agree
M1, M2 = 0x2545F4914F6CDD1D, 0x5851F42D4C957F2D


def _mix(x):
    """An xorshift-multiply mixer on non-negative int64 (wrapping products, masked to 63 bits)."""
    x = x ^ (x >> 31)
    x = (x * (M1 & MASK)) & MASK
    x = x ^ (x >> 29)
    x = (x * (M2 & MASK)) & MASK
    return x ^ (x >> 32)


def gumbel_noise(seeds: np.ndarray, positions: np.ndarray, vocab: int) -> np.ndarray:
    """float64 [rows, vocab] Gumbel noise of each row's (seed, position)."""
    with np.errstate(over="ignore"):
        key = _mix((seeds.astype(np.int64) & MASK) * 1_000_003 + positions.astype(np.int64))
        x = _mix(key[:, None] ^ np.arange(vocab, dtype=np.int64)[None, :])
    u = ((x >> 11).astype(np.float64) + 0.5) / float(1 << 52)  # in (0, 1)
    return -np.log(-np.log(u))


def sample(
    logits: np.ndarray, temperatures: np.ndarray, seeds: np.ndarray, positions: np.ndarray
) -> np.ndarray:
    """int64 token per row: greedy where the temperature is 0, Gumbel-max otherwise."""
    logits = np.asarray(logits, np.float64)
    out = logits.argmax(axis=1)
    hot = temperatures > 0
    if hot.any():
        noisy = logits[hot] / temperatures[hot, None] + gumbel_noise(
            seeds[hot], positions[hot], logits.shape[1]
        )
        out[hot] = noisy.argmax(axis=1)
    return out.astype(np.int64)
