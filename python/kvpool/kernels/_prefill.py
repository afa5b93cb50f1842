"""paged_attention_prefill: the Python entry point of the paged prefill (extend) kernel."""

from __future__ import annotations

import collections
import ctypes
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
    elem_ok,
    index_arg,
)
from kvpool.kernels._args import dev as _dev
from kvpool.kernels._args import view as _view
from kvpool.kernels._decode import (
    LOG2E,
    _check_scales,
    _check_tables_pool,
    _host_result,
    _num_sms,
    _pool_info,
    _PoolInfo,
    _workspace_ptr,
    fp8_query_dtype,
)
from kvpool.kernels._launch import (
    Kernel,
    cupy_stream,
    launch,
    param_block,
    stream_handle,
    wait_producers,
)
from kvpool.kernels._prefill_plan import (
    PrefillPlan,
    choose_rows,
    head_tile,
    host_lengths,
    plan_prefill,
)
from kvpool.kernels._scales import KvScales


def paged_attention_prefill(
    q: Any,
    pool: Any,
    layer: int,
    qo_indptr: Any,
    block_tables: Any,
    seq_lens: Any,
    *,
    causal: bool = True,
    scale: float | None = None,
    out: Any = None,
    stream: Any = None,
    plan: PrefillPlan | None = None,
    num_splits: int | None = None,
    workspace: Any = None,
    scales: KvScales | None = None,
) -> Any:
    """Attention of a varlen batch of query tokens over their sequences' paged K/V in `layer`.

    q: [total_q, num_q_heads, head_dim] in the pool's dtype (bfloat16 as a 2-byte integer
    array), packed by qo_indptr (int32 [num_seqs + 1], starting at 0): sequence i's queries are
    q[qo_indptr[i]:qo_indptr[i+1]], its LAST qo_len tokens, already written into the cache
    (append_kv), so seq_lens[i] >= qo_len. With `causal` (the default) query t of sequence i sees
    keys 0 .. seq_lens[i] - qo_len + t (the cached prefix in full, the new tokens up to itself);
    without, all seq_lens[i] keys. Covers prefill, prefix-cached continuation, chunked prefill,
    speculative verification and decode (qo_len 1) in one batch. block_tables int32
    [num_seqs, max_blocks]; seq_lens int32 [num_seqs]. Returns `out` [total_q, num_q_heads,
    head_dim], allocated when not given.

    On a CUDA pool every array is a device array and the work runs on `stream` (CuPy's current
    stream by default); inputs whose __cuda_array_interface__ names another producer stream
    (BlockTables.sync's arrays) are waited for on the device. The launch needs a plan made on
    the host from qo_indptr and seq_lens: pass `plan` (prefill_plan(), e.g. once per scheduler
    step, and before a CUDA-graph capture) or the plan is made here from a device-to-host copy
    of both arrays, which synchronises with the device (plans are cached by their bytes).
    num_splits forces the KV split count of a plan made here; `workspace` (float32 device array
    of >= prefill_workspace_elems() elements) avoids an allocation when the plan splits.
    On a host pool the arrays are NumPy and the float64 reference does the work.

    An fp8 pool (float8_e4m3fn / float8_e5m2) needs `scales` (its KvScales); q and out are then
    float16 or bfloat16 (bfloat16 as 2-byte integers), and the result is attention over the
    dequantized cache.
    """
    layer = index_arg(layer, "layer")
    if not isinstance(causal, (bool, np.bool_)):
        raise InvalidArgumentError(f"causal must be a bool, got {causal!r}")
    info = _pool_info(pool)
    for name, a in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if getattr(a, "pool", None) is not None:
            _check_tables_pool(a, pool, name)
    if not 0 <= layer < info.num_layers:
        raise InvalidArgumentError(f"layer {layer} outside 0..{info.num_layers - 1}")
    _check_scales(pool, info, scales, "prefill")
    if not info.cuda:
        return _prefill_host(
            q, pool, layer, qo_indptr, block_tables, seq_lens, bool(causal), scale, out, scales
        )
    return _prefill_cuda(
        q,
        pool,
        info,
        layer,
        qo_indptr,
        block_tables,
        seq_lens,
        bool(causal),
        scale,
        out,
        stream,
        plan,
        num_splits,
        workspace,
        scales,
    )


