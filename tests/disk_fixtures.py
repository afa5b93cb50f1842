"""What the disk-tier tests share (tests/test_disk_tier.py, test_disk_persist.py,
test_disk_evictions.py): one layout, host pools of random bytes, a pool's slab and blocks as
bytes, and distinct content hashes."""

from __future__ import annotations

import ctypes

import kvpool
import numpy as np

__all__ = ["BB", "LAYOUT", "block", "key", "make_pool", "raw"]

LAYOUT = kvpool.KvLayout(2, 2, 64, 16)  # 16 KiB blocks
BB = LAYOUT.block_bytes


def make_pool(num_blocks: int = 64, seed: int = 0) -> kvpool.Pool:
    """A host pool of ``LAYOUT`` whose every block holds fresh random bytes."""
    pool = kvpool.Pool(LAYOUT, num_blocks, device="host")
    raw(pool)[:] = np.random.default_rng(seed).integers(0, 256, num_blocks * BB, dtype=np.uint8)
    return pool


def raw(pool: kvpool.Pool) -> np.ndarray:
    """The pool's slab as bytes (a block is block_bytes contiguous bytes)."""
    buf = (ctypes.c_uint8 * (pool.num_blocks * BB)).from_address(pool.base_ptr)
    return np.ctypeslib.as_array(buf)


def block(pool: kvpool.Pool, block_id: int) -> bytes:
    """Block ``block_id``'s bytes."""
    return raw(pool)[block_id * BB : (block_id + 1) * BB].tobytes()


def key(i: int) -> bytes:
    """A 32-byte content hash, distinct for each ``i``."""
    return i.to_bytes(4, "little") * 8
