"""mla_append_latent: write new tokens' MLA latent rows into one layer of a pool's MLA group
(cuda/append_kv.cu's append_latent; a host pool writes the same bytes from NumPy)."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from kvpool import reference
from kvpool.exceptions import InvalidArgumentError
from kvpool.kernels import _build
from kvpool.kernels._args import (
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
from kvpool.kernels._mla import check_spec, host_latent_layer, mla_group
from kvpool.kernels._mla_scales import MlaScales

_u64, _i64, _i32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32
ROW = _build.MLA_LATENT_DIM + _build.MLA_ROPE_DIM  # elements of a token's row


class _AppendLatentArgs(ctypes.Structure):
    """append_latent's parameters, in order."""

    _fields_ = [
        ("latent", _u64),
        ("tok_stride", _i64),
        ("slot_mapping", _u64),
        ("base", _u64),
        ("page_stride", _i64),
        ("token_stride", _i64),
        ("block_size", _i32),
        ("num_slots", _i64),
        ("row_vecs", _i32),
        ("scale", _u64),
        ("in_bf16", _i32),
        ("fmt", _i32),
    ]


def mla_append_latent(
    pool: Any,
    spec: Any,
    layer: int,
    latent: Any,
    slot_mapping: Any,
    *,
    scales: MlaScales | None = None,
    stream: Any = None,
) -> None:
    """Write new tokens' latent rows ``latent`` [num_tokens, 576] (c_kv 512 then k_pe 64) into
    model layer `layer` (an mla_latent layer of `spec`, the ModelKvSpec `pool` was made for) at
    slot_mapping[i] = page * block_size + offset (int64; -1, or a slot past the pool, skips the
    token). A 16-bit group takes rows of its dtype and copies them byte for byte; an fp8 group
    (float8_e4m3fn) takes float16 or bfloat16 rows and `scales` (its MlaScales) and stores
    fp8(x / scale) of the layer's scale, rounded to nearest even and saturated (with
    `scales.auto_calibrate` an unset layer is calibrated from this write first). CUDA pool:
    torch tensors or CuPy arrays on its device (bfloat16 as 2-byte integers in CuPy), run on
    `stream`; a host pool takes NumPy arrays or CPU tensors and no stream."""
    check_spec(spec)
    lay = index_arg(layer, "layer")
    if not 0 <= lay < spec.num_layers:
        raise InvalidArgumentError(f"layer {lay} outside 0..{spec.num_layers - 1}")
    group, idx = spec.group_of_layer(lay)
    g, kv = mla_group(spec, group)
    if spec.page_bytes != pool.block_bytes:
        raise InvalidArgumentError(
            f"the pool's blocks ({pool.block_bytes} bytes) are not the spec's pages "
            f"({spec.page_bytes}): make the pool with Pool.for_spec(spec, ...)"
        )
    fp8 = kv.dtype in _build.MLA_FP8_DTYPES
    if fp8:
        if not isinstance(scales, MlaScales) or scales.pool is not pool or scales.group != g:
            raise InvalidArgumentError(
                f"a {kv.dtype} MLA group needs scales=MlaScales(pool, spec, {g}) of this pool"
            )
    elif scales is not None:
        raise InvalidArgumentError(f"scales are for fp8 MLA groups; group {g} holds {kv.dtype}")
    block_size = int(spec.block_size(g))
    base = int(pool.base_ptr) + spec.latent_offset_bytes(g, 0, int(idx), 0, 0)
    token_stride = spec.latent_offset_bytes(g, 0, 0, 1, 0) - spec.latent_offset_bytes(g, 0, 0, 0, 0)
    if not pool_is_cuda(pool):
        check_host_stream(stream)
        _append_host(pool, spec, g, int(idx), kv.dtype, latent, slot_mapping, scales, lay)
        return
    lv, sv = view(latent, "latent"), view(slot_mapping, "slot_mapping")
    la, sa = dev(lv, "latent"), dev(sv, "slot_mapping")
    _check_shapes(la.shape, sa.shape)
    check_int_array(sa, "slot_mapping", 8, 1)
    in_dtype = _input_dtype(la.kind, la.itemsize, kv.dtype)
    if la.strides[1] != 1 or la.ptr % 16 or (la.strides[0] * 2) % 16:
        raise InvalidArgumentError("latent rows must be contiguous and 16-byte aligned")
    n = la.shape[0]
    if n == 0:
        return
    device_id = device_index(pool)
    check_ptr(la.ptr, "latent", device_id)
    check_ptr(sa.ptr, "slot_mapping", device_id)
    import cupy

    with cupy.cuda.Device(device_id):
        sp = launch_stream(stream, device_id, latent, slot_mapping)
        wait_producers(sp, device_id, lv, sv)
        if fp8 and scales is not None and scales.auto_calibrate and not scales.is_set(lay):
            with cupy_stream(sp):
                scales.calibrate_from(lay, latent, slot_mapping)
        args = fill_args(
            _AppendLatentArgs,
            latent=la.ptr,
            tok_stride=la.strides[0] * 2,
            slot_mapping=sa.ptr,
            base=base,
            page_stride=spec.page_bytes,
            token_stride=token_stride,
            block_size=block_size,
            num_slots=pool.num_blocks * block_size,
            row_vecs=ROW // 8,
            scale=scales.ptr(lay) if fp8 and scales is not None else 0,
            in_bf16=int(in_dtype == "bfloat16"),
            fmt=_build.FP8_DTYPES[kv.dtype] if fp8 else 0,
        )
        launch(_kernel(device_id), (n, 1, 1), 128, 0, sp, param_block(args))