def prefill_workspace_elems(plan: PrefillPlan, head_dim: int) -> int:
    """float32 elements of workspace a split plan needs (0 when it does not split)."""
    if not plan.split:
        return 0
    return plan.num_splits * plan.total_q * plan.num_q_heads * (head_dim + 1)


def prefill_plan(
    pool: Any,
    qo_indptr: Any,
    seq_lens: Any,
    num_q_heads: int,
    *,
    causal: bool = True,
    num_splits: int | None = None,
    rows_per_cta: int | None = None,
) -> PrefillPlan:
    """A launch plan for paged_attention_prefill from HOST copies (NumPy) of qo_indptr and
    seq_lens: which query tiles exist, in which order, the CTA shape (64 query rows, or 16 when
    most of 64 would be padding) and the KV split count for this pool's device. Make it once per
    batch shape and pass it to every layer's call. num_splits and rows_per_cta (64 or 16)
    force a choice, for tests and benchmarks."""
    layout = pool.layout
    num_q_heads = index_arg(num_q_heads, "num_q_heads")
    if num_q_heads <= 0 or num_q_heads % layout.num_kv_heads:
        raise InvalidArgumentError(
            f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {layout.num_kv_heads}"
        )
    indptr, lens = host_lengths(qo_indptr, seq_lens)
    if rows_per_cta is not None and rows_per_cta not in (
        16 * _build.PREFILL_WIDE_WARPS,
        16 * _build.PREFILL_NARROW_WARPS,
    ):
        raise InvalidArgumentError(f"rows_per_cta must be None, 64 or 16, got {rows_per_cta!r}")
    key = (
        indptr.tobytes(),
        lens.tobytes(),
        id(pool),
        num_q_heads,
        bool(causal),
        None if num_splits is None else index_arg(num_splits, "num_splits"),
        rows_per_cta,
    )
    return _cached_plan(
        key, pool, indptr, lens, num_q_heads, bool(causal), num_splits, rows_per_cta
    )


_PLANS: collections.OrderedDict[tuple, PrefillPlan] = collections.OrderedDict()
_MAX_PLANS = 256


def _cached_plan(
    key, pool, indptr, lens, num_q_heads, causal, num_splits, rows_per_cta
) -> PrefillPlan:
    plan = _PLANS.get(key)
    if plan is None:
        layout = pool.layout
        info = _pool_info(pool)
        group = num_q_heads // layout.num_kv_heads
        wide = _build.PrefillVariant(layout.dtype, layout.head_dim, layout.block_size)
        narrow = _build.PrefillVariant(
            layout.dtype, layout.head_dim, layout.block_size, _build.PREFILL_NARROW_WARPS
        )
        rows = rows_per_cta or choose_rows(indptr, group, wide.rows, narrow.rows)
        variant = wide if rows == wide.rows else narrow
        num_sms = _num_sms(info.device_id) if info.cuda else 1
        plan = plan_prefill(
            indptr,
            lens,
            num_q_heads,
            layout.num_kv_heads,
            head_tile(group, rows),
            rows,
            variant.kv_tile,
            num_sms,
            variant.ctas_per_sm,
            causal=causal,
            num_splits=num_splits,
        )
        _PLANS[key] = plan
        while len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    _PLANS.move_to_end(key)
    return plan


def _check_shapes(q_shape, ip_shape, bt_shape, sl_shape, layout) -> tuple[int, int, int]:
    if len(q_shape) != 3 or q_shape[2] != layout.head_dim:
        raise InvalidArgumentError(
            f"q must be [total_q, num_q_heads, {layout.head_dim}], got {tuple(q_shape)}"
        )
    hq = q_shape[1]
    if hq == 0 or hq % layout.num_kv_heads:
        raise InvalidArgumentError(
            f"num_q_heads {hq} is not a multiple of num_kv_heads {layout.num_kv_heads}"
        )
    if len(sl_shape) != 1:
        raise InvalidArgumentError(f"seq_lens must be [num_seqs], got {tuple(sl_shape)}")
    num_seqs = sl_shape[0]
    if tuple(ip_shape) != (num_seqs + 1,):
        raise InvalidArgumentError(f"qo_indptr must be [{num_seqs + 1}], got {tuple(ip_shape)}")
    if len(bt_shape) != 2 or bt_shape[0] != num_seqs:
        raise InvalidArgumentError(f"block_tables must be [{num_seqs}, max_blocks], got {bt_shape}")
    return num_seqs, hq, hq // layout.num_kv_heads


