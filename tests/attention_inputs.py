"""Inputs of the attention tests, shared by the host-reference suites and the GPU suites (no
CuPy here; the device-side helpers are in gpu_fixtures.py).

- `random_elems`: N(0, 1) values rounded to a KV dtype (bfloat16 as uint16 bit patterns).
- `shuffled_tables`: disjoint block tables over a shuffled pool, with unused (-1) columns.
- `qo_indptr`: FlashInfer's query offsets from per-sequence query lengths.
- `fill_host_pool`: every K and V view of a host pool filled with `random_elems`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from kvpool import reference


def random_elems(rng: np.random.Generator, shape: Sequence[int], dtype: str) -> np.ndarray:
    return reference.from_float64(rng.standard_normal(shape), dtype)


def shuffled_tables(
    rng: np.random.Generator,
    seq_lens: Sequence[int],
    block_size: int,
    num_blocks: int,
    extra: int = 2,
) -> np.ndarray:
    """Shuffled, disjoint block tables, one row per sequence, with `extra` unused (-1) columns."""
    need = [-(-int(n) // block_size) for n in seq_lens]
    ids = rng.permutation(num_blocks)[: sum(need)]
    tables = np.full((len(seq_lens), max(need) + extra), -1, dtype=np.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[at : at + n]
        at += n
    return tables


def qo_indptr(qo_lens: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)


def fill_host_pool(pool: Any, rng: np.random.Generator) -> Any:
    """Fills every layer's K and V of a host pool with random elements; returns the pool."""
    lay = pool.layout
    for layer in range(lay.num_layers):
        for view in (pool.k_view(layer), pool.v_view(layer)):
            view[...] = random_elems(rng, view.shape, lay.dtype).view(view.dtype)
    return pool
