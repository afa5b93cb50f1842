"""A staging buffer of each NIXL transport's side: a request whose blocks are scattered over its
pool moves as one descriptor instead of one per run (``NixlTransport.connect(staging_bytes=)``).

Why: UCX posts one copy per descriptor, and on one GPU through cuda_ipc each costs a fixed
5-17 us, against 0.03 us to move a 64 KiB block at the copy engine's rate: a request of
scattered blocks (a pool after churn: about one descriptor per block) ran at 0.00-0.17 of a
contiguous READ of the same bytes from 64 blocks on (transfer.md, "CUDA pools over NIXL"). A
device-local gather moves the bytes at HBM rate in one launch, so paying for it to post one
descriptor wins once a request has enough runs (``StagingCost``).

- The sender packs, before its offer: a request worth staging is gathered into the sender's
  buffer (after ``settle_source``: the KV is written), and the offer says
  ``staged_at`` (the first block of the buffer it starts at). The receiver READs that one
  region.
- The receiver unpacks, when the source is one region and its own blocks are worth staging:
  it READs into its own buffer and scatters that into its blocks before the transfer
  counts as landed.
- One request at a time holds a side's buffer (``acquire``); a request that does not fit, or
  finds the buffer held, moves run by run as before. The sender's buffer is held from the
  gather until its side of the transfer ends (the receiver's ``done``, or a failure after
  which the receiver is told to drop what it read): as long as the receiver may read it, the
  lifetime the sender's blocks have without staging. The receiver's is held only within
  ``read_blocks``.

A CUDA pool's buffer is device memory of its own (``cudaMalloc``, not a caching pool: NIXL
registers the allocation as it is) gathered and scattered by ``move_blocks``
(cuda/copy_blocks.cu) on a stream of its own, waited for before the offer or the ``done``; a host
pool's (only if asked for: on the host one descriptor per run costs 2-3 us against the copy
it would add; ``StagingCost``'s defaults are the GPU's) is page memory copied with ``memmove``
per run. Both are registered with the
side's NIXL agent before its metadata goes to the peer, once, like the slab.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool._core import Pool
from kvpool.exceptions import InvalidArgumentError
from kvpool.transfer.cuda_mover import MoveRowsArgs, move_blocks, move_rows
from kvpool.transfer.pieces import GROUPED, plan_pieces
from kvpool.transfer.regions import RowScatter

# The holder of a buffer taken by this side's READ (``read_blocks``, a ``LayeredRead``; a side
# READs one offer at a time). Request ids are >= 0: a sending request holds it by its id.
RECEIVING = -1
# The default buffer of a CUDA pool's side, capped at the pool's slab: a request of up to this
# many bytes moves as one descriptor. 2 MiB blocks x 128, 64 KiB blocks x 4096.
DEFAULT_CUDA_STAGING_BYTES = 256 << 20


@dataclass(frozen=True)
class StagingCost:
    """When staging a request pays (``worth``): the descriptors it saves against the fixed cost
    of a gather or scatter and its copy of the bytes. The defaults are one H200's, two
    processes on the GPU, UCX cuda_ipc (bench/results/2026-12-04_7b88e0e_h200): each descriptor
    past the first 5-17 us; a staged request's time 250-350 us above the contiguous READ's for
    1-16 blocks, although a gather of one block takes 20 us in a process alone on the GPU: the
    probe there measured it at 153-156 us when the other process had used the GPU just before
    (the GPU switching between the two processes' contexts, for the gather and again for the
    READ); a gather's copy 1.8 TB/s (8 GiB of 2 MiB blocks in 4.7 ms). Between two GPUs that
    switch is not paid, so these defaults err towards not staging there; set
    ``NixlTransport.staging_cost`` to others."""

    descriptor_s: float = 10e-6
    fixed_s: float = 300e-6
    copy_bytes_per_s: float = 1.8e12

    def worth(self, num_runs: int, nbytes: int) -> bool:
        """Whether ``num_runs`` runs of ``nbytes`` in all move faster staged than run by run."""
        if num_runs < 2:
            return False
        saved = (num_runs - 1) * self.descriptor_s
        return saved > self.fixed_s + nbytes / self.copy_bytes_per_s


def runs(ids: np.ndarray) -> int:
    """How many runs of consecutive ids ``ids`` makes (0 for none)."""
    if len(ids) == 0:
        return 0
    return 1 + int(np.count_nonzero(np.diff(ids.astype(np.int64)) != 1))


def staging_blocks(pool: Pool, staging_bytes: int | None, mem_type: str) -> int:
    """How many of ``pool``'s blocks a side's buffer holds for ``staging_bytes`` (None: the
    default, ``DEFAULT_CUDA_STAGING_BYTES`` on a CUDA pool, none on a host pool), at most the
    pool's own number of blocks. TypeError / InvalidArgumentError for a bad ``staging_bytes``."""
    if staging_bytes is None:
        staging_bytes = DEFAULT_CUDA_STAGING_BYTES if mem_type == "VRAM" else 0
    if not isinstance(staging_bytes, int) or isinstance(staging_bytes, bool):
        raise TypeError(f"staging_bytes must be an int, got {type(staging_bytes).__name__}")
    if staging_bytes < 0:
        raise InvalidArgumentError(f"staging_bytes must be >= 0, got {staging_bytes}")
    return min(staging_bytes // pool.block_bytes, pool.num_blocks)


class StagingBuffer:
    """``num_blocks`` blocks of ``pool``'s bytes, registered with ``agent`` as ``mem_type`` of
    ``device_id``; see the module's docstring. ``close`` deregisters and frees it."""

    def __init__(self, pool: Pool, num_blocks: int, agent: Any, mem_type: str, device_id: int):
        if num_blocks < 1:
            raise ValueError(f"a staging buffer holds at least one block, not {num_blocks}")
        self.pool, self.num_blocks, self.device_id = pool, num_blocks, device_id
        self.block_bytes = pool.block_bytes
        nbytes = num_blocks * self.block_bytes
        self._on_device = mem_type == "VRAM"
        self._stream: Any = None
        if self._on_device:
            import cupy

            with cupy.cuda.Device(device_id):
                self._memory: Any = cupy.cuda.Memory(nbytes)
                self._stream = cupy.cuda.Stream(non_blocking=True)
                # The block ids of a move, through pinned memory to a device list of their own:
                # allocating and copying them per move (cupy.asarray) took 13-20 us of a 32 us
                # gather of one block on the H200.
                self._ids_device = cupy.cuda.Memory(4 * num_blocks)
                self._ids_pinned = cupy.cuda.alloc_pinned_memory(4 * num_blocks)
                self._ids_host = np.frombuffer(self._ids_pinned, np.int32, num_blocks)
            self.base_ptr = int(self._memory.ptr)
        else:
            self._memory = np.zeros(nbytes, np.uint8)
            self.base_ptr = int(self._memory.ctypes.data)
        self._agent = agent
        self._registration = agent.register_memory(
            [(self.base_ptr, nbytes, device_id, "")], mem_type
        )
        self._lock = threading.Lock()
        self._holder: int | None = None

    def acquire(self, request_id: int, count: int) -> bool:
        """Takes the buffer for ``count`` blocks of ``request_id``: False if it is held or
        too small (the request then moves run by run)."""
        with self._lock:
            if self._holder is not None or count > self.num_blocks or count == 0:
                return False
            self._holder = request_id
            return True

    def release(self, request_id: int) -> None:
        """Gives the buffer back if ``request_id`` holds it (a no-op otherwise)."""
        with self._lock:
            if self._holder == request_id:
                self._holder = None

    @property
    def holder(self) -> int | None:
        return self._holder

    def gather(self, ids: np.ndarray) -> None:
        """Copies the pool's blocks ``ids`` to the buffer's first ``len(ids)`` blocks, in order,
        and waits for the copy."""
        self._move(ids, to_buffer=True)

    def scatter(self, ids: np.ndarray) -> None:
        """Copies the buffer's first ``len(ids)`` blocks to the pool's blocks ``ids``, in order,
        and waits for the copy."""
        self._move(ids, to_buffer=False)

    def _move(self, ids: np.ndarray, to_buffer: bool) -> None:
        ids = np.ascontiguousarray(ids, np.int32)
        if len(ids) > self.num_blocks:
            raise ValueError(f"{len(ids)} blocks do not fit a buffer of {self.num_blocks}")
        bb, pool_base = self.block_bytes, self.pool.base_ptr
        if self._on_device:
            import cupy

            with cupy.cuda.Device(self.device_id):
                # The buffer's holder alone moves through it, and each move is waited for
                # before it returns: the id lists are free again here.
                ids_ptr = self._ids_to_device(ids)
                # (base, ids: a device int32 list or 0 for the identity, stride) of each side
                pool_side = (pool_base, ids_ptr, bb)
                buffer_side = (self.base_ptr, 0, bb)
                src, dst = (pool_side, buffer_side) if to_buffer else (buffer_side, pool_side)
                move_blocks(
                    self.device_id,
                    len(ids),
                    src[0],
                    src[1],
                    src[2],
                    dst[0],
                    dst[1],
                    dst[2],
                    bb,
                    self._stream.ptr,
                )
                self._stream.synchronize()  # before anyone reads what it wrote
            return
        # A host pool: one memmove per run of consecutive ids.
        for start, count in plan_pieces(GROUPED, ids, ids, len(ids)):
            pool_ptr = pool_base + int(ids[start]) * bb
            buffer_ptr = self.base_ptr + start * bb
            if to_buffer:
                ctypes.memmove(buffer_ptr, pool_ptr, count * bb)
            else:
                ctypes.memmove(pool_ptr, buffer_ptr, count * bb)

    def _ids_to_device(self, ids: np.ndarray) -> int:
        """Queues the copy of ``ids`` (at most ``num_blocks``) through the pinned list into the
        device list, on the buffer's stream; the device list's address. The caller waits for
        the stream before the lists are used again."""
        import cupy

        self._ids_host[: len(ids)] = ids
        ids_ptr = int(self._ids_device.ptr)
        cupy.cuda.runtime.memcpyAsync(
            ids_ptr, self._ids_pinned.ptr, 4 * len(ids), 1, self._stream.ptr
        )  # 1: host to device
        return ids_ptr

    def scatter_rows(self, ids: np.ndarray, rows: RowScatter) -> None:
        """Copies the buffer's packed rows (``rows.rows`` of ``rows.row_bytes`` per block, block
        after block) into the pool's blocks ``ids`` at ``rows.offset`` with ``rows.pitch``
        between rows, and waits for the copy: a tensor-parallel shard's heads landing in a
        wider pool (regions.py's ``gather_rows``)."""
        ids = np.ascontiguousarray(ids, np.int32)
        per_block = rows.rows * rows.row_bytes
        if len(ids) * per_block > self.num_blocks * self.block_bytes:
            raise ValueError(f"{len(ids)} blocks of {per_block} bytes do not fit the buffer")
        bb = self.pool.block_bytes
        if self._on_device:
            import cupy

            # The id list holds num_blocks ids; a shard's smaller blocks may be more: in turns.
            with cupy.cuda.Device(self.device_id):
                for start in range(0, len(ids), self.num_blocks):
                    part = ids[start : start + self.num_blocks]
                    self._stream.synchronize()  # the previous turn's ids are read
                    ids_ptr = self._ids_to_device(part)
                    args = MoveRowsArgs(
                        self.base_ptr + start * per_block, 0, per_block, 0, rows.row_bytes,
                        self.pool.base_ptr, ids_ptr, bb, rows.offset, rows.pitch,
                        rows.rows, rows.row_bytes,
                    )  # fmt: skip
                    move_rows(self.device_id, len(part), args, self._stream.ptr)
                self._stream.synchronize()
            return
        # A host pool: the rows as strided NumPy views of the two memories.
        packed = np.ctypeslib.as_array(
            (ctypes.c_uint8 * (len(ids) * per_block)).from_address(self.base_ptr)
        ).reshape(len(ids), rows.rows, rows.row_bytes)
        flat = np.ctypeslib.as_array(
            (ctypes.c_uint8 * (self.pool.num_blocks * bb)).from_address(self.pool.base_ptr)
        )
        for k, block in enumerate(ids):
            start = int(block) * bb + rows.offset
            target = np.lib.stride_tricks.as_strided(
                flat[start:], shape=(rows.rows, rows.row_bytes), strides=(rows.pitch, 1)
            )
            target[...] = packed[k]

    def close(self) -> None:
        """Deregisters the buffer from the agent and frees it (idempotent)."""
        registration, self._registration = self._registration, None
        if registration is None:
            return
        try:
            self._agent.deregister_memory(registration)
        except Exception:
            pass  # teardown after a failure: the agent may already be unusable
        if self._stream is not None:
            self._stream.synchronize()
        self._memory = None
