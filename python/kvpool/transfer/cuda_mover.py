"""The data phase over a CUDA pool (see pieces.py for the pieces).

Three streams take part: the caller's (where the KV was written, or will be read), the
mover's copy stream (gathers, scatters) and its transport stream (sends, receives). Both
private streams first wait for the caller's stream, so a gather sees every write queued
before the transfer and a scatter never overtakes a kernel still reading the blocks' previous
contents. On the receiving side the caller's stream then waits for the transfer's last event:
work queued there afterwards (the decode that reads the request) runs after the KV landed.
No host thread waits for the device anywhere in this file.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from kvpool._core import Pool
from kvpool.kernels import _build
from kvpool.kernels._args import device_index
from kvpool.kernels._launch import Kernel, cupy_stream, launch, param_block, stream_handle
from kvpool.transfer.pieces import GROUPED
from kvpool.transfer.transport import Transport

_u64, _i64 = ctypes.c_uint64, ctypes.c_int64


class _MoveArgs(ctypes.Structure):
    """The parameters of move_blocks (cuda/copy_blocks.cu), in order."""

    _fields_ = [
        ("src_base", _u64),
        ("src_ids", _u64),
        ("src_stride", _i64),
        ("dst_base", _u64),
        ("dst_ids", _u64),
        ("dst_stride", _i64),
        ("block_bytes", _i64),
    ]


@functools.cache
def _kernel(device_id: int) -> Kernel:
    return Kernel(_build.plain_module("copy_blocks"), "move_blocks", device_id)


def move_blocks(
    device_id: int,
    count: int,
    src_base: int,
    src_ids: int,
    src_stride: int,
    dst_base: int,
    dst_ids: int,
    dst_stride: int,
    block_bytes: int,
    stream: int,
) -> None:
    """Queue the copy of `count` blocks (ids: device int32 pointers, 0 for the identity)."""
    if count == 0:
        return
    args = _MoveArgs(src_base, src_ids, src_stride, dst_base, dst_ids, dst_stride, block_bytes)
    chunks = max(1, min(64, -(-block_bytes // (16 * 256 * 4))))
    launch(_kernel(device_id), (count, chunks, 1), 256, 0, stream, param_block(args))


class MoveRowsArgs(ctypes.Structure):
    """The parameters of move_rows (cuda/copy_blocks.cu), in order."""

    _fields_ = [
        ("src_base", _u64),
        ("src_ids", _u64),
        ("src_block", _i64),
        ("src_offset", _i64),
        ("src_pitch", _i64),
        ("dst_base", _u64),
        ("dst_ids", _u64),
        ("dst_block", _i64),
        ("dst_offset", _i64),
        ("dst_pitch", _i64),
        ("rows", _i64),
        ("row_bytes", _i64),
    ]


@functools.cache
def _rows_kernel(device_id: int) -> Kernel:
    return Kernel(_build.plain_module("copy_blocks"), "move_rows", device_id)


def move_rows(device_id: int, count: int, args: MoveRowsArgs, stream: int) -> None:
    """Queue move_rows over ``count`` blocks (``args``: its parameters; ids as device int32
    pointers, 0 for the identity)."""
    if count == 0:
        return
    chunks = max(1, min(64, -(-args.rows * args.row_bytes // (16 * 256 * 4))))
    launch(_rows_kernel(device_id), (count, chunks, 1), 256, 0, stream, param_block(args))


class CudaCompletion:
    """The end of a transfer's device work: an event, and what must live until it fires."""

    def __init__(self, event: Any, keep: tuple) -> None:
        self.event = event
        self._keep = keep

    def done(self) -> bool:
        if self.event.done:
            self._keep = ()
            return True
        return False

    def synchronize(self) -> None:
        self.event.synchronize()
        self._keep = ()