def _check_table_rows(tables: np.ndarray, lens: np.ndarray, block_size: int, num_blocks: int):
    nblk = -(-lens // block_size)
    if (nblk > tables.shape[1]).any():
        raise InvalidArgumentError("a seq_len needs more blocks than its block table row holds")
    for i, n in enumerate(nblk):
        row = tables[i, :n]
        if ((row < 0) | (row >= num_blocks)).any():
            raise InvalidArgumentError(f"block table row {i} holds an id outside the pool")


def _prefill_host(
    q, pool, layer, qo_indptr, block_tables, seq_lens, causal, scale, out, scales=None
):
    layout = pool.layout
    arrays = (
        ("q", q),
        ("qo_indptr", qo_indptr),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("out", out),
    )
    for name, a in arrays:
        if hasattr(a, "__cuda_array_interface__"):
            raise InvalidArgumentError(f"{name} is a device array but the pool is on the host")
    q = np.asarray(q)
    tables = np.asarray(block_tables)
    if tables.dtype.kind not in "iu":
        raise InvalidArgumentError(f"block_tables must be an integer array, got {tables.dtype}")
    _check_shapes(q.shape, np.shape(qo_indptr), tables.shape, np.shape(seq_lens), layout)
    indptr, lens = host_lengths(qo_indptr, seq_lens)
    if indptr[-1] != q.shape[0]:
        raise InvalidArgumentError(f"qo_indptr ends at {indptr[-1]}, q has {q.shape[0]} tokens")
    # An fp8 pool: float16 or bfloat16 queries (and outputs of the same type).
    q_dtype = fp8_query_dtype(q.dtype.kind, q.itemsize, layout.dtype) if scales else layout.dtype
    q_bytes = 2 if scales else layout.elem_bytes
    if not elem_ok(q.dtype.kind, q.itemsize, q_dtype, q_bytes):
        raise InvalidArgumentError(f"q has dtype {q.dtype}; the pool's dtype is {layout.dtype}")
    if out is not None and (
        not isinstance(out, np.ndarray)
        or out.shape != q.shape
        or not elem_ok(out.dtype.kind, out.itemsize, q_dtype, q_bytes)
    ):
        raise InvalidArgumentError(
            f"out must be a NumPy array of shape {q.shape} holding {q_dtype}"
        )
    _check_table_rows(tables, lens, layout.block_size, pool.num_blocks)
    res = reference.paged_attention_prefill(
        q,
        pool.k_view(layer),
        pool.v_view(layer),
        indptr,
        tables,
        lens,
        layout.dtype,
        scale,
        causal,
        q_dtype=q_dtype,
        kv_scales=scales.layer_scales(layer) if scales else None,
    )
    return _host_result(res, q_dtype, q, out)


# ---------------------------------------------------------------------------------------------
# The CUDA path: a cached part per (pool, layer, shapes, strides, dtypes, scale) with the
# compiled function and a ctypes parameter block, and a per-call part (pointers, plan, launch).


class _PrefillArgs(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_uint64),
        ("q_tok_stride", ctypes.c_int64),
        ("q_head_stride", ctypes.c_int64),
        ("out", ctypes.c_uint64),
        ("out_tok_stride", ctypes.c_int64),
        ("out_head_stride", ctypes.c_int64),
        ("part_o", ctypes.c_uint64),
        ("part_lse", ctypes.c_uint64),
        ("k_base", ctypes.c_uint64),
        ("v_base", ctypes.c_uint64),
        ("block_stride", ctypes.c_int64),
        ("token_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
        ("num_blocks", ctypes.c_int32),
        ("block_tables", ctypes.c_uint64),
        ("bt_stride", ctypes.c_int64),
        ("bt_width", ctypes.c_int32),
        ("seq_lens", ctypes.c_uint64),
        ("qo_indptr", ctypes.c_uint64),
        ("work", ctypes.c_uint64),
        ("total_q", ctypes.c_int32),
        ("num_q_heads", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("gh", ctypes.c_int32),
        ("q_tile_tokens", ctypes.c_int32),
        ("causal", ctypes.c_int32),
        ("scale_log2", ctypes.c_float),
    ]


class _PrefillFp8Args(ctypes.Structure):
    """The prefill kernel's parameters over an fp8 cache: _PrefillArgs' and the scales."""

    _fields_ = [
        *_PrefillArgs._fields_,
        ("k_scale", ctypes.c_uint64),
        ("v_scale", ctypes.c_uint64),
        ("scale_head_stride", ctypes.c_int32),
    ]


class _MergeArgs(ctypes.Structure):
    _fields_ = [
        ("part_o", ctypes.c_uint64),
        ("part_lse", ctypes.c_uint64),
        ("out", ctypes.c_uint64),
        ("out_tok_stride", ctypes.c_int64),
        ("out_head_stride", ctypes.c_int64),
        ("total_q", ctypes.c_int32),
        ("num_q_heads", ctypes.c_int32),
        ("num_splits", ctypes.c_int32),
    ]


class _Prepared:
    """Everything about a prefill call that does not change between calls with the same pool,
    layer, shapes, strides, dtypes and scale."""

    def __init__(
        self, info: _PoolInfo, layer: int, qv, ipv, btv, slv, ov, scale, scales=None
    ) -> None:
        d = info.head_dim
        qa, ip, bt, sl, oa = (
            _dev(qv, "q"),
            _dev(ipv, "qo_indptr"),
            _dev(btv, "block_tables"),
            _dev(slv, "seq_lens"),
            _dev(ov, "out"),
        )
        num_seqs, hq, group = _check_shapes(qa.shape, ip.shape, bt.shape, sl.shape, info.layout)
        fp8 = info.dtype in _build.FP8_DTYPES
        q_dtype = fp8_query_dtype(qa.kind, qa.itemsize, info.dtype) if fp8 else info.dtype
        check_elem16(qa, "q", q_dtype)
        if fp8:
            check_elem16(oa, "out", q_dtype)
        check_int_array(ip, "qo_indptr", 4, 1)
        check_int_array(bt, "block_tables", 4, 2)
        check_int_array(sl, "seq_lens", 4, 1)
        for name, a in (("q", qa), ("out", oa)):
            if a.strides[2] != 1 or a.strides[0] % 8 or a.strides[1] % 8:
                raise InvalidArgumentError(f"{name} rows must be contiguous and 16-byte aligned")
        if oa.shape != qa.shape or not elem_ok(oa.kind, oa.itemsize, q_dtype, 2):
            raise InvalidArgumentError(
                f"out must be [{qa.shape[0]}, {hq}, {d}] holding {q_dtype}, got "
                f"{oa.typestr} {oa.shape}"
            )
        st = info.strides
        eb = 1 if fp8 else 2
        if st["elem"] != eb or st["head"] != eb * d or st["token"] % 16 or st["block"] % 16:
            raise InvalidArgumentError(f"layout strides {st} do not fit the prefill kernel")
        if info.num_kv_heads * group > 65535:
            raise InvalidArgumentError("too many query heads for one launch (> 65535 head tiles)")
        self.num_seqs, self.hq, self.d, self.group = num_seqs, hq, d, group
        self.total_q = qa.shape[0]
        self.device_id = info.device_id
        self.info = info
        self.q_dtype = q_dtype if fp8 else None
        self.fp8 = fp8
        self._kernels: dict[int, tuple] = {}
        k_base = info.base_ptr + layer * st["layer"]
        self.args = (_PrefillFp8Args if fp8 else _PrefillArgs)(
            0,
            qa.strides[0],
            qa.strides[1],
            0,
            oa.strides[0],
            oa.strides[1],
            0,
            0,
            k_base,
            k_base + st["kv"],
            st["block"],
            st["token"],
            st["head"],
            info.num_blocks,
            0,
            bt.strides[0],
            bt.shape[1],
            0,
            0,
            0,
            self.total_q,
            hq,
            group,
            0,
            0,
            0,
            (1.0 / math.sqrt(d) if scale is None else float(scale)) * LOG2E,
        )
        if fp8:
            self.args.scale_head_stride = scales.head_stride
        self.params = param_block(self.args)
        self.margs = _MergeArgs(0, 0, 0, oa.strides[0], oa.strides[1], self.total_q, hq, 0)
        self.mparams = param_block(self.margs)
        self.lock = threading.Lock()

    def kernels(self, warps: int) -> tuple:
        """(variant, prefill Kernel, merge Kernel) of the wide or narrow module."""
        found = self._kernels.get(warps)
        if found is None:
            info = self.info
            try:  # a bad KVPOOL_FP8_PREFILL_ASYNC: a KvError naming the variable
                fp8_async = info.dtype in _build.FP8_DTYPES and _build.fp8_prefill_async()
            except ValueError as e:
                raise InvalidArgumentError(str(e)) from None
            variant = _build.PrefillVariant(
                info.dtype, self.d, info.block_size, warps, self.q_dtype, fp8_async
            )
            mod = _build.decode_module(variant)
            found = self._kernels[warps] = (
                variant,
                Kernel(mod, variant.kernel, info.device_id, variant.dynamic_smem_bytes),
                Kernel(mod, "merge_prefill_splits", info.device_id),
            )
        return found


_PREPARED: dict[tuple, _Prepared] = {}


def _check_kernel_exists(info: _PoolInfo) -> None:
    dtypes = (*_build.DTYPES, *_build.FP8_DTYPES)
    if (
        info.dtype not in dtypes
        or info.head_dim not in _build.HEAD_DIMS
        or (info.block_size not in _build.PREFILL_BLOCK_SIZES)
    ):
        raise InvalidArgumentError(
            f"no prefill kernel for dtype {info.dtype}, head_dim {info.head_dim}, block_size "
            f"{info.block_size} (head_dim {_build.HEAD_DIMS}, block_size a power of two <= "
            f"{_build.PREFILL_BLOCK_SIZES[-1]})"
        )


def _host_plan(prep, ipv, slv, sp, qo_indptr, seq_lens, causal, num_splits, pool):
    """A plan from device-to-host copies of qo_indptr and seq_lens (synchronises)."""
    import cupy

    wait_producers(sp, prep.device_id, ipv, slv)
    with cupy.cuda.Device(prep.device_id), cupy_stream(sp):
        indptr = cupy.asnumpy(cupy.asarray(qo_indptr))
        lens = cupy.asnumpy(cupy.asarray(seq_lens))
    return prefill_plan(pool, indptr, lens, prep.hq, causal=causal, num_splits=num_splits)


def _device_work(plan: PrefillPlan, device_id: int, sp: int) -> int:
    work = plan._device_work.get(device_id)
    if work is None:
        import cupy

        with cupy.cuda.Device(device_id), cupy_stream(sp):
            work = cupy.asarray(plan.work.reshape(-1) if plan.num_items else np.zeros(2, np.int32))
        plan._device_work[device_id] = work
    return work.data.ptr


def _prefill_cuda(
    q,
    pool,
    info,
    layer,
    qo_indptr,
    block_tables,
    seq_lens,
    causal,
    scale,
    out,
    stream,
    plan,
    num_splits,
    workspace,
    scales=None,
):
    _check_kernel_exists(info)
    qv = _view(q, "q")
    ipv = _view(qo_indptr, "qo_indptr")
    btv = _view(block_tables, "block_tables")
    slv = _view(seq_lens, "seq_lens")
    if out is None:
        import cupy

        _check_shapes(qv.shape, ipv.shape, btv.shape, slv.shape, info.layout)
        with cupy.cuda.Device(info.device_id):
            out = cupy.empty(tuple(qv.shape), dtype=cupy.float16 if qv.is_float else cupy.uint16)
    ov = _view(out, "out")
    key = (
        info.serial,
        layer,
        qv.layout_key,
        ipv.layout_key,
        btv.layout_key,
        slv.layout_key,
        ov.layout_key,
        scale,
        None if scales is None else scales.granularity,
    )
    prep = _PREPARED.get(key)
    if prep is None:
        prep = _Prepared(info, layer, qv, ipv, btv, slv, ov, scale, scales)
        if len(_PREPARED) > 1024:
            _PREPARED.clear()
        _PREPARED[key] = prep
    dev = info.device_id
    for name, v in (
        ("q", qv),
        ("qo_indptr", ipv),
        ("block_tables", btv),
        ("seq_lens", slv),
        ("out", ov),
    ):
        if name in ("q", "out") and v.ptr % 16:
            raise InvalidArgumentError(f"{name} rows must be contiguous and 16-byte aligned")
        if v.ptr:  # an empty array may have no memory at all
            check_ptr(v.ptr, name, dev)
    sp = stream_handle(stream)
    if plan is None:
        plan = _host_plan(prep, ipv, slv, sp, qo_indptr, seq_lens, causal, num_splits, pool)
    elif not isinstance(plan, PrefillPlan):
        raise InvalidArgumentError(f"plan must be a PrefillPlan, got {type(plan).__name__}")
    _check_plan(plan, prep, info, causal, btv.shape[1])
    if plan.num_items == 0:
        return out
    part_o = part_lse = 0
    if plan.split:
        need = prefill_workspace_elems(plan, prep.d)
        part_o = _workspace_ptr(workspace, need, dev, sp)
        part_lse = part_o + 4 * plan.num_splits * plan.total_q * prep.hq * prep.d
    work = _device_work(plan, dev, sp)
    wait_producers(sp, dev, qv, ipv, btv, slv, ov)
    variant, kernel, merge = prep.kernels(plan.rows_per_cta // 16)
    heads = info.num_kv_heads * (prep.group // plan.head_tile)
    with prep.lock:
        a = prep.args
        a.q, a.out, a.part_o, a.part_lse = qv.ptr, ov.ptr, part_o, part_lse
        a.block_tables, a.seq_lens, a.qo_indptr, a.work = btv.ptr, slv.ptr, ipv.ptr, work
        a.gh, a.q_tile_tokens, a.causal = plan.head_tile, plan.q_tile_tokens, int(causal)
        if prep.fp8:
            a.k_scale, a.v_scale = scales.ptrs(layer)
        launch(
            kernel,
            (plan.num_items, heads, plan.num_splits),
            variant.threads,
            variant.dynamic_smem_bytes,
            sp,
            prep.params,
        )
        if plan.split:
            m = prep.margs
            m.part_o, m.part_lse, m.out, m.num_splits = part_o, part_lse, ov.ptr, plan.num_splits
            launch(merge, (plan.total_q, prep.hq, 1), prep.d, 0, sp, prep.mparams)
    return out


def _check_plan(
    plan: PrefillPlan, prep: _Prepared, info: _PoolInfo, causal: bool, table_width: int
) -> None:
    want = (prep.num_seqs, prep.total_q, prep.hq, info.num_kv_heads, causal)
    got = (plan.num_seqs, plan.total_q, plan.num_q_heads, plan.num_kv_heads, plan.causal)
    if want != got:
        raise InvalidArgumentError(
            "the plan was made for another batch (num_seqs, total_q, num_q_heads, num_kv_heads, "
            f"causal): {got}, this call: {want}"
        )
    warps = plan.rows_per_cta // 16
    tile_ok = (
        warps in (_build.PREFILL_WIDE_WARPS, _build.PREFILL_NARROW_WARPS)
        and plan.rows_per_cta % 16 == 0
        and prep.group % plan.head_tile == 0
        and plan.q_tile_tokens == plan.rows_per_cta // plan.head_tile
        and plan.kv_tile
        == _build.PrefillVariant(info.dtype, prep.d, info.block_size, warps).kv_tile
    )
    if not tile_ok:
        raise InvalidArgumentError(
            f"the plan's tiles (rows {plan.rows_per_cta}, head tile {plan.head_tile}, kv tile "
            f"{plan.kv_tile}) do not fit this pool's prefill kernel"
        )
    if plan.max_seq_len > table_width * info.block_size:
        raise InvalidArgumentError(
            f"a seq_len of the plan ({plan.max_seq_len}) exceeds the block tables' {table_width} "
            f"blocks of {info.block_size} tokens"
        )
    if plan.num_splits > 65535 or plan.num_items > 2**31 - 1:
        raise InvalidArgumentError("plan too large for one launch")
