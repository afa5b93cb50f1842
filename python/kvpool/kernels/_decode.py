"""paged_attention_decode: the Python entry point of the paged decode attention kernel."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from kvpool import reference
from kvpool._core import InvalidArgumentError
from kvpool.kernels import _build
from kvpool.kernels._args import (
    check_elem16,
    check_int_array,
    cupy_stream,
    dev_array,
    pool_is_cuda,
)
from kvpool.kernels._plan import DecodePlan, plan_decode, tokens_per_iteration

LOG2E = 1.4426950408889634  # the kernel works in the log2 domain (exp2)


def paged_attention_decode(
    q: Any,
    pool: Any,
    layer: int,
    block_tables: Any,
    seq_lens: Any,
    *,
    scale: float | None = None,
    out: Any = None,
    stream: Any = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    workspace: Any = None,
    pipeline: int | None = None,
) -> Any:
    """Attention of one new query token per sequence over its paged K/V in layer `layer`.

    q: [num_seqs, num_q_heads, head_dim] in the pool's dtype (bfloat16 as a 2-byte integer
    array); num_q_heads must be a multiple of the pool's num_kv_heads (GQA, MHA, MQA).
    block_tables: int32 [num_seqs, max_blocks_per_seq] block ids (unused entries -1);
    seq_lens: int32 [num_seqs] tokens per sequence. Returns `out` ([num_seqs, num_q_heads,
    head_dim], same dtype as q), allocated when not given.

    On a CUDA pool every array is a device array (__cuda_array_interface__) and the work runs
    on `stream` (CuPy's current stream by default). max_seq_len (an upper bound of seq_lens,
    read from the host) sizes the split-KV plan; when omitted it is read from seq_lens, which
    synchronises with the device. num_splits forces a plan; workspace (float32 device array of
    at least workspace_elems() elements) avoids an allocation, e.g. under graph capture.
    pipeline picks the load path (1: cp.async stages, 0: registers; default _build.PIPELINE),
    for benchmarks.
    On a host pool the arrays are NumPy and the float64 reference does the work.
    """
    layout = pool.layout
    _check_tables_pool(block_tables, pool)
    if not 0 <= layer < layout.num_layers:
        raise InvalidArgumentError(f"layer {layer} outside 0..{layout.num_layers - 1}")
    if not pool_is_cuda(pool):
        return _decode_host(q, pool, layer, block_tables, seq_lens, scale, out)
    return _decode_cuda(
        q, pool, layer, block_tables, seq_lens, scale, out, stream, max_seq_len, num_splits,
        workspace, _build.PIPELINE if pipeline is None else int(pipeline),
    )


def workspace_elems(num_seqs: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """float32 elements of split-KV workspace a plan with `num_splits` needs."""
    return num_seqs * num_splits * num_q_heads * (head_dim + 1)


def _check_tables_pool(block_tables: Any, pool: Any) -> None:
    owner = getattr(block_tables, "pool", None)
    if owner is not None and owner is not pool and getattr(owner, "base_ptr", None) != pool.base_ptr:
        raise InvalidArgumentError("block_tables belong to another pool")


def _check_shapes(q_shape, bt_shape, sl_shape, layout) -> tuple[int, int, int]:
    if len(q_shape) != 3 or q_shape[2] != layout.head_dim:
        raise InvalidArgumentError(
            f"q must be [num_seqs, num_q_heads, {layout.head_dim}], got {tuple(q_shape)}"
        )
    num_seqs, hq, _ = q_shape
    if hq == 0 or hq % layout.num_kv_heads:
        raise InvalidArgumentError(
            f"num_q_heads {hq} is not a multiple of num_kv_heads {layout.num_kv_heads}"
        )
    if len(bt_shape) != 2 or bt_shape[0] != num_seqs:
        raise InvalidArgumentError(f"block_tables must be [{num_seqs}, max_blocks], got {bt_shape}")
    if tuple(sl_shape) != (num_seqs,):
        raise InvalidArgumentError(f"seq_lens must be [{num_seqs}], got {tuple(sl_shape)}")
    return num_seqs, hq, hq // layout.num_kv_heads


def _decode_host(q, pool, layer, block_tables, seq_lens, scale, out):
    layout = pool.layout
    if hasattr(q, "__cuda_array_interface__"):
        raise InvalidArgumentError("q is a device array but the pool is on the host")
    q = np.asarray(q)
    tables = np.asarray(block_tables)
    lens = np.asarray(seq_lens)
    _check_shapes(q.shape, tables.shape, lens.shape, layout)
    if q.itemsize != layout.elem_bytes:
        raise InvalidArgumentError(f"q has dtype {q.dtype}; the pool's dtype is {layout.dtype}")
    nblk = -(-lens.astype(np.int64) // layout.block_size)
    if (lens < 0).any() or (nblk > tables.shape[1]).any():
        raise InvalidArgumentError("a seq_len is negative or needs more blocks than its table row")
    for i, n in enumerate(nblk):
        row = tables[i, :n]
        if ((row < 0) | (row >= pool.num_blocks)).any():
            raise InvalidArgumentError(f"block table row {i} holds an id outside the pool")
    res = reference.paged_attention_decode(
        q, pool.k_view(layer), pool.v_view(layer), tables, lens, layout.dtype, scale
    )
    res = reference.from_float64(res, layout.dtype).view(q.dtype)
    if out is None:
        return res
    out[...] = res
    return out


@functools.cache
def _num_sms(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def _device_index(pool: Any) -> int:
    dev = str(pool.device)
    return int(dev.split(":")[1]) if ":" in dev else 0


def _check_on_device(arr, name: str, device_id: int) -> None:
    import cupy

    attrs = cupy.cuda.runtime.pointerGetAttributes(arr.ptr)
    if attrs.type not in (2, 3) or attrs.device != device_id:  # device or managed memory
        raise InvalidArgumentError(f"{name} is not in memory of the pool's device cuda:{device_id}")


def _decode_cuda(q, pool, layer, block_tables, seq_lens, scale, out, stream, max_seq_len,
                 num_splits, workspace, pipeline):
    import cupy

    layout = pool.layout
    if layout.dtype not in _build.DTYPES or layout.head_dim not in _build.HEAD_DIMS or (
        layout.block_size not in _build.BLOCK_SIZES
    ):
        raise InvalidArgumentError(
            f"no decode kernel for dtype {layout.dtype}, head_dim {layout.head_dim}, "
            f"block_size {layout.block_size}"
        )
    qa = dev_array(q, "q")
    bt = dev_array(block_tables, "block_tables")
    sl = dev_array(seq_lens, "seq_lens")
    num_seqs, hq, group = _check_shapes(qa.shape, bt.shape, sl.shape, layout)
    check_elem16(qa, "q", layout.dtype)
    check_int_array(bt, "block_tables", 4, 2)
    check_int_array(sl, "seq_lens", 4, 1)
    if qa.strides[2] != 1 or qa.ptr % 16 or qa.strides[0] % 8 or qa.strides[1] % 8:
        raise InvalidArgumentError("q rows must be contiguous and 16-byte aligned")
    if num_seqs > 65535:
        raise InvalidArgumentError("at most 65535 sequences per launch")
    device_id = _device_index(pool)
    _check_on_device(qa, "q", device_id)
    _check_on_device(bt, "block_tables", device_id)
    strides = layout.strides()
    d = layout.head_dim
    if strides["elem"] != 2 or strides["head"] != 2 * d or strides["token"] % 16:
        raise InvalidArgumentError(f"layout strides {strides} do not fit the decode kernel")

    if out is None:
        out = cupy.empty((num_seqs, hq, d), dtype=cupy.float16 if qa.kind == "f" else cupy.uint16)
    oa = dev_array(out, "out")
    if oa.shape != qa.shape or oa.itemsize != 2 or oa.strides[2] != 1:
        raise InvalidArgumentError(f"out must be [{num_seqs}, {hq}, {d}] with contiguous rows")
    _check_on_device(oa, "out", device_id)
    if num_seqs == 0:
        return out

    gq = _build.group_tile(group)
    variant = _build.DecodeVariant(layout.dtype, d, layout.block_size, gq, pipeline)
    if max_seq_len is None and num_splits is None:
        max_seq_len = int(cupy.asarray(seq_lens).max())  # synchronises; pass max_seq_len to avoid
    plan = plan_decode(
        num_seqs,
        layout.num_kv_heads * (group // gq),
        max_seq_len or 1,
        tokens_per_iteration(d, gq),
        _num_sms(device_id),
        num_splits,
    )
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    with cupy_stream(stream):
        _launch(variant, plan, qa, oa, bt, sl, pool, layer, hq, group, gq, scale, workspace)
    return out


def _launch(variant, plan: DecodePlan, qa, oa, bt, sl, pool, layer, hq, group, gq, scale,
            workspace) -> None:
    import cupy

    layout = pool.layout
    st = layout.strides()
    num_seqs, d = qa.shape[0], layout.head_dim
    mod = _build.decode_module(variant)
    k_base = pool.base_ptr + layer * st["layer"]
    v_base = k_base + st["kv"]
    part_o = part_lse = 0
    if plan.split:
        need = workspace_elems(num_seqs, hq, d, plan.num_splits)
        if workspace is None:
            workspace = cupy.empty(need, dtype=cupy.float32)
        ws = dev_array(workspace, "workspace")
        if ws.typestr[1:] != "f4" or ws.shape[0] < need:
            raise InvalidArgumentError(f"workspace must be float32 with >= {need} elements")
        part_o = ws.ptr
        part_lse = ws.ptr + 4 * num_seqs * plan.num_splits * hq * d
    i64, i32 = np.int64, np.int32
    args = (
        np.uint64(qa.ptr), i64(qa.strides[0]), i64(qa.strides[1]),
        np.uint64(oa.ptr), i64(oa.strides[0]), i64(oa.strides[1]),
        np.uint64(part_o), np.uint64(part_lse),
        np.uint64(k_base), np.uint64(v_base),
        i64(st["block"]), i64(st["token"]), i64(st["head"]), i32(pool.num_blocks),
        np.uint64(bt.ptr), i64(bt.strides[0]), np.uint64(sl.ptr),
        i32(hq), i32(group), i32(plan.chunk_tokens), i32(plan.num_splits),
        np.float32(scale * LOG2E),
    )
    grid = (plan.num_splits, layout.num_kv_heads * (group // gq), num_seqs)
    kernel = mod.get_function("paged_decode")
    smem = variant.dynamic_smem_bytes
    if smem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < smem:
        kernel.max_dynamic_shared_size_bytes = smem
    kernel(grid, (32 * _build.DECODE_WARPS,), args, shared_mem=smem)
    if plan.split:
        merge_args = (
            np.uint64(part_o), np.uint64(part_lse),
            np.uint64(oa.ptr), i64(oa.strides[0]), i64(oa.strides[1]),
            np.uint64(sl.ptr), i32(hq), i32(plan.chunk_tokens), i32(plan.num_splits),
        )
        mod.get_function("merge_splits")((hq, num_seqs), (d,), merge_args)
