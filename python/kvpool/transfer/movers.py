"""Moving a transfer's blocks between a pool and a transport: the data phase of the protocol.

A transfer is cut into *pieces* ``(start, count)`` over its block lists (the same on both
sides, so every send meets a receive of the same size):

- ``"staged"``: fixed-size chunks. The sender gathers each chunk's blocks into a slot of a
  contiguous staging buffer (one ``move_blocks`` launch), the transport sends the slot, the
  receiver receives into its own slot and scatters it into its blocks. Slots form a ring, so
  the gather of chunk j+1 and the scatter of chunk j-1 overlap the send of chunk j; CUDA events
  order everything on the device, with no host wait.
- ``"grouped"``: no staging; one send per run of blocks contiguous on both sides, all issued
  in one transport group (one NCCL launch).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

STAGED, GROUPED, AUTO = "staged", "grouped", "auto"
MODES = (STAGED, GROUPED)
# "auto" sends a transfer grouped when its blocks form at most this many runs contiguous on
# both sides (no gather or scatter to pay for), staged otherwise.
AUTO_MAX_RUNS = 4


def resolve_mode(mode: str, src_ids: np.ndarray, dst_ids: np.ndarray) -> str:
    """The mode a transfer uses: `mode`, or for "auto" the one AUTO_MAX_RUNS picks."""
    if mode != AUTO:
        return mode
    runs = len(plan_pieces(GROUPED, src_ids, dst_ids, len(src_ids) or 1))
    return GROUPED if runs <= AUTO_MAX_RUNS else STAGED


def plan_pieces(
    mode: str, src_ids: np.ndarray, dst_ids: np.ndarray, chunk_blocks: int
) -> list[tuple[int, int]]:
    """The pieces of a transfer of ``src_ids[i] -> dst_ids[i]``."""
    n = len(src_ids)
    if mode == STAGED:
        return [(s, min(chunk_blocks, n - s)) for s in range(0, n, chunk_blocks)]
    pieces: list[tuple[int, int]] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or src_ids[i] != src_ids[i - 1] + 1 or dst_ids[i] != dst_ids[i - 1] + 1:
            pieces.append((start, i - start))
            start = i
    return pieces


class Done:
    """The completion of work that is already finished (host pools)."""

    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostMover:
    """The data phase over a host pool (NumPy copies; the transport moves host memory)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.block_bytes = pool.layout.block_bytes
        size = pool.num_blocks * self.block_bytes
        raw = (ctypes.c_uint8 * size).from_address(pool.base_ptr)
        self._slab = np.ctypeslib.as_array(raw).reshape(pool.num_blocks, self.block_bytes)

    def _address(self, block_id: int) -> int:
        return self.pool.base_ptr + int(block_id) * self.block_bytes

    def send(self, transport: Any, ids: np.ndarray, pieces: list, mode: str, stream: Any) -> Done:
        with transport.group():
            for start, count in pieces:
                if mode == GROUPED:
                    transport.send(self._address(ids[start]), count * self.block_bytes, None)
                else:
                    staging = np.ascontiguousarray(self._slab[ids[start : start + count]])
                    transport.send(staging.ctypes.data, staging.nbytes, None)
        return Done()

    def recv(self, transport: Any, ids: np.ndarray, pieces: list, mode: str, stream: Any) -> Done:
        with transport.group():
            for start, count in pieces:
                if mode == GROUPED:
                    transport.recv(self._address(ids[start]), count * self.block_bytes, None)
                else:
                    staging = np.empty((count, self.block_bytes), np.uint8)
                    transport.recv(staging.ctypes.data, staging.nbytes, None)
                    self._slab[ids[start : start + count]] = staging
        return Done()

    def synchronize(self) -> None:
        pass


def make_mover(pool: Any, ring_slots: int = 2) -> Any:
    if str(pool.device).startswith("cuda"):
        from kvpool.transfer.cuda_mover import CudaMover

        return CudaMover(pool, ring_slots)
    return HostMover(pool)