class CudaMover:
    """Gathers/scatters a pool's blocks through a ring of staging slots (see pieces.py)."""

    def __init__(self, pool: Pool, ring_slots: int = 2) -> None:
        import cupy

        self.pool = pool
        self.device_id = device_index(pool)
        self.block_bytes = pool.block_bytes
        if self.block_bytes % 16 or pool.base_ptr % 16:
            raise ValueError("blocks must be 16-byte aligned")
        self.ring_slots = ring_slots
        with cupy.cuda.Device(self.device_id):
            self.copy_stream = cupy.cuda.Stream(non_blocking=True)
            self.comm_stream = cupy.cuda.Stream(non_blocking=True)
            # "slot s may be written again": recorded after the slot's last reader. Waiting on
            # a never-recorded event is a no-op, and the events outlive transfers, so a new
            # transfer's first writes also wait for the previous transfer's last reads.
            self.slot_free = [cupy.cuda.Event(disable_timing=True) for _ in range(ring_slots)]
            self.slot_full = [cupy.cuda.Event(disable_timing=True) for _ in range(ring_slots)]
        self._staging: Any = None
        self._slot_bytes = 0

    def _slots(self, chunk_bytes: int) -> list[int]:
        """Device addresses of the ring's slots, each at least chunk_bytes (grown on demand;
        a grown buffer is allocated on the copy stream, after every earlier use of the old)."""
        import cupy

        if chunk_bytes > self._slot_bytes:
            with cupy.cuda.Device(self.device_id), self.copy_stream:
                for ev in self.slot_free:
                    self.copy_stream.wait_event(ev)
                self._staging = cupy.empty(self.ring_slots * chunk_bytes, cupy.uint8)
            self._slot_bytes = chunk_bytes
        base = self._staging.data.ptr
        return [base + s * self._slot_bytes for s in range(self.ring_slots)]

    def _begin(self, user_stream: int) -> None:
        import cupy

        start = cupy.cuda.Event(disable_timing=True)
        start.record(cupy_stream(user_stream))
        self.copy_stream.wait_event(start)
        self.comm_stream.wait_event(start)

    def _ids_on_device(self, ids: np.ndarray) -> Any:
        import cupy

        with self.copy_stream:
            return cupy.asarray(np.ascontiguousarray(ids, dtype=np.int32))

    def send(
        self,
        transport: Transport,
        ids: np.ndarray,
        pieces: list,
        mode: str,
        stream: Any,
        deadline: float | None = None,  # enforced by Transfer.wait: the work is only queued
    ) -> CudaCompletion:
        import cupy

        bb = self.block_bytes
        with cupy.cuda.Device(self.device_id):
            user = stream_handle(stream)
            self._begin(user)
            done = cupy.cuda.Event(disable_timing=True)
            comm = self.comm_stream.ptr
            if mode == GROUPED:
                base = self.pool.base_ptr
                with transport.group():
                    for start, count in pieces:
                        transport.send(base + int(ids[start]) * bb, count * bb, comm)
                done.record(self.comm_stream)
                return CudaCompletion(done, ())
            ids_dev = self._ids_on_device(ids)
            slots = self._slots(max(c for _, c in pieces) * bb)
            for j, (start, count) in enumerate(pieces):
                s = j % self.ring_slots
                self.copy_stream.wait_event(self.slot_free[s])
                move_blocks(
                    self.device_id,
                    count,
                    self.pool.base_ptr,
                    ids_dev.data.ptr + 4 * start,
                    bb,
                    slots[s],
                    0,
                    bb,
                    bb,
                    self.copy_stream.ptr,
                )
                self.slot_full[s].record(self.copy_stream)
                self.comm_stream.wait_event(self.slot_full[s])
                transport.send(slots[s], count * bb, comm)
                self.slot_free[s].record(self.comm_stream)
            done.record(self.comm_stream)
            return CudaCompletion(done, (ids_dev, self._staging))

    def recv(
        self,
        transport: Transport,
        ids: np.ndarray,
        pieces: list,
        mode: str,
        stream: Any,
        deadline: float | None = None,  # enforced by Transfer.wait: the work is only queued
    ) -> CudaCompletion:
        import cupy

        bb = self.block_bytes
        with cupy.cuda.Device(self.device_id):
            user = stream_handle(stream)
            self._begin(user)
            done = cupy.cuda.Event(disable_timing=True)
            comm = self.comm_stream.ptr
            keep: tuple = ()
            if mode == GROUPED:
                base = self.pool.base_ptr
                with transport.group():
                    for start, count in pieces:
                        transport.recv(base + int(ids[start]) * bb, count * bb, comm)
                done.record(self.comm_stream)
            else:
                ids_dev = self._ids_on_device(ids)
                slots = self._slots(max(c for _, c in pieces) * bb)
                for j, (start, count) in enumerate(pieces):
                    s = j % self.ring_slots
                    self.comm_stream.wait_event(self.slot_free[s])
                    transport.recv(slots[s], count * bb, comm)
                    self.slot_full[s].record(self.comm_stream)
                    self.copy_stream.wait_event(self.slot_full[s])
                    move_blocks(
                        self.device_id,
                        count,
                        slots[s],
                        0,
                        bb,
                        self.pool.base_ptr,
                        ids_dev.data.ptr + 4 * start,
                        bb,
                        bb,
                        self.copy_stream.ptr,
                    )
                    self.slot_free[s].record(self.copy_stream)
                done.record(self.copy_stream)
                keep = (ids_dev, self._staging)
            cupy_stream(user).wait_event(done)
            return CudaCompletion(done, keep)

    def synchronize(self) -> None:
        """Wait for every queued copy and transport operation (after an abort)."""
        self.comm_stream.synchronize()
        self.copy_stream.synchronize()
