"""Tensor parallelism: one allocator and one set of block tables over N device shards.

A :class:`PoolGroup` holds one :class:`~kvpool.Pool` per rank, each over the rank's shard
layout (``layout.tp_shard(tp_size)``: ``num_kv_heads / tp_size`` KV heads of every block, or
one replicated head when there are more ranks than KV heads). Rank 0's pool is the *primary*:
its allocator and the :class:`~kvpool.BlockTables` made over it decide every block id. The
other pools are *mirrors*: they hold the same number of blocks and are never allocated from,
so block ``b`` means the same tokens on every rank (what vLLM's TP workers do), and one
scheduler serves all ranks without seeing them. Design notes: ``tp.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy.typing as npt

from kvpool._core import BlockTables, InvalidArgumentError, KvError, KvLayout, Pool
from kvpool.kernels import copy_blocks


def _devices(devices: str | Sequence[str], tp_size: int) -> list[str]:
    if isinstance(devices, str):
        if devices in ("host", "cpu"):
            return ["host"] * tp_size
        if devices == "cuda":
            return [f"cuda:{r}" for r in range(tp_size)]
        raise InvalidArgumentError(
            f"devices must be 'host', 'cuda' or a list of {tp_size} device names, got {devices!r}"
        )
    names = [str(d) for d in devices]
    if len(names) != tp_size:
        raise InvalidArgumentError(f"{len(names)} devices given for tp_size {tp_size}")
    cuda = [d for d in names if d != "host"]
    if cuda and len(cuda) != tp_size:
        raise InvalidArgumentError(f"devices mix host and CUDA: {names}")
    if len(set(cuda)) != len(cuda):
        raise InvalidArgumentError(f"each rank needs its own CUDA device, got {names}")
    return names


@contextlib.contextmanager
def _keeping_current_device(cuda: bool) -> Iterator[None]:
    """Creating a pool or uploading a table binds that device's context to the thread; put the
    caller's current device back afterwards, so a group call does not move CuPy's work."""
    try:
        from cupy.cuda import runtime
    except ImportError:  # without CuPy nothing else tracks a current device
        cuda = False
    if not cuda:
        yield
        return

    previous = runtime.getDevice()
    try:
        yield
    finally:
        runtime.setDevice(previous)


class PoolGroup:
    """N pools, one per tensor-parallel rank, driven by rank 0's allocator and tables.

    ``layout`` is the model's full (unsharded) layout; ``num_blocks`` (or ``memory_bytes`` per
    rank) is the same on every rank. ``devices``: ``"cuda"`` (ranks on ``cuda:0..N-1``),
    ``"host"`` (N host slabs, for tests), or one device name per rank.
    """

    def __init__(
        self,
        layout: KvLayout,
        tp_size: int,
        num_blocks: int | None = None,
        *,
        memory_bytes: int | None = None,
        devices: str | Sequence[str] = "cuda",
    ) -> None:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise InvalidArgumentError(f"tp_size must be a positive int, got {tp_size!r}")
        self.layout = layout
        self.tp_size = tp_size
        self.shard_layout = layout.tp_shard(tp_size)  # refuses heads that do not shard
        if (num_blocks is None) == (memory_bytes is None):
            raise InvalidArgumentError("give exactly one of num_blocks, memory_bytes (per rank)")
        if memory_bytes is not None:
            num_blocks = memory_bytes // self.shard_layout.block_bytes
        names = _devices(devices, tp_size)
        with _keeping_current_device(names[0] != "host"):
            self.pools: tuple[Pool, ...] = tuple(
                Pool(self.shard_layout, num_blocks, device=d) for d in names
            )

    @property
    def primary(self) -> Pool:
        """Rank 0's pool: make the BlockTables over it; every allocation goes through it."""
        return self.pools[0]

    @property
    def num_blocks(self) -> int:
        return self.primary.num_blocks

    def head_range(self, rank: int) -> tuple[int, int]:
        """``(first, stop)``: the KV heads of the full layout that rank ``rank`` holds."""
        return self.layout.tp_head_range(self.tp_size, rank)

    def tables(self, max_seqs: int, max_blocks_per_seq: int) -> BlockTables:
        """The block tables of the group (over the primary pool)."""
        return BlockTables(self.primary, max_seqs, max_blocks_per_seq)

    def sync(self, tables: BlockTables) -> list[tuple[Any, Any]]:
        """``(block_table, seq_lens)`` for every rank, in rank order. CUDA: the same table
        uploaded to each rank's device on that rank's pool stream (only changed rows, no host
        wait); each pair names its rank's pool, so that rank's kernels accept it. Host: the
        same NumPy arrays for every rank."""
        self._check_tables(tables)
        if self.primary.device == "host":
            return [tables.sync()] * self.tp_size
        with _keeping_current_device(True):
            return [tables.sync()] + [tables.sync(pool=p) for p in self.pools[1:]]

    def copy_blocks(self, pairs: npt.ArrayLike) -> None:
        """Run copy-on-write block copies (``append_tokens_many``'s ``copies``) on every rank,
        each on its pool's stream."""
        for pool in self.pools:
            copy_blocks(pool, pairs, stream=pool.stream)

    def _check_tables(self, tables: BlockTables) -> None:
        if tables.pool is not self.primary:
            raise InvalidArgumentError("the block tables are not over this group's primary pool")

    def check_invariants(self, tables: BlockTables | None = None) -> None:
        """The primary's invariants (and the tables', if given), and the mirror equations:
        every mirror has the shard layout, the primary's num_blocks, and no block in use
        (mirrors are never allocated from, so ids mean the same on every rank)."""
        if tables is not None:
            self._check_tables(tables)
            tables.check_invariants()
        self.primary.check_invariants()
        for rank, pool in enumerate(self.pools):
            if pool.layout != self.shard_layout or pool.num_blocks != self.num_blocks:
                raise KvError(
                    f"invariant violated: rank {rank}'s pool is {pool.layout} with "
                    f"{pool.num_blocks} blocks, expected {self.shard_layout} with "
                    f"{self.num_blocks}"
                )
            if rank > 0 and pool.num_used != 0:
                raise KvError(
                    f"invariant violated: mirror pool of rank {rank} has "
                    f"{pool.num_used} blocks allocated; allocate through the primary"
                )

    def __repr__(self) -> str:
        return (
            f"PoolGroup(tp_size={self.tp_size}, devices={[p.device for p in self.pools]}, "
            f"num_blocks={self.num_blocks}, shard={self.shard_layout})"
        )
