"""append_kv and copy_blocks: the cache writers (new tokens, copy-on-write block copies)."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from kvpool import reference
from kvpool.exceptions import InvalidArgumentError
from kvpool.kernels import _build
from kvpool.kernels._args import (
    check_elem16,
    check_int_array,
    check_ptr,
    dev,
    device_index,
    elem_ok,
    index_arg,
    pool_is_cuda,
    view,
)
from kvpool.kernels._common import check_host_stream, host_array
from kvpool.kernels._launch import (
    Kernel,
    cupy_stream,
    fill_args,
    launch,
    launch_stream,
    param_block,
    wait_producers,
)
from kvpool.kernels._scales import KvScales

_u64, _i64, _i32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32


class _AppendArgs(ctypes.Structure):
    """The parameters of append_kv (cuda/append_kv.cu), in order."""

    _fields_ = [
        ("k", _u64),
        ("k_tok_stride", _i64),
        ("k_head_stride", _i64),
        ("v", _u64),
        ("v_tok_stride", _i64),
        ("v_head_stride", _i64),
        ("slot_mapping", _u64),
        ("k_base", _u64),
        ("v_base", _u64),
        ("block_stride", _i64),
        ("token_stride", _i64),
        ("head_stride", _i64),
        ("block_size", _i32),
        ("num_slots", _i64),
        ("num_heads", _i32),
        ("row_vecs", _i32),
    ]


class _AppendFp8Args(ctypes.Structure):
    """The parameters of append_kv_fp8 (cuda/append_kv.cu), in order."""

    _fields_ = [
        *_AppendArgs._fields_,
        ("k_scale", _u64),
        ("v_scale", _u64),
        ("scale_head_stride", _i32),
        ("in_bf16", _i32),
        ("fmt", _i32),
    ]


class _CopyArgs(ctypes.Structure):
    """The parameters of copy_blocks (cuda/copy_blocks.cu), in order."""

    _fields_ = [("base", _u64), ("pairs", _u64), ("block_stride", _i64), ("block_bytes", _i64)]


def append_kv(
    k: Any,
    v: Any,
    pool: Any,
    layer: int,
    slot_mapping: Any,
    *,
    stream: Any = None,
    scales: KvScales | None = None,
) -> None:
    """Write new tokens' K and V ([num_tokens, num_kv_heads, head_dim], the pool's dtype) into
    layer `layer` at slot_mapping[i] = block_id * block_size + offset (int64; -1 skips the
    token, as does a slot past the pool). Byte-exact; runs on `stream` for a CUDA pool. K and
    V are torch tensors of their true dtype (bfloat16, float16, float8_e4m3fn, ...) or CuPy
    (or any __cuda_array_interface__) arrays on the pool's device; CuPy has no bfloat16, so
    there a bfloat16 array travels as 2-byte integers. A host pool takes NumPy arrays or CPU
    tensors, and no stream.

    An fp8 pool (float8_e4m3fn / float8_e5m2) takes float16 or bfloat16 K/V and `scales` (its
    KvScales) and stores fp8(x / scale), rounded to nearest even and saturated, in the same
    launch; with `scales.auto_calibrate` an unset layer is calibrated from this write first."""
    layer = index_arg(layer, "layer")
    layout = pool.layout
    if not 0 <= layer < layout.num_layers:
        raise InvalidArgumentError(f"layer {layer} outside 0..{layout.num_layers - 1}")
    if layout.dtype in reference.FP8:
        _append_fp8(k, v, pool, layer, slot_mapping, stream, scales)
        return
    if scales is not None:
        raise InvalidArgumentError(f"scales are for fp8 pools; this pool holds {layout.dtype}")
    row = (layout.num_kv_heads, layout.head_dim)
    if not pool_is_cuda(pool):
        check_host_stream(stream)
        k, v, slots = _host_inputs(k, v, slot_mapping, row)
        for name, a in (("k", k), ("v", v)):  # the element types the CUDA path accepts
            if not elem_ok(a.dtype.kind, a.itemsize, layout.dtype, layout.elem_bytes):
                raise InvalidArgumentError(
                    f"{name} has dtype {a.dtype}; the pool's is {layout.dtype}"
                )
        kc, vc = pool.k_view(layer), pool.v_view(layer)
        reference.append_kv(k.view(kc.dtype), v.view(vc.dtype), kc, vc, slots)
        return
    (kv, vv, sv), (ka, va, sa) = _device_inputs(k, v, slot_mapping, row)
    st = layout.strides()
    row_bytes = layout.head_dim * layout.elem_bytes
    for name, a in (("k", ka), ("v", va)):
        if layout.elem_bytes == 2:
            check_elem16(a, name, layout.dtype)
        elif a.itemsize != layout.elem_bytes:
            raise InvalidArgumentError(
                f"{name} has element size {a.itemsize}; pool's is {layout.elem_bytes}"
            )
        if (
            a.strides[2] != 1
            or a.ptr % 16
            or (a.strides[0] * a.itemsize) % 16
            or (a.strides[1] * a.itemsize) % 16
        ):
            raise InvalidArgumentError(f"{name} rows must be contiguous and 16-byte aligned")
    if row_bytes % 16 or st["head"] != row_bytes or st["token"] % 16 or st["block"] % 16:
        raise InvalidArgumentError(f"layout {st} does not fit the 16-byte append kernel")
    n = ka.shape[0]
    if n == 0:
        return
    device_id = _on_pool_device(pool, ka, va, sa)
    args = fill_args(
        _AppendArgs, **_append_fields(pool, layer, ka, va, sa, ka.itemsize, row_bytes // 16)
    )
    import cupy

    with cupy.cuda.Device(device_id):
        sp = launch_stream(stream, device_id, k, v, slot_mapping)  # None: torch's or CuPy's
        wait_producers(sp, device_id, kv, vv, sv)
        launch(
            _kernel("append_kv", "append_kv", device_id), (n, 1, 1), 128, 0, sp, param_block(args)
        )


def _append_fields(
    pool: Any, layer: int, ka: Any, va: Any, sa: Any, elem_bytes: int, row_vecs: int
) -> dict[str, int]:
    """The fields of _AppendArgs (which _AppendFp8Args begins with): the inputs' pointers and
    byte strides (`elem_bytes` per element), the destination layer and the pool's strides."""
    layout = pool.layout
    st = layout.strides()
    k_base = pool.base_ptr + layer * st["layer"]
    return dict(
        k=ka.ptr,
        k_tok_stride=ka.strides[0] * elem_bytes,
        k_head_stride=ka.strides[1] * elem_bytes,
        v=va.ptr,
        v_tok_stride=va.strides[0] * elem_bytes,
        v_head_stride=va.strides[1] * elem_bytes,
        slot_mapping=sa.ptr,
        k_base=k_base,
        v_base=k_base + st["kv"],
        block_stride=st["block"],
        token_stride=st["token"],
        head_stride=st["head"],
        block_size=layout.block_size,
        num_slots=pool.num_blocks * layout.block_size,
        num_heads=layout.num_kv_heads,
        row_vecs=row_vecs,
    )


