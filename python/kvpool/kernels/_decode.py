"""paged_attention_decode: the Python entry point of the paged decode attention kernel."""

from __future__ import annotations

import collections
import ctypes
import functools
import itertools
import math
import threading
from typing import Any

import numpy as np

from kvpool import reference
from kvpool._core import InvalidArgumentError
from kvpool.kernels import _build
from kvpool.kernels._args import (
    check_elem16,
    check_int_array,
    check_ptr,
    device_index,
    elem_ok,
    index_arg,
    pool_is_cuda,
)
from kvpool.kernels._args import dev as _dev
from kvpool.kernels._args import view as _view
from kvpool.kernels._launch import (
    Kernel,
    cupy_stream,
    launch,
    param_block,
    stream_handle,
    wait_producers,
)
from kvpool.kernels._plan import CTAS_PER_SM, TC_CTAS_PER_SM, DecodePlan, plan_decode
from kvpool.kernels._scales import KvScales

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
    scales: KvScales | None = None,
) -> Any:
    """Attention of one new query token per sequence over its paged K/V in layer `layer`.

    q: [num_seqs, num_q_heads, head_dim] in the pool's dtype (bfloat16 as a 2-byte integer
    array); num_q_heads must be a multiple of the pool's num_kv_heads (GQA, MHA, MQA).
    block_tables: int32 [num_seqs, max_blocks_per_seq] block ids (unused entries -1);
    seq_lens: int32 [num_seqs] tokens per sequence. Returns `out` ([num_seqs, num_q_heads,
    head_dim], same dtype as q), allocated when not given. Supported on a CUDA pool: dtype
    float16 or bfloat16, head_dim a multiple of 8 in 32..256, block_size a power of two in
    1..256, any group size; anything else is refused before a launch, naming that set.

    On a CUDA pool every array is a device array (__cuda_array_interface__) and the work runs
    on `stream` (CuPy's current stream by default). max_seq_len (an upper bound of seq_lens,
    read from the host) sizes the split-KV plan; when omitted it is read from seq_lens, which
    synchronises with the device (also when num_splits is given, so that the forced split
    covers every token). max_seq_len may not exceed the block table's width * block_size.
    Inputs whose __cuda_array_interface__ names a producer stream other than the launch stream
    (BlockTables.sync's arrays name the pool's stream) are waited for on the device.
    num_splits forces a plan (at most MAX_SPLITS = 128 are used); workspace (float32 device
    array of at least workspace_elems() elements) avoids an allocation, e.g. under graph capture.
    The split partials are merged inside the same launch by the last CTA of each (sequence,
    head tile), counted in a zeroed int32 buffer the library keeps per (device, stream); a CUDA
    graph that holds a call uses the counters of the stream it was captured on.
    pipeline picks the kernel, for tests and benchmarks: None or 2 (_build.TC) the tensor-core
    kernel (the default), 1 / 0 the CUDA-core kernel with cp.async stages / register loads.
    Everything derivable from the pool, layer, shapes, strides and dtypes is cached, so a
    repeated call costs a few dictionary look-ups and one or two cuLaunchKernel calls.
    On a host pool the arrays are NumPy and the float64 reference does the work.

    An fp8 pool (float8_e4m3fn / float8_e5m2; head_dim a multiple of 16 in 32..256, the
    tensor-core kernel only) needs `scales` (its KvScales); q and out are float16 or bfloat16
    (q's type decides), K/V are dequantized inside the kernel, fp32 accumulation. bfloat16
    queries run through fp16 there (exact for |q| in 6.1e-5 .. 65504).
    """
    layer = index_arg(layer, "layer")
    info = _pool_info(pool)
    if getattr(block_tables, "pool", None) is not None:
        _check_tables_pool(block_tables, pool, "block_tables")
    if getattr(seq_lens, "pool", None) is not None:
        _check_tables_pool(seq_lens, pool, "seq_lens")
    if not 0 <= layer < info.num_layers:
        raise InvalidArgumentError(f"layer {layer} outside 0..{info.num_layers - 1}")
    _check_scales(pool, info, scales, "decode")
    if not info.cuda:
        return _decode_host(q, pool, layer, block_tables, seq_lens, scale, out, scales)
    return _decode_cuda(
        q,
        pool,
        info,
        layer,
        block_tables,
        seq_lens,
        scale,
        out,
        stream,
        max_seq_len,
        num_splits,
        workspace,
        _build.TC if pipeline is None else index_arg(pipeline, "pipeline"),
        scales,
    )


