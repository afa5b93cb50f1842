"""The core's edges on a GPU: a host tier dropped with swaps in flight and requests swapped
out, and its pinned pool refusing the plain block API. Skipped without a GPU (conftest.py)."""

from __future__ import annotations

import gc

import kvpool
import pytest
from kvpool import BlockTables, HostTier, KvLayout, Pool

pytestmark = pytest.mark.gpu

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)


def test_dropping_a_cuda_host_tier_frees_its_requests_and_pending_blocks() -> None:
    pool = Pool(LAYOUT, 64, device="cuda")
    tables = BlockTables(pool, 8, 8)
    for r in range(3):
        tables.add(r, 40)
    tier = HostTier(tables, 32)
    tier.swap_out([0, 1])  # copies may still be in flight: their device blocks are pending
    with pytest.raises(kvpool.DuplicateRequestError):
        tables.add(0, 1)
    with pytest.raises(kvpool.InvalidArgumentError, match="host tier's"):
        tier.pool.alloc_many(2)
    del tier
    gc.collect()
    for r in (0, 1):
        with pytest.raises(kvpool.UnknownRequestError):
            tables.free(r)
        tables.add(r, 40)
    tables.check_invariants()
    pool.check_invariants(exact_refs=True)
    assert pool.num_used == 3 * 3