def _append_fp8(k, v, pool, layer, slot_mapping, stream, scales) -> None:
    layout = pool.layout
    if not isinstance(scales, KvScales) or scales.pool is not pool:
        raise InvalidArgumentError(
            f"append_kv into a {layout.dtype} pool needs scales=KvScales(pool) of this pool"
        )
    row = (layout.num_kv_heads, layout.head_dim)
    if not pool_is_cuda(pool):
        check_host_stream(stream)
        k, v, slots = _host_inputs(k, v, slot_mapping, row)
        in_dtype = _fp8_input_dtype(
            k.dtype.kind, k.itemsize, v.dtype.kind, v.itemsize, layout.dtype
        )
        if scales.auto_calibrate:
            scales.calibrate_from(layer, k, v, slots)
        ks, vs = scales.layer_scales(layer)
        kc, vc = pool.k_view(layer), pool.v_view(layer)
        reference.append_kv(
            reference.quantize_kv(k, in_dtype, ks, layout.dtype),
            reference.quantize_kv(v, in_dtype, vs, layout.dtype),
            kc,
            vc,
            slots,
        )
        return
    (kv, vv, sv), (ka, va, sa) = _device_inputs(k, v, slot_mapping, row)
    in_dtype = _fp8_input_dtype(ka.kind, ka.itemsize, va.kind, va.itemsize, layout.dtype)
    for name, a in (("k", ka), ("v", va)):
        if a.strides[2] != 1 or a.ptr % 16 or (a.strides[0] * 2) % 16 or (a.strides[1] * 2) % 16:
            raise InvalidArgumentError(f"{name} rows must be contiguous and 16-byte aligned")
    st = layout.strides()
    if layout.head_dim % 8 or st["head"] != layout.head_dim or st["token"] % 8:
        raise InvalidArgumentError(f"layout {st} does not fit the fp8 append kernel")
    n = ka.shape[0]
    if n == 0:
        return
    device_id = _on_pool_device(pool, ka, va, sa)
    import cupy

    with cupy.cuda.Device(device_id):
        sp = launch_stream(stream, device_id, k, v, slot_mapping)
        if scales.auto_calibrate and not scales.is_set(layer):
            wait_producers(sp, device_id, kv, vv, sv)
            with cupy_stream(sp):
                scales.calibrate_from(layer, k, v, slot_mapping)
        k_scale, v_scale = scales.ptrs(layer)
        args = fill_args(
            _AppendFp8Args,
            # 2-byte inputs: float16 or bfloat16, 8 elements per 16-byte vector
            **_append_fields(pool, layer, ka, va, sa, 2, layout.head_dim // 8),
            k_scale=k_scale,
            v_scale=v_scale,
            scale_head_stride=scales.head_stride,
            in_bf16=int(in_dtype == "bfloat16"),
            fmt=_build.FP8_DTYPES[layout.dtype],
        )
        wait_producers(sp, device_id, kv, vv, sv)
        launch(
            _kernel("append_kv", "append_kv_fp8", device_id),
            (n, 1, 1),
            128,
            0,
            sp,
            param_block(args),
        )


def _fp8_input_dtype(k_kind: str, k_size: int, v_kind: str, v_size: int, pool_dtype: str) -> str:
    """float16 or bfloat16: the 16-bit type of k and v written into an fp8 pool (fp8 or other
    inputs are refused: the pool quantizes, it never copies fp8 bytes)."""
    kinds = {(k_kind == "f", k_size), (v_kind == "f", v_size)}
    if len(kinds) != 1 or k_size != 2:
        raise InvalidArgumentError(
            f"k and v must both be float16 or both bfloat16 to write into a {pool_dtype} pool "
            f"(it quantizes while writing), got element types {k_kind}{k_size} and "
            f"{v_kind}{v_size}"
        )
    return "float16" if k_kind == "f" else "bfloat16"


@functools.cache
def _kernel(module: str, name: str, device_id: int) -> Kernel:
    return Kernel(_build.plain_module(module), name, device_id)


def _host_inputs(k: Any, v: Any, slot_mapping: Any, row: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """k, v and slot_mapping for a host pool, as NumPy arrays of the right shapes (int64 slots)."""
    if hasattr(k, "__cuda_array_interface__") or hasattr(v, "__cuda_array_interface__"):
        raise InvalidArgumentError("k/v are device arrays but the pool is on the host")
    k, v = host_array(k, "k"), host_array(v, "v")
    slots = host_array(slot_mapping, "slot_mapping")
    _check_kv_shapes(k.shape, v.shape, slots.shape, row)
    if slots.dtype != np.int64:
        raise InvalidArgumentError("slot_mapping must be int64")
    return k, v, slots


def _device_inputs(k: Any, v: Any, slot_mapping: Any, row: tuple[int, int]) -> tuple[tuple, tuple]:
    """(views, device arrays) of k, v and slot_mapping for a CUDA pool, shapes checked (int64
    slots); the views carry the producers' streams, for wait_producers."""
    views = view(k, "k"), view(v, "v"), view(slot_mapping, "slot_mapping")
    ka, va, sa = (dev(a, name) for a, name in zip(views, ("k", "v", "slot_mapping")))
    _check_kv_shapes(ka.shape, va.shape, sa.shape, row)
    check_int_array(sa, "slot_mapping", 8, 1)
    return views, (ka, va, sa)


def _on_pool_device(pool: Any, ka: Any, va: Any, sa: Any) -> int:
    """The pool's device, after checking that k, v and slot_mapping live on it."""
    device_id = device_index(pool)
    for name, a in (("k", ka), ("v", va), ("slot_mapping", sa)):
        check_ptr(a.ptr, name, device_id)
    return device_id


def _check_kv_shapes(k_shape, v_shape, s_shape, row) -> None:
    if len(k_shape) != 3 or tuple(k_shape[1:]) != row or tuple(v_shape) != tuple(k_shape):
        raise InvalidArgumentError(
            f"k and v must both be [num_tokens, {row[0]}, {row[1]}], got {k_shape} and {v_shape}"
        )
    if tuple(s_shape) != (k_shape[0],):
        raise InvalidArgumentError(f"slot_mapping must be [{k_shape[0]}], got {tuple(s_shape)}")


def check_pairs(pairs: np.ndarray, num_blocks: int) -> np.ndarray:
    """(src, dst) pairs as int64 [n, 2]; ids inside the pool, each dst once and never a src
    (so the result does not depend on the order of the copies)."""
    pairs = np.asarray(pairs)
    if pairs.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype.kind not in "iu":
        raise InvalidArgumentError(f"pairs must be an integer [n, 2] array, got {pairs.shape}")
    pairs = pairs.astype(np.int64)
    if ((pairs < 0) | (pairs >= num_blocks)).any():
        raise InvalidArgumentError(f"a block id in pairs is outside 0..{num_blocks - 1}")
    dst = pairs[:, 1]
    if len(np.unique(dst)) != len(dst) or np.isin(dst, pairs[:, 0]).any():
        raise InvalidArgumentError("a destination block appears twice or is also a source")
    return np.ascontiguousarray(pairs)


def copy_blocks(pool: Any, pairs: Any, *, stream: Any = None) -> None:
    """Copy each (src, dst) block of `pairs` ([n, 2] ids, host array) across all layers, K and
    V, in one launch (on `stream` for a CUDA pool)."""
    pairs = check_pairs(pairs, pool.num_blocks)
    layout = pool.layout
    if not pool_is_cuda(pool):
        check_host_stream(stream)
        views = [f(i) for i in range(layout.num_layers) for f in (pool.k_view, pool.v_view)]
        reference.copy_blocks(views, pairs)
        return
    import cupy

    if len(pairs) == 0:
        return
    st = layout.strides()
    if st["block"] % 16 or pool.base_ptr % 16:
        raise InvalidArgumentError("blocks must be 16-byte aligned for copy_blocks")
    chunks = max(1, min(64, -(-layout.block_bytes // (16 * 256 * 4))))
    device_id = device_index(pool)
    with cupy.cuda.Device(device_id):
        sp = launch_stream(stream, device_id, pairs)  # None: torch's or CuPy's current stream
        with cupy_stream(sp):  # the upload of the pairs is ordered before the copy kernel
            dev_pairs = cupy.asarray(pairs)
        args = fill_args(
            _CopyArgs,
            base=pool.base_ptr,
            pairs=dev_pairs.data.ptr,
            block_stride=st["block"],
            block_bytes=layout.block_bytes,
        )
        launch(
            _kernel("copy_blocks", "copy_blocks", device_id),
            (len(pairs), chunks, 1),
            256,
            0,
            sp,
            param_block(args),
        )
