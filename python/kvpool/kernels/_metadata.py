"""paged_metadata: the slot mapping and FlashInfer's CSR page table made on the device.

A serving step under a CUDA graph cannot upload freshly built host arrays of new sizes: its
buffers must stay where the graph was captured. This launch fills caller-owned device buffers
from the block table and the sequence lengths already on the device (cuda/paged_metadata.cu),
so a captured step replays it with whatever the tables hold; the NumPy twin is
:func:`kvpool.reference.paged_metadata`.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from kvpool.exceptions import InvalidArgumentError
from kvpool.kernels import _build
from kvpool.kernels._args import check_int_array, check_ptr, dev, index_arg, ptr_device, view
from kvpool.kernels._launch import (
    Kernel,
    fill_args,
    launch,
    launch_stream,
    param_block,
    wait_producers,
)

_u64, _i64, _i32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32
THREADS = 1024  # kThreads of the kernel: one CTA


class _MetadataArgs(ctypes.Structure):
    """The parameters of paged_metadata (cuda/paged_metadata.cu), in order."""

    _fields_ = [
        ("block_table", _u64),
        ("table_stride", _i64),
        ("width", _i32),
        ("seq_lens", _u64),
        ("num_seqs", _i32),
        ("block_size", _i32),
        ("qo_indptr", _u64),
        ("slot_mapping", _u64),
        ("num_slots", _i64),
        ("indptr", _u64),
        ("indices", _u64),
        ("num_indices", _i64),
        ("last_page_len", _u64),
    ]


@functools.cache
def _kernel(device_id: int) -> Kernel:
    return Kernel(_build.plain_module("paged_metadata"), "paged_metadata", device_id)


def _int_vec(obj: Any, name: str, itemsize: int, length: int | None = None) -> tuple[Any, Any]:
    v = view(obj, name)
    a = dev(v, name)
    check_int_array(a, name, itemsize, 1)
    if length is not None and a.shape[0] != length:
        raise InvalidArgumentError(f"{name} must have {length} entries, got {a.shape[0]}")
    return v, a


def paged_metadata(
    block_table: Any,
    seq_lens: Any,
    block_size: int,
    *,
    qo_indptr: Any = None,
    slot_mapping: Any = None,
    indptr: Any = None,
    indices: Any = None,
    last_page_len: Any = None,
    stream: Any = None,
) -> None:
    """Fill the step's paged metadata into caller-owned device buffers, in one launch on
    `stream` (CuPy or torch arrays, or anything with __cuda_array_interface__, on one device).

    block_table: int32 [num_seqs, width]; seq_lens: int32 [num_seqs], tokens per sequence
    including this step's. With qo_indptr (int32 [num_seqs + 1], the packed step's token
    offsets) and slot_mapping (int64 [num_slots], num_slots >= the step's tokens): the slot of
    each token, -1 for the rest. With indptr (int32 [num_seqs + 1]), indices (int32
    [num_seqs * width] or longer) and last_page_len (int32 [num_seqs]): FlashInfer's CSR page
    table. Values on the device are not checked (a graph replay has no host copy of them): a
    sequence longer than its table row gets the row's pages and -1 slots past it."""
    block_size = index_arg(block_size, "block_size")
    if block_size < 1:
        raise InvalidArgumentError(f"block_size must be >= 1, got {block_size}")
    tv = view(block_table, "block_table")
    ta = dev(tv, "block_table")
    check_int_array(ta, "block_table", 4, 2)
    num_seqs, width = ta.shape
    if num_seqs > 2**31 - 2 or width < 1:
        raise InvalidArgumentError(f"block_table of shape {ta.shape} is not a table")
    lv, la = _int_vec(seq_lens, "seq_lens", 4, num_seqs)
    views = [tv, lv]
    slots = (qo_indptr, slot_mapping)
    csr = (indptr, indices, last_page_len)
    if all(x is None for x in slots + csr):
        raise InvalidArgumentError(
            "nothing to write: pass slot_mapping (with qo_indptr) "
            "and/or indptr, indices and last_page_len"
        )
    qo = sm = ip = ix = lp = None
    if any(x is not None for x in slots):
        if any(x is None for x in slots):
            raise InvalidArgumentError("the slot mapping needs both qo_indptr and slot_mapping")
        qv, qo = _int_vec(qo_indptr, "qo_indptr", 4, num_seqs + 1)
        sv, sm = _int_vec(slot_mapping, "slot_mapping", 8)
        views += [qv, sv]
    if any(x is not None for x in csr):
        if any(x is None for x in csr):
            raise InvalidArgumentError("the CSR needs indptr, indices and last_page_len")
        pv, ip = _int_vec(indptr, "indptr", 4, num_seqs + 1)
        xv, ix = _int_vec(indices, "indices", 4)
        if ix.shape[0] < num_seqs * width:
            raise InvalidArgumentError(
                f"indices must hold num_seqs * width = {num_seqs * width} entries, got {ix.shape[0]}"
            )
        gv, lp = _int_vec(last_page_len, "last_page_len", 4, num_seqs)
        views += [pv, xv, gv]
    given = [
        (name, a)
        for name, a in (
            ("block_table", ta),
            ("seq_lens", la),
            ("qo_indptr", qo),
            ("slot_mapping", sm),
            ("indptr", ip),
            ("indices", ix),
            ("last_page_len", lp),
        )
        if a is not None and a.ptr
    ]
    if not given:
        raise InvalidArgumentError("every buffer is empty: nothing to write")
    device_id = ptr_device(given[0][1].ptr)  # an empty CuPy array has no pointer (0)
    for name, a in given[1:]:
        check_ptr(a.ptr, name, device_id)
    args = fill_args(
        _MetadataArgs,
        block_table=ta.ptr,
        table_stride=ta.strides[0],
        width=width,
        seq_lens=la.ptr,
        num_seqs=num_seqs,
        block_size=block_size,
        qo_indptr=0 if qo is None else qo.ptr,
        slot_mapping=0 if sm is None else sm.ptr,
        num_slots=0 if sm is None else sm.shape[0],
        indptr=0 if ip is None else ip.ptr,
        indices=0 if ix is None else ix.ptr,
        num_indices=0 if ix is None else ix.shape[0],
        last_page_len=0 if lp is None else lp.ptr,
    )
    import cupy

    with cupy.cuda.Device(device_id):
        arrays = (block_table, seq_lens, qo_indptr, slot_mapping, indptr, indices, last_page_len)
        sp = launch_stream(stream, device_id, *arrays)  # None: torch's or CuPy's current stream
        wait_producers(sp, device_id, *views)
        launch(_kernel(device_id), (1, 1, 1), THREADS, 0, sp, param_block(args))