def _input_dtype(kind: str, itemsize: int, group_dtype: str) -> str:
    """The 16-bit type the rows hold: the group's for a 16-bit group (float16: a 2-byte float;
    bfloat16: 2-byte non-float data), float16 or bfloat16 (q-like) for an fp8 group."""
    if group_dtype in _build.MLA_FP8_DTYPES:
        if itemsize != 2:
            raise InvalidArgumentError(
                f"latent rows written into a {group_dtype} group must be float16 or bfloat16 "
                f"(it quantizes while writing), got a {itemsize}-byte type"
            )
        return "float16" if kind == "f" else "bfloat16"
    if not elem_ok(kind, itemsize, group_dtype, 2):
        raise InvalidArgumentError(
            f"latent rows must hold the group's dtype {group_dtype}, got a {itemsize}-byte "
            f"{kind!r} type"
        )
    return group_dtype


def _check_shapes(l_shape: tuple, s_shape: tuple) -> None:
    if len(l_shape) != 2 or l_shape[1] != ROW:
        raise InvalidArgumentError(f"latent must be [num_tokens, {ROW}], got {tuple(l_shape)}")
    if tuple(s_shape) != (l_shape[0],):
        raise InvalidArgumentError(f"slot_mapping must be [{l_shape[0]}], got {tuple(s_shape)}")


def _append_host(pool, spec, g, idx, dtype, latent, slot_mapping, scales, layer) -> None:
    if hasattr(latent, "__cuda_array_interface__"):
        raise InvalidArgumentError("latent is a device array but the pool is on the host")
    rows = host_array(latent, "latent")
    slots = host_array(slot_mapping, "slot_mapping")
    _check_shapes(rows.shape, slots.shape)
    if slots.dtype != np.int64:
        raise InvalidArgumentError("slot_mapping must be int64")
    in_dtype = _input_dtype(rows.dtype.kind, rows.itemsize, dtype)
    cache = host_latent_layer(pool, spec, g, idx, dtype)
    if dtype in _build.MLA_FP8_DTYPES:
        if scales.auto_calibrate:
            scales.calibrate_from(layer, rows, slots)
        x32 = reference.to_float64(rows, in_dtype).astype(np.float32)
        codes = reference.quantize_fp8(x32 / np.float32(scales.layer_scale(layer)), dtype)
        data = codes
    else:
        data = rows.view(cache.dtype)
    num_pages, bs = cache.shape[:2]
    keep = (slots >= 0) & (slots < num_pages * bs)
    page, off = np.divmod(slots[keep], bs)
    cache[page, off] = data[keep]


@functools.cache
def _kernel(device_id: int) -> Kernel:
    return Kernel(_build.plain_module("append_kv"), "append_latent", device_id)