def workspace_elems(num_seqs: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """float32 elements of split-KV workspace a plan with `num_splits` needs."""
    return num_seqs * min(num_splits, _build.MAX_SPLITS) * num_q_heads * (head_dim + 1)


def _check_scales(pool: Any, info: _PoolInfo, scales: KvScales | None, op: str) -> None:
    """An fp8 pool needs its own KvScales; any other pool takes none."""
    if info.layout.dtype in _build.FP8_DTYPES:
        if not isinstance(scales, KvScales) or scales.pool is not pool:
            raise InvalidArgumentError(
                f"{op} over a {info.layout.dtype} pool needs scales=KvScales(pool) of this pool"
            )
    elif scales is not None:
        raise InvalidArgumentError(f"scales are for fp8 pools; this pool holds {info.layout.dtype}")


def _host_result(res: np.ndarray, q_dtype: str, q: np.ndarray, out: Any) -> Any:
    """The float64 reference's result in q's element type: into `out` when given."""
    res = reference.from_float64(res, q_dtype)
    if out is None:
        return res.view(q.dtype)
    out[...] = res.view(out.dtype)
    return out


def _check_tables_pool(block_tables: Any, pool: Any, name: str = "block_tables") -> None:
    # BlockTables.pool (and so DeviceArray.pool) is the very Pool object BlockTables was made with.
    owner = getattr(block_tables, "pool", None)
    if owner is not None and owner is not pool:
        raise InvalidArgumentError(f"{name} belong to another pool")


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


def _decode_host(q, pool, layer, block_tables, seq_lens, scale, out, scales=None):
    layout = pool.layout
    for name, a in (("q", q), ("block_tables", block_tables), ("seq_lens", seq_lens), ("out", out)):
        if hasattr(a, "__cuda_array_interface__"):
            raise InvalidArgumentError(f"{name} is a device array but the pool is on the host")
    q = np.asarray(q)
    tables = np.asarray(block_tables)
    lens = np.asarray(seq_lens)
    _check_shapes(q.shape, tables.shape, lens.shape, layout)
    # The element types the CUDA path accepts: float16 data for a float16 pool, 2-byte non-float
    # data (bfloat16 bits) for a bfloat16 pool; never a numeric conversion. An fp8 pool: either.
    q_dtype = fp8_query_dtype(q.dtype.kind, q.itemsize, layout.dtype) if scales else layout.dtype
    if not elem_ok(q.dtype.kind, q.itemsize, q_dtype, 2 if scales else layout.elem_bytes):
        raise InvalidArgumentError(f"q has dtype {q.dtype}; the pool's dtype is {layout.dtype}")
    for name, a in (("block_tables", tables), ("seq_lens", lens)):
        if a.dtype.kind not in "iu":
            raise InvalidArgumentError(f"{name} must be an integer array, got {a.dtype}")
    if out is not None and (
        not isinstance(out, np.ndarray)
        or out.shape != q.shape
        or not elem_ok(out.dtype.kind, out.itemsize, q_dtype, q.itemsize)
    ):
        raise InvalidArgumentError(
            f"out must be a NumPy array of shape {q.shape} holding {q_dtype}, got "
            f"{getattr(out, 'dtype', type(out))} {getattr(out, 'shape', '')}"
        )
    nblk = -(-lens.astype(np.int64) // layout.block_size)
    if (lens < 0).any() or (nblk > tables.shape[1]).any():
        raise InvalidArgumentError("a seq_len is negative or needs more blocks than its table row")
    for i, n in enumerate(nblk):
        row = tables[i, :n]
        if ((row < 0) | (row >= pool.num_blocks)).any():
            raise InvalidArgumentError(f"block table row {i} holds an id outside the pool")
    res = reference.paged_attention_decode(
        q,
        pool.k_view(layer),
        pool.v_view(layer),
        tables,
        lens,
        layout.dtype,
        scale,
        q_dtype=q_dtype,
        kv_scales=scales.layer_scales(layer) if scales else None,
    )
    return _host_result(res, q_dtype, q, out)


# ---------------------------------------------------------------------------------------------
# The CUDA path. A call is split into a cached part (validation of everything that depends only
# on the pool, layer, shapes, strides and dtypes; the compiled function; a ctypes argument block)
# and a per-call part (pointers, the split plan for this max_seq_len, the stream, the launch).


@functools.cache
def _num_sms(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


class _PoolInfo:
    __slots__ = (
        "base_ptr",
        "block_size",
        "cuda",
        "device_id",
        "dtype",
        "head_dim",
        "layout",
        "num_blocks",
        "num_kv_heads",
        "num_layers",
        "serial",
        "strides",
    )

    def __init__(self, pool: Any) -> None:
        layout = pool.layout
        self.serial = next(_SERIAL)  # keys the prepared calls; never reused
        self.layout = layout
        self.num_layers = layout.num_layers
        self.cuda = pool_is_cuda(pool)
        self.base_ptr = pool.base_ptr
        self.num_blocks = pool.num_blocks
        if self.cuda:
            self.device_id = device_index(pool)
            self.strides = layout.strides()
            self.dtype = layout.dtype
            self.head_dim = layout.head_dim
            self.block_size = layout.block_size
            self.num_kv_heads = layout.num_kv_heads


_POOLS: dict[tuple[int, int, int], _PoolInfo] = {}
_SERIAL = itertools.count()


def _pool_info(pool: Any) -> _PoolInfo:
    key = (id(pool), pool.base_ptr, pool.num_blocks)
    info = _POOLS.get(key)
    if info is None or info.layout != pool.layout:
        if len(_POOLS) > 256:
            _POOLS.clear()
        info = _POOLS[key] = _PoolInfo(pool)
    return info


class _DecodeArgs(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_uint64),
        ("q_seq_stride", ctypes.c_int64),
        ("q_head_stride", ctypes.c_int64),
        ("out", ctypes.c_uint64),
        ("out_seq_stride", ctypes.c_int64),
        ("out_head_stride", ctypes.c_int64),
        ("part_o", ctypes.c_uint64),
        ("part_lse", ctypes.c_uint64),
        ("counters", ctypes.c_uint64),
        ("k_base", ctypes.c_uint64),
        ("v_base", ctypes.c_uint64),
        ("block_stride", ctypes.c_int64),
        ("token_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
        ("num_blocks", ctypes.c_int32),
        ("bs_log2", ctypes.c_int32),
        ("block_tables", ctypes.c_uint64),
        ("bt_stride", ctypes.c_int64),
        ("seq_lens", ctypes.c_uint64),
        ("num_q_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("gq", ctypes.c_int32),
        ("chunk_tokens", ctypes.c_int32),
        ("max_splits", ctypes.c_int32),
        ("scale_log2", ctypes.c_float),
    ]


class _DecodeFp8Args(ctypes.Structure):
    """The tensor-core kernel's parameters over an fp8 cache: _DecodeArgs' and the scales."""

    _fields_ = [
        *_DecodeArgs._fields_,
        ("k_scale", ctypes.c_uint64),
        ("v_scale", ctypes.c_uint64),
        ("scale_head_stride", ctypes.c_int32),
    ]


def fp8_query_dtype(kind: str, itemsize: int, pool_dtype: str) -> str:
    """The query dtype over an fp8 cache: float16 (a 2-byte float) or bfloat16 (any other
    2-byte type); anything else (fp8 queries among them) is refused."""
    if itemsize != 2:
        raise InvalidArgumentError(
            f"q over a {pool_dtype} pool must be float16 or bfloat16, got a {itemsize}-byte type"
        )
    return "float16" if kind == "f" else "bfloat16"


# _DecodeArgs fields the tensor-core kernel has and the CUDA-core kernel does not.
_TC_ONLY = ("counters", "bs_log2", "head_dim", "gq")


class _MergeArgs(ctypes.Structure):
    _fields_ = [
        ("part_o", ctypes.c_uint64),
        ("part_lse", ctypes.c_uint64),
        ("out", ctypes.c_uint64),
        ("out_seq_stride", ctypes.c_int64),
        ("out_head_stride", ctypes.c_int64),
        ("seq_lens", ctypes.c_uint64),
        ("num_q_heads", ctypes.c_int32),
        ("chunk_tokens", ctypes.c_int32),
        ("max_splits", ctypes.c_int32),
    ]


class _Prepared:
    """Everything about a decode call that does not change between calls with the same pool,
    layer, shapes, strides, dtypes, scale and kernel choice."""

    def __init__(
        self, info: _PoolInfo, layer: int, qv, btv, slv, ov, scale, pipeline, scales=None
    ) -> None:
        d = info.head_dim
        qa, bt, sl, oa = (
            _dev(qv, "q"),
            _dev(btv, "block_tables"),
            _dev(slv, "seq_lens"),
            _dev(ov, "out"),
        )
        num_seqs, hq, group = _check_shapes(qa.shape, bt.shape, sl.shape, _LayoutDims(info))
        fp8 = info.dtype in _build.FP8_DTYPES
        q_dtype = fp8_query_dtype(qa.kind, qa.itemsize, info.dtype) if fp8 else info.dtype
        check_elem16(qa, "q", q_dtype)
        if fp8:
            check_elem16(oa, "out", q_dtype)
        check_int_array(bt, "block_tables", 4, 2)
        check_int_array(sl, "seq_lens", 4, 1)
        if qa.strides[2] != 1 or qa.strides[0] % 8 or qa.strides[1] % 8:
            raise InvalidArgumentError("q rows must be contiguous and 16-byte aligned")
        if num_seqs > 65535:
            raise InvalidArgumentError("at most 65535 sequences per launch")
        if oa.shape != qa.shape or oa.itemsize != 2 or oa.strides[2] != 1:
            raise InvalidArgumentError(f"out must be [{num_seqs}, {hq}, {d}] with contiguous rows")
        st = info.strides
        eb = st["elem"]
        if eb != (1 if fp8 else 2) or st["head"] != eb * d or st["token"] % 16:
            raise InvalidArgumentError(f"layout strides {st} do not fit the decode kernel")
        self.num_seqs, self.hq, self.d = num_seqs, hq, d
        self.device_id = info.device_id
        variant: _build.TcVariant | _build.DecodeVariant
        if pipeline == _build.TC:
            try:  # a bad KVPOOL_FP8_DECODE: a KvError naming the variable, nothing prepared
                tuning = _build.fp8_decode_tuning() if fp8 else None
                variant, gq = _build.tc_variant(info.dtype, d, group, q_dtype, tuning)
            except ValueError as e:
                raise InvalidArgumentError(str(e)) from None
            ctas_per_sm = tuning.fill if tuning and tuning.fill else TC_CTAS_PER_SM
        elif pipeline in (0, 1):
            gq = _build.group_tile(group)
            variant = _build.DecodeVariant(info.dtype, d, info.block_size, gq, pipeline)
            ctas_per_sm = CTAS_PER_SM
        else:
            raise InvalidArgumentError(f"pipeline must be None, 0, 1 or {_build.TC}")
        self.tc = pipeline == _build.TC
        self.variant = variant
        self.ctas_per_seq = info.num_kv_heads * -(-group // gq)
        self.tokens_per_iter = variant.tokens_per_iter
        self.ctas_per_sm = ctas_per_sm
        self.num_sms = _num_sms(info.device_id)
        self.threads = variant.threads
        self.smem = variant.dynamic_smem_bytes
        mod = _build.decode_module(variant)
        self.kernel = Kernel(mod, variant.kernel, info.device_id, self.smem)
        # The CUDA-core baseline merges split partials in a second launch; the tensor-core
        # kernel merges inside its own launch.
        self.merge = None if self.tc else Kernel(mod, "merge_splits", info.device_id)
        k_base = info.base_ptr + layer * st["layer"]
        a = self.args = (_DecodeFp8Args if fp8 else _DecodeArgs)(
            0,
            qa.strides[0],
            qa.strides[1],
            0,
            oa.strides[0],
            oa.strides[1],
            0,
            0,
            0,
            k_base,
            k_base + st["kv"],
            st["block"],
            st["token"],
            st["head"],
            info.num_blocks,
            info.block_size.bit_length() - 1,
            0,
            bt.strides[0],
            0,
            hq,
            d,
            group,
            gq,
            0,
            0,
            (1.0 / math.sqrt(d) if scale is None else float(scale)) * LOG2E,
        )
        self.fp8 = fp8
        if fp8:
            a.scale_head_stride = scales.head_stride
        self.params = param_block(a, () if self.tc else _TC_ONLY)
        m = self.margs = _MergeArgs(0, 0, 0, oa.strides[0], oa.strides[1], 0, hq, 0, 0)
        self.mparams = param_block(m)
        self.lock = threading.Lock()


class _LayoutDims:
    """The layout fields _check_shapes reads, from the cached pool info."""

    __slots__ = ("head_dim", "num_kv_heads")

    def __init__(self, info: _PoolInfo) -> None:
        self.head_dim, self.num_kv_heads = info.head_dim, info.num_kv_heads


_PREPARED: dict[tuple, _Prepared] = {}


@functools.lru_cache(maxsize=4096)
def _plan(
    num_seqs, ctas_per_seq, max_seq_len, tokens_per_iter, num_sms, num_splits, ctas_per_sm
) -> DecodePlan:
    return plan_decode(
        num_seqs, ctas_per_seq, max_seq_len, tokens_per_iter, num_sms, num_splits, ctas_per_sm
    )


_WORKSPACES: collections.OrderedDict[tuple[int, int], Any] = collections.OrderedDict()
_MAX_WORKSPACES = 4


_COUNTERS: dict[tuple[int, int], Any] = {}
_RETIRED_COUNTERS: list[Any] = []  # outgrown buffers: a captured CUDA graph may still use them


def _counters(device_id: int, stream: int, need: int) -> int:
    """The fused merge's arrival counters for launches on (device, stream): int32, zeroed at
    allocation and left zero by every launch (the merging CTA resets its counter). Calls on one
    stream are ordered, so they share one buffer; another stream gets its own."""
    key = (device_id, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.size < need:
        import cupy

        if buf is not None:
            _RETIRED_COUNTERS.append(buf)
        with cupy.cuda.Device(device_id), cupy_stream(stream):
            buf = _COUNTERS[key] = cupy.zeros(max(need, 1 << 16), cupy.int32)
    return buf.data.ptr


def _workspace_ptr(workspace: Any, need: int, device_id: int, stream: int) -> int:
    """The split partials' float32 workspace of >= `need` elements: the caller's (checked) or
    the one cached for (device, stream). Decode and prefill share it (and _check_scales,
    _host_result); their GPU tests passed on it (bench/results/2026-12-01_8452903_h200/)."""
    if workspace is None:
        return _cached_workspace(device_id, stream, need)
    ws = _dev(_view(workspace, "workspace"), "workspace")
    if ws.typestr[1:] != "f4" or len(ws.shape) != 1 or ws.strides[0] != 1 or ws.shape[0] < need:
        raise InvalidArgumentError(
            f"workspace must be a contiguous 1-d float32 array of >= {need} elements"
        )
    check_ptr(ws.ptr, "workspace", device_id)
    return ws.ptr


def _cached_workspace(device_id: int, stream: int, need: int) -> int:
    """A float32 workspace kept per (device, stream): calls on one stream are ordered, so
    reusing it is safe (also inside a CUDA graph captured on that stream). It is allocated on
    that stream, so CuPy's pool hands its memory out again (after a replacement or an eviction
    of the least recently used of the _MAX_WORKSPACES entries) only in that stream's order."""
    key = (device_id, stream)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.size < need:
        import cupy

        with cupy.cuda.Device(device_id), cupy_stream(stream):
            ws = cupy.empty(max(need, 1 << 16), cupy.float32)
        _WORKSPACES[key] = ws
        while len(_WORKSPACES) > _MAX_WORKSPACES:
            _WORKSPACES.popitem(last=False)
    _WORKSPACES.move_to_end(key)
    return ws.data.ptr


@functools.cache
def _unsupported(dtype: str, head_dim: int, block_size: int, pipeline: int) -> str | None:
    """Why no decode kernel runs this pool's shape (None: one does); cached per shape."""
    if dtype in _build.FP8_DTYPES:
        if (
            pipeline == _build.TC
            and head_dim in _build.FP8_HEAD_DIMS
            and block_size in _build.TC_BLOCK_SIZES
        ):
            return None
        return (
            f"no decode kernel for dtype {dtype}, head_dim {head_dim}, block_size "
            f"{block_size}, pipeline {pipeline}; fp8 pools run the tensor-core kernel "
            f"(pipeline None) with head_dim a multiple of 16 in 32..256 and block_size a "
            f"power of two in 1..256"
        )
    if pipeline == _build.TC:
        ok = (
            dtype in _build.DTYPES
            and head_dim in _build.TC_HEAD_DIMS
            and block_size in _build.TC_BLOCK_SIZES
        )
        supported = _build.supported_set()
    else:
        ok = (
            dtype in _build.DTYPES
            and head_dim in _build.HEAD_DIMS
            and block_size in _build.BLOCK_SIZES
        )
        supported = (
            f"dtype float16 or bfloat16, head_dim in {_build.HEAD_DIMS}, block_size "
            f"in {_build.BLOCK_SIZES} (the CUDA-core baseline, pipeline 0/1)"
        )
    if ok:
        return None
    return (
        f"no decode kernel for dtype {dtype}, head_dim {head_dim}, block_size {block_size}; "
        f"supported: {supported}"
    )


def _decode_cuda(
    q,
    pool,
    info,
    layer,
    block_tables,
    seq_lens,
    scale,
    out,
    stream,
    max_seq_len,
    num_splits,
    workspace,
    pipeline,
    scales=None,
):
    if pipeline not in (0, 1, _build.TC):
        raise InvalidArgumentError(f"pipeline must be None, 0, 1 or {_build.TC}")
    why = _unsupported(info.dtype, info.head_dim, info.block_size, pipeline)
    if why is not None:
        raise InvalidArgumentError(why)
    qv = _view(q, "q")
    btv = _view(block_tables, "block_tables")
    slv = _view(seq_lens, "seq_lens")
    if out is None:
        import cupy

        if len(qv.shape) != 3:
            _check_shapes(qv.shape, btv.shape, slv.shape, _LayoutDims(info))
        with cupy.cuda.Device(info.device_id):
            out = cupy.empty(tuple(qv.shape), dtype=cupy.float16 if qv.is_float else cupy.uint16)
    ov = _view(out, "out")
    key = (
        info.serial,
        layer,
        qv.layout_key,
        btv.layout_key,
        slv.layout_key,
        ov.layout_key,
        scale,
        pipeline,
        None if scales is None else scales.granularity,
    )
    prep = _PREPARED.get(key)
    if prep is None:
        prep = _Prepared(info, layer, qv, btv, slv, ov, scale, pipeline, scales)
        if len(_PREPARED) > 1024:
            _PREPARED.clear()
        _PREPARED[key] = prep
    num_seqs = prep.num_seqs
    if num_seqs == 0:
        return out
    dev = info.device_id
    if qv.ptr % 16:
        raise InvalidArgumentError("q rows must be contiguous and 16-byte aligned")
    check_ptr(qv.ptr, "q", dev)
    check_ptr(btv.ptr, "block_tables", dev)
    check_ptr(slv.ptr, "seq_lens", dev)
    check_ptr(ov.ptr, "out", dev)
    sp = stream_handle(stream)
    if max_seq_len is None:
        import cupy

        # Synchronises (pass max_seq_len to avoid it); read on the launch stream, after the
        # producers of seq_lens.
        wait_producers(sp, dev, slv)
        with cupy.cuda.Device(dev), cupy_stream(sp):
            max_seq_len = int(cupy.asarray(seq_lens).max())
    else:
        max_seq_len = index_arg(max_seq_len, "max_seq_len")
    max_blocks_per_seq = btv.shape[1]
    if max_seq_len > max_blocks_per_seq * info.block_size:
        raise InvalidArgumentError(
            f"max_seq_len {max_seq_len} exceeds the block tables' {max_blocks_per_seq} blocks of "
            f"{info.block_size} tokens"
        )
    plan = _plan(
        num_seqs,
        prep.ctas_per_seq,
        max(max_seq_len, 1),
        prep.tokens_per_iter,
        prep.num_sms,
        None if num_splits is None else index_arg(num_splits, "num_splits"),
        prep.ctas_per_sm,
    )
    part_o = part_lse = counters = 0
    if plan.split:
        need = workspace_elems(num_seqs, prep.hq, prep.d, plan.num_splits)
        part_o = _workspace_ptr(workspace, need, dev, sp)
        part_lse = part_o + 4 * num_seqs * plan.num_splits * prep.hq * prep.d
        if prep.tc:
            counters = _counters(dev, sp, num_seqs * prep.ctas_per_seq)
    wait_producers(sp, dev, qv, btv, slv, ov)
    with prep.lock:
        a = prep.args
        a.q, a.out, a.part_o, a.part_lse = qv.ptr, ov.ptr, part_o, part_lse
        a.block_tables, a.seq_lens = btv.ptr, slv.ptr
        a.chunk_tokens, a.max_splits = plan.chunk_tokens, plan.num_splits
        if prep.tc:
            a.counters = counters
        if prep.fp8:
            a.k_scale, a.v_scale = scales.ptrs(layer)
        launch(
            prep.kernel,
            (plan.num_splits, prep.ctas_per_seq, num_seqs),
            prep.threads,
            prep.smem,
            sp,
            prep.params,
        )
        if plan.split and not prep.tc:
            m = prep.margs
            m.part_o, m.part_lse, m.out, m.seq_lens = part_o, part_lse, ov.ptr, slv.ptr
            m.chunk_tokens, m.max_splits = plan.chunk_tokens, plan.num_splits
            launch(prep.merge, (prep.hq, num_seqs, 1), prep.d, 0, sp, prep.mparams)
    return out
