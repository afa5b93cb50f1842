"""Moving a transfer's blocks between a pool and a transport: the data phase of the protocol.

`make_mover` picks the mover of a pool: `HostMover` (NumPy copies) for a host pool, CudaMover
(cuda_mover.py) for a CUDA pool. Both carry the pieces that pieces.py cuts.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvpool._core import Pool
from kvpool.transfer.cuda_mover import CudaMover
from kvpool.transfer.pieces import GROUPED
from kvpool.transfer.transport import Transport


class Done:
    """The completion of work that is already finished (host pools)."""

    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostMover:
    """The data phase over a host pool (NumPy copies; the transport moves host memory)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.block_bytes = pool.block_bytes
        size = pool.num_blocks * self.block_bytes
        raw = (ctypes.c_uint8 * size).from_address(pool.base_ptr)
        self._slab = np.ctypeslib.as_array(raw).reshape(pool.num_blocks, self.block_bytes)

    def _address(self, block_id: int) -> int:
        return self.pool.base_ptr + int(block_id) * self.block_bytes

    def send(
        self,
        transport: Transport,
        ids: np.ndarray,
        pieces: list,
        mode: str,
        stream: Any,
        deadline: float | None = None,
    ) -> Done:
        with transport.group():
            for start, count in pieces:
                if mode == GROUPED:
                    transport.send(
                        self._address(ids[start]), count * self.block_bytes, None, deadline
                    )
                else:
                    staging = np.ascontiguousarray(self._slab[ids[start : start + count]])
                    transport.send(staging.ctypes.data, staging.nbytes, None, deadline)
        return Done()

    def recv(
        self,
        transport: Transport,
        ids: np.ndarray,
        pieces: list,
        mode: str,
        stream: Any,
        deadline: float | None = None,
    ) -> Done:
        with transport.group():
            for start, count in pieces:
                if mode == GROUPED:
                    transport.recv(
                        self._address(ids[start]), count * self.block_bytes, None, deadline
                    )
                else:
                    staging = np.empty((count, self.block_bytes), np.uint8)
                    transport.recv(staging.ctypes.data, staging.nbytes, None, deadline)
                    self._slab[ids[start : start + count]] = staging
        return Done()

    def synchronize(self) -> None:
        pass


def make_mover(pool: Pool, ring_slots: int = 2) -> HostMover | CudaMover:
    if str(pool.device).startswith("cuda"):
        return CudaMover(pool, ring_slots)
    return HostMover(pool)
