"""The scheduler swapping into a host tier over a CUDA pool: every request served, both tiers
conserved after every step, and each swapped request's blocks back byte for byte. Skipped
without a GPU (conftest.py)."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from gpu_fixtures import cp
from kvpool.scheduler import Request, Scheduler, SchedulerConfig
from kvpool.scheduler.paged import PagedKv
from kvpool.scheduler.swap import HostTierSwapper

pytestmark = pytest.mark.gpu

LAYOUT = kvpool.KvLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)
CONFIG = SchedulerConfig(
    max_model_len=512, max_running_seqs=16, max_tokens_per_step=256, watermark=0.0
)


def _blocks_bytes(pool, blocks) -> bytes:
    nbytes = pool.num_blocks * pool.block_bytes
    mem = cp.cuda.UnownedMemory(pool.base_ptr, nbytes, pool)
    slab = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
    rows = slab.reshape(pool.num_blocks, pool.block_bytes)
    cp.cuda.Device().synchronize()
    return cp.asnumpy(rows[cp.asarray(np.asarray(blocks, dtype=np.int64))]).tobytes()


class CheckingSwapper(HostTierSwapper):
    """Remembers a request's bytes at swap-out and compares them after its swap-in."""

    saved: dict[int, bytes]

    def preempt(self, seq):
        blocks = self.backend.tables.blocks(seq.request_id)
        before = _blocks_bytes(self.backend.pool, blocks)
        swapped = super().preempt(seq)
        if swapped:
            self.saved[seq.request_id] = before
        return swapped

    def try_swap_in(self, seq, watermark_blocks):
        if not super().try_swap_in(seq, watermark_blocks):
            return False
        blocks = self.backend.tables.blocks(seq.request_id)
        assert _blocks_bytes(self.backend.pool, blocks) == self.saved.pop(seq.request_id)
        return True


def test_swapped_requests_come_back_byte_exact_and_both_tiers_drain():
    pool = kvpool.Pool(LAYOUT, 48, device="cuda")
    nbytes = pool.num_blocks * pool.block_bytes
    mem = cp.cuda.UnownedMemory(pool.base_ptr, nbytes, pool)
    slab = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
    slab[:] = cp.random.default_rng(0).integers(
        0, 256, nbytes, dtype=cp.uint8
    )  # every block distinct
    backend = PagedKv(pool, CONFIG.max_running_seqs, CONFIG.max_model_len)
    swapper = CheckingSwapper(
        backend, 1024, mode="swap", prefill_s_per_token=1.0, block_bytes=pool.block_bytes
    )
    swapper.saved = {}
    rng = np.random.default_rng(0)
    reqs = [
        Request(i, 0.0, int(rng.integers(8, 120)), int(rng.integers(60, 300))) for i in range(40)
    ]
    sched = Scheduler(backend, reqs, CONFIG, swapper=swapper)
    while not sched.done:
        sched.step()
        running = [s for s in sched.seqs if s.running]
        swapped = [s for s in sched.seqs if s.swapped]
        assert pool.num_used == sum(-(-s.kv_tokens // 16) for s in running)
        swapper.tier.wait()  # host blocks of finished swap-ins back on the free list
        assert swapper.tier.pool.num_used == sum(-(-s.kv_tokens // 16) for s in swapped)
        swapper.tier.check_invariants()
        pool.check_invariants()
    assert (
        swapper.counts.swapped_out > 0 and swapper.counts.swapped_in == swapper.counts.swapped_out
    )
    assert not swapper.saved
    backend.check_drained()
    swapper.check_drained()
