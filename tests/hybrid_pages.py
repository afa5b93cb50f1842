"""Helpers for the hybrid transfer tests (fake transport and NIXL): a mixed layout of every
group kind, page contents written per group from a seed, and a request's bytes read back per
group, so a page of one group landing in another's place is seen."""

from __future__ import annotations

import ctypes

import numpy as np
from kvpool import HybridTables, KvGroup, ModelKvSpec, Pool

PAGE_BYTES = 4096


def mixed_spec(window: int = 24, head_dim: int = 64, state_bytes: int = 5000) -> ModelKvSpec:
    """Full, sliding window, chunked local, MLA latent and recurrent state groups over
    4 KiB pages: 16 tokens a page for the attention groups, 25 for MLA, a two-page state."""
    return ModelKvSpec(
        [
            KvGroup.sliding_window([0, 5], window, 1, head_dim),
            KvGroup.full([1], 1, head_dim),
            KvGroup.recurrent_state([2], state_bytes),
            KvGroup.mla_latent([3], 64, 16),
            KvGroup.chunked_local([4], 32, 1, head_dim // 2),
        ],
        PAGE_BYTES,
    )


def side(num_blocks: int = 96, spec: ModelKvSpec | None = None) -> tuple[Pool, HybridTables]:
    spec = mixed_spec() if spec is None else spec
    pool = Pool.for_spec(spec, num_blocks, device="host")
    return pool, HybridTables(pool, spec)


def slab(pool: Pool) -> np.ndarray:
    """The pool's pages as a writable uint8 ``[num_blocks, block_bytes]`` view."""
    raw = (ctypes.c_uint8 * (pool.num_blocks * pool.block_bytes)).from_address(pool.base_ptr)
    return np.ctypeslib.as_array(raw).reshape(pool.num_blocks, pool.block_bytes)


def group_ids(tables: HybridTables, rid: int) -> list[np.ndarray]:
    return [tables.table(rid, g)[1] for g in range(tables.spec.num_groups)]


def expected_group_bytes(seed: int, group: int, num_pages: int) -> np.ndarray:
    """What ``fill_groups(seed)`` writes into a group's pages, in page order."""
    rng = np.random.default_rng([seed, group])
    return rng.integers(0, 256, (num_pages, PAGE_BYTES), dtype=np.uint8)


def fill_groups(tables: HybridTables, rid: int, seed: int) -> None:
    """Writes every page the request holds, group by group, from ``seed``."""
    pages = slab(tables.pool)
    for group, ids in enumerate(group_ids(tables, rid)):
        pages[ids] = expected_group_bytes(seed, group, len(ids))


def group_bytes(tables: HybridTables, rid: int) -> list[np.ndarray]:
    """The request's bytes per group (its pages in page order), copied out."""
    pages = slab(tables.pool)
    return [pages[ids].copy() for ids in group_ids(tables, rid)]


def same_per_group(got: list[np.ndarray], want: list[np.ndarray]) -> bool:
    return len(got) == len(want) and all(
        g.shape == w.shape and np.array_equal(g, w) for g, w in zip(got, want)
    )


def table_shapes(tables: HybridTables, rid: int) -> list[tuple[int, int, int]]:
    """Per group (first_page, number of pages, num_tokens): what a transfer must reproduce."""
    out = []
    for g in range(tables.spec.num_groups):
        first, ids, n = tables.table(rid, g)
        out.append((int(first), len(ids), int(n)))
    return out
