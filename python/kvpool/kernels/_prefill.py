"""Paged prefill (extend) attention: ``prefill_plan(...)`` once per step,
``PrefillPlan.run(q, layer)`` per layer, and the one-call form ``paged_attention_prefill``."""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from typing import Any

import numpy as np

from kvpool import reference
from kvpool.exceptions import InvalidArgumentError
from kvpool.kernels import _build, _tuning
from kvpool.kernels._args import (
    ArrayView,
    check_elem16,
    check_int_array,
    check_ptr,
    elem_ok,
    index_arg,
)
from kvpool.kernels._args import dev as _dev
from kvpool.kernels._args import view as _view
from kvpool.kernels._common import (
    PoolInfo,
    Workspace,
    call_stream,
    check_host_stream,
    check_layer,
    check_plan_pool,
    check_scales,
    check_tables_pool,
    compiled_kernel,
    compute_capability,
    fp8_query_dtype,
    host_array,
    host_query,
    host_result,
    host_scale,
    new_out,
    num_sms,
    same_batch_array,
    softmax_scale_log2,
)
from kvpool.kernels._launch import (
    cupy_stream,
    fill_args,
    launch,
    launch_stream,
    param_block,
    wait_producers,
)
from kvpool.kernels._prefill_args import (
    SM80_ONLY,
    SM90_ONLY,
    PrefillArgs,
    PrefillFp8Args,
    PrefillMergeArgs,
)
from kvpool.kernels._prefill_work import (
    PrefillWork,
    choose_rows,
    head_tile,
    host_lengths,
    plan_work,
)
from kvpool.kernels._scales import KvScales
from kvpool.kernels._window import (
    bind_first_page,
    check_host_window_rows,
    check_window,
    device_sinks,
    host_sinks,
)


def prefill_plan(
    pool: Any,
    qo_indptr: Any,
    block_tables: Any,
    seq_lens: Any,
    num_q_heads: int,
    *,
    causal: bool = True,
    scale: float | None = None,
    scales: KvScales | None = None,
    num_splits: int | None = None,
    stream: Any = None,
    workspace: Any = None,
    window: int | None = None,
    chunk: int | None = None,
    first_page: Any = None,
    use_sinks: bool = False,
) -> PrefillPlan:
    """A prefill plan for one step's varlen batch: made once, then ``plan.run(q, layer)`` per
    layer.

    qo_indptr: [num_seqs + 1] offsets of each sequence's query tokens in q (from 0); seq_lens:
    [num_seqs] tokens per sequence, the queries included (they are its LAST qo_len tokens,
    already in the cache: append_kv first); block_tables int32 [num_seqs, max_blocks]. With
    `causal` (the default) query t of sequence i sees keys 0 .. seq_lens[i] - qo_len + t;
    without, all seq_lens[i] keys. `scale` (default 1/sqrt(head_dim)) is a finite real number;
    an fp8 pool needs its `scales`.

    The plan is made on the host: give qo_indptr and seq_lens as host arrays (NumPy, lists, CPU
    tensors) and it keeps checked copies, chooses the query tiles (64 query rows per CTA, or 16
    when most of 64 would be padding), their order and the KV split count (`num_splits`
    forces it), and on a CUDA pool uploads the copies and the work items to device arrays it
    owns, which the kernel reads. Given as device arrays they are read back (which
    synchronises) and the kernel reads the caller's arrays. block_tables is bound as given
    (a device array on a CUDA pool) and read at every run. When the plan splits it owns its
    float32 partials or uses `workspace` (>= plan.workspace_elems elements). Runs are queued on
    `stream`, in order (by default the current stream when the plan is made: torch's when a
    batch array is a torch tensor, else CuPy's); after the
    first run per layout of q and out a run allocates nothing and does not synchronise, so it
    can be captured in a CUDA graph (keep the plan alive as long as the graph).

    Sliding-window and chunked local layers (conventions in `kvpool.kernels._window`):
    `window` w, query position p sees keys (p - w, p]; `chunk` c, keys [p // c * c, p]; both
    need `causal`. first_page (int32 [num_seqs], bound like block_tables; by default 0): the
    page of the sequence that table entry 0 holds (a window group's table holds only its
    live pages). Only the window's pages are read; the work per query is the window's.
    `use_sinks`: the runs take attention sinks (run's `sinks`). These run on the Ampere-style
    kernel (paged_prefill.cu) on every device, the sm_90 one included.

    On a host pool everything is NumPy (or CPU tensors), there is no stream nor workspace, and
    run() computes the float64 reference.
    """
    return PrefillPlan(
        pool,
        qo_indptr,
        block_tables,
        seq_lens,
        num_q_heads,
        causal=causal,
        scale=scale,
        scales=scales,
        num_splits=num_splits,
        stream=stream,
        workspace=workspace,
        window=window,
        chunk=chunk,
        first_page=first_page,
        use_sinks=use_sinks,
    )


class PrefillPlan:
    """One step's prefill batch over one pool, made by :func:`prefill_plan`: the work items
    (`work`, a PrefillWork), the batch's lengths, the split workspace and the launch blocks;
    ``run(q, layer)`` per layer."""

    def __init__(
        self,
        pool: Any,
        qo_indptr: Any,
        block_tables: Any,
        seq_lens: Any,
        num_q_heads: int,
        *,
        causal: bool,
        scale: float | None,
        scales: KvScales | None,
        num_splits: int | None,
        stream: Any,
        workspace: Any,
        window: int | None = None,
        chunk: int | None = None,
        first_page: Any = None,
        use_sinks: bool = False,
    ) -> None:
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        if not isinstance(use_sinks, (bool, np.bool_)):
            raise TypeError(f"use_sinks must be a bool, got {use_sinks!r}")
        self.window, self.chunk = check_window(window, chunk)  # 0: none
        if (self.window or self.chunk) and not causal:
            raise InvalidArgumentError("a sliding window or a chunk needs causal=True")
        self.use_sinks = bool(use_sinks)
        self._first_page: Any = None  # bound after the lengths (bind_first_page)
        self._first_page_arg = first_page
        check_tables_pool(block_tables, pool, "block_tables")
        check_tables_pool(seq_lens, pool, "seq_lens")
        info = PoolInfo(pool)
        check_scales(pool, info, scales, "prefill")
        hq = index_arg(num_q_heads, "num_q_heads")
        if hq <= 0 or hq % info.num_kv_heads:
            raise InvalidArgumentError(
                f"num_q_heads {hq} is not a multiple of num_kv_heads {info.num_kv_heads}"
            )
        if num_splits is not None:
            num_splits = index_arg(num_splits, "num_splits")
        self.pool, self.info, self.scales, self.causal = pool, info, scales, bool(causal)
        self.num_q_heads, self.group = hq, hq // info.num_kv_heads
        self.scale = host_scale(scale, info.head_dim)
        self.block_tables = block_tables
        self._bt_view: ArrayView | None = None
        self._lens_views: tuple[ArrayView, ArrayView] | None = None
        self._workspace: Workspace | None = None
        if info.cuda:
            self._check_kernel_exists()
            self.stream = launch_stream(stream, info.device_id, block_tables, qo_indptr, seq_lens)
            self._bt_view = _view(block_tables, "block_tables")
            bt = _dev(self._bt_view, "block_tables")
            check_int_array(bt, "block_tables", 4, 2)
            tables_shape = bt.shape
        else:
            check_host_stream(stream)
            if workspace is not None:
                raise InvalidArgumentError("a host pool needs no workspace")
            self._tables = host_array(block_tables, "block_tables")
            if self._tables.dtype.kind not in "iu":
                raise InvalidArgumentError(
                    f"block_tables must be an integer array, got {self._tables.dtype}"
                )
            tables_shape = self._tables.shape
        self.qo_indptr, self.seq_lens = self._host_lengths(qo_indptr, seq_lens)
        num_seqs = len(self.seq_lens)
        if len(tables_shape) != 2 or tables_shape[0] != num_seqs:
            raise InvalidArgumentError(
                f"block_tables must be [{num_seqs}, max_blocks], got {tuple(tables_shape)}"
            )
        self.num_seqs, self.total_q, self._width = (
            num_seqs,
            int(self.qo_indptr[-1]),
            tables_shape[1],
        )
        self.work = self._plan_work(num_splits)
        self._first_page = bind_first_page(first_page, num_seqs, info.cuda, info.device_id)
        if info.cuda:
            self._plan_cuda(qo_indptr, seq_lens, workspace)
        else:
            self._check_host_rows()

    # -- binding -------------------------------------------------------------------------------

    def _host_lengths(self, qo_indptr: Any, seq_lens: Any) -> tuple[np.ndarray, np.ndarray]:
        for name, a in (("qo_indptr", qo_indptr), ("seq_lens", seq_lens)):
            if not self.info.cuda and hasattr(a, "__cuda_array_interface__"):
                raise InvalidArgumentError(f"{name} is a device array but the pool is on the host")
        if self.info.cuda and any(_on_device(a) for a in (qo_indptr, seq_lens)):
            self._lens_views = (_view(qo_indptr, "qo_indptr"), _view(seq_lens, "seq_lens"))
            return host_lengths(*self._read_back(qo_indptr, seq_lens))
        return host_lengths(host_array(qo_indptr, "qo_indptr"), host_array(seq_lens, "seq_lens"))

    def _read_back(self, qo_indptr: Any, seq_lens: Any) -> tuple[np.ndarray, np.ndarray]:
        """Device-to-host copies of qo_indptr and seq_lens (synchronises), on the plan's stream
        after their producers."""
        import cupy

        ipv, slv = self._lens_views  # type: ignore[misc]
        for name, v in (("qo_indptr", ipv), ("seq_lens", slv)):
            check_int_array(_dev(v, name), name, 4, 1)
            if v.ptr:
                check_ptr(v.ptr, name, self.info.device_id)
        wait_producers(self.stream, self.info.device_id, ipv, slv)
        with cupy.cuda.Device(self.info.device_id), cupy_stream(self.stream):
            return cupy.asnumpy(cupy.asarray(qo_indptr)), cupy.asnumpy(cupy.asarray(seq_lens))

    def check_batch(self, qo_indptr: Any, block_tables: Any, seq_lens: Any) -> None:
        """Refuse arrays other than the ones the plan was made for (another batch)."""
        ipv, slv = self._lens_views or (None, None)
        same_batch_array(block_tables, self.block_tables, self._bt_view, "block_tables")
        for name, given, host, bound_view in (
            ("qo_indptr", qo_indptr, self.qo_indptr, ipv),
            ("seq_lens", seq_lens, self.seq_lens, slv),
        ):
            if bound_view is None:  # the plan holds the lengths: compare with its copy
                same_batch_array(given, host, None, name)
            else:  # the kernel reads the caller's device arrays: the same ones
                same_batch_array(given, None, bound_view, name)

    def _check_kernel_exists(self) -> None:
        info = self.info
        dtypes = (*_build.DTYPES, *_build.FP8_DTYPES)
        if (
            info.dtype not in dtypes
            or info.head_dim not in _build.HEAD_DIMS
            or (info.block_size not in _build.PREFILL_BLOCK_SIZES)
        ):
            raise InvalidArgumentError(
                f"no prefill kernel for dtype {info.dtype}, head_dim {info.head_dim}, block_size "
                f"{info.block_size} (head_dim {_build.HEAD_DIMS}, block_size a power of two <= "
                f"{_build.PREFILL_BLOCK_SIZES[-1]}; head_dim 512 with K = V: "
                "kvpool.kernels.shared_kv_extend_plan)"
            )

    def _plan_work(self, num_splits: int | None) -> PrefillWork:
        info, tuning = self.info, _tuning.current()
        self.fp8_async = info.dtype in _build.FP8_DTYPES and tuning.fp8_prefill_async
        narrow = self._variant(_build.PREFILL_NARROW_WARPS)
        # Sliding windows, chunks, window-relative tables and sinks run on paged_prefill.cu
        # everywhere: the sm_90 kernel (paged_prefill_sm90.cu) has none of them, so on
        # compute capability 9.0 such a plan takes the Ampere-style kernel.
        self._masked = bool(
            self.window or self.chunk or self.use_sinks or self._first_page_arg is not None
        )
        sm90 = not self._masked and self._use_sm90(tuning)
        if self._masked and tuning.prefill_kernel == "sm90":
            raise InvalidArgumentError(
                "prefill_kernel='sm90' runs no sliding window, chunk, window-relative table "
                "or sinks; those run on the 'sm80' kernel (the default picks it)"
            )
        if sm90 and tuning.prefill_rows_per_cta is None:
            wide = _build.sm90_prefill_variant(
                info.dtype, info.head_dim, info.block_size, tuning.prefill_tma
            )
            if tuning.prefill_kernel == "sm90":  # the test knob: its tiles wherever it can
                rows = wide.rows
            else:
                rows = choose_rows(self.qo_indptr, self.group, wide.rows, narrow.rows)
        else:
            wide = self._variant(_build.PREFILL_WIDE_WARPS)
            rows = tuning.prefill_rows_per_cta or choose_rows(
                self.qo_indptr, self.group, wide.rows, narrow.rows
            )
        variant = wide if rows == wide.rows else narrow
        self.variant = variant
        return plan_work(
            self.qo_indptr,
            self.seq_lens,
            self.num_q_heads,
            info.num_kv_heads,
            head_tile(self.group, rows),
            rows,
            variant.kv_tile,
            num_sms(info.device_id) if info.cuda else 1,
            variant.ctas_per_sm,
            causal=self.causal,
            num_splits=num_splits,
            window=self.window,
            chunk=self.chunk,
        )

    def _use_sm90(self, tuning: _tuning.Tuning) -> bool:
        """Whether the plan runs the Hopper kernel (paged_prefill_sm90.cu) for its wide tiles:
        a 16-bit cache on a CUDA device of compute capability 9.0, by default when
        _build.SM90_PREFILL_DEFAULT is set or when _tuning's prefill_kernel forces it."""
        info, choice = self.info, tuning.prefill_kernel
        if choice == "sm80" or not info.cuda:
            return False
        usable = info.dtype in _build.DTYPES and compute_capability(info.device_id) == 90
        if choice == "sm90":
            if not usable:
                raise InvalidArgumentError(
                    "prefill_kernel='sm90' needs a float16 / bfloat16 pool on a device of "
                    f"compute capability 9.0 (dtype {info.dtype}, device compute capability "
                    f"{compute_capability(info.device_id)})"
                )
            return True
        return usable and _build.SM90_PREFILL_DEFAULT

    def _variant(self, warps: int, q_dtype: str | None = None) -> _build.PrefillVariant:
        info = self.info
        fp8 = info.dtype in _build.FP8_DTYPES
        return _build.PrefillVariant(
            info.dtype,
            info.head_dim,
            info.block_size,
            warps,
            (q_dtype or "float16") if fp8 else None,
            self.fp8_async,
        )

    @property
    def num_splits(self) -> int:
        return self.work.num_splits

    @property
    def split(self) -> bool:
        """Whether the plan cuts the keys into KV splits (merged after the launch)."""
        return self.work.split

    @property
    def rows_per_cta(self) -> int:
        return self.work.rows_per_cta

    @property
    def workspace_elems(self) -> int:
        """float32 elements of workspace the plan's split needs (0 when it does not split)."""
        return prefill_workspace_elems(self.work, self.info.head_dim)

    def _plan_cuda(self, qo_indptr: Any, seq_lens: Any, workspace: Any) -> None:
        import cupy

        info, w, dev = self.info, self.work, self.info.device_id
        # A window-relative table needs only the window's pages: the kernel bounds its entries
        # by the row's width (bt_width) instead.
        if self._first_page is None and w.max_seq_len > self._width * info.block_size:
            raise InvalidArgumentError(
                f"a seq_len ({w.max_seq_len}) exceeds the block tables' {self._width} blocks "
                f"of {info.block_size} tokens"
            )
        if w.num_splits > 65535 or w.num_items > 2**31 - 1:
            raise InvalidArgumentError("plan too large for one launch")
        if info.num_kv_heads * self.group > 65535:
            raise InvalidArgumentError("too many query heads for one launch (> 65535 head tiles)")
        if w.num_items and self._bt_view is not None and self._bt_view.ptr:
            check_ptr(self._bt_view.ptr, "block_tables", dev)
        if w.split or workspace is not None:
            self._workspace = Workspace(workspace, self.workspace_elems, dev, self.stream)
        with cupy.cuda.Device(dev), cupy_stream(self.stream):
            # The plan's own device arrays: the work items, and the lengths when they came
            # from the host (the kernel then reads exactly what the work was made from).
            flat = w.work.reshape(-1) if w.num_items else np.zeros(2, np.int32)
            self._device_work = cupy.asarray(flat)
            if self._lens_views is None:
                self._device_lens = (
                    cupy.asarray(self.qo_indptr.astype(np.int32)),
                    cupy.asarray(self.seq_lens.astype(np.int32)),
                )
                ip_ptr, sl_ptr = (int(a.data.ptr) for a in self._device_lens)
            else:
                ip_ptr, sl_ptr = (v.ptr for v in self._lens_views)
        self._lens_ptrs = ip_ptr, sl_ptr
        self._launches: dict[tuple, _Launch] = {}
        self._lock = threading.Lock()

    def _check_host_rows(self) -> None:
        tables, lens = self._tables, self.seq_lens
        if self._first_page is None and not (self.window or self.chunk):
            nblk = -(-lens // self.info.block_size)
            if (nblk > tables.shape[1]).any():
                raise InvalidArgumentError(
                    "a seq_len needs more blocks than its block table row holds"
                )
        qo_lens = np.diff(self.qo_indptr)
        starts = np.where(
            qo_lens > 0,
            reference.key_start(lens - qo_lens, self.window or None, self.chunk or None),
            lens,
        )
        check_host_window_rows(
            tables, lens, self._first_page, starts, self.info.block_size, self.info.num_blocks
        )

    # -- running -------------------------------------------------------------------------------

    def run(self, q: Any, layer: int, *, out: Any = None, sinks: Any = None) -> Any:
        """Attention of the batch's query tokens (q: [total_q, num_q_heads, head_dim], packed
        by qo_indptr; torch or CuPy, the pool's dtype, or float16 / bfloat16 over an fp8 pool)
        over layer `layer`. Returns `out` (written in place when given; else a new array of
        q's kind and dtype). `sinks` (a plan made with use_sinks=True): this layer's attention
        sinks, float32 [num_q_heads] logits that join each head's denominator only."""
        layer = check_layer(layer, self.info)
        if sinks is not None and not self.use_sinks:
            raise InvalidArgumentError("sinks given to a plan made without use_sinks=True")
        if not self.info.cuda:
            return self._run_host(q, layer, out, sinks)
        info, pool = self.info, self.pool
        if pool.num_blocks != info.num_blocks or pool.base_ptr != info.base_ptr:
            raise InvalidArgumentError("the pool grew since the plan was made: make a new plan")
        qv = _view(q, "q")
        if out is None:
            self._check_q_shape(qv.shape)
            out = new_out(q, qv, info.device_id)
        ov = _view(out, "out")
        key = (qv.layout_key, ov.layout_key)
        ln = self._launches.get(key)
        if ln is None:
            ln = self._launches[key] = _Launch(self, qv, ov)
        for name, v in (("q", qv), ("out", ov)):
            if v.ptr % 16:
                raise InvalidArgumentError(f"{name} rows must be contiguous and 16-byte aligned")
            if v.ptr:  # an empty array may have no memory at all
                check_ptr(v.ptr, name, info.device_id)
        sinks_ptr, sv = device_sinks(sinks, self.num_q_heads, info.device_id)
        if self.work.num_items == 0:
            return out
        views = [qv, ov, *(self._lens_views or ()), self._bt_view]
        views += [x for x in (self._first_page, sv) if x is not None]
        wait_producers(self.stream, info.device_id, *views)
        with self._lock:
            ln.launch(self, qv.ptr, ov.ptr, layer, sinks_ptr)
        return out

    def _check_q_shape(self, shape: tuple[int, ...]) -> None:
        want = (self.total_q, self.num_q_heads, self.info.head_dim)
        if len(shape) == 3 and tuple(shape[1:]) == want[1:] and shape[0] != self.total_q:
            raise InvalidArgumentError(f"qo_indptr ends at {self.total_q}, q has {shape[0]} tokens")
        if tuple(shape) != want:
            raise InvalidArgumentError(
                f"q must be [total_q, num_q_heads, head_dim] = {list(want)}, got {tuple(shape)}"
            )

    def _run_host(self, q: Any, layer: int, out: Any, sinks: Any = None) -> Any:
        info = self.info
        sinks64 = host_sinks(sinks, self.num_q_heads)
        fp8 = self.scales is not None
        q_np, q_dtype, q_bytes = host_query(q, info, fp8, self._check_q_shape, out)
        self._check_host_rows()  # the tables' contents may have changed since the plan
        res = reference.paged_attention_prefill(
            q_np,
            self.pool.k_view(layer),
            self.pool.v_view(layer),
            self.qo_indptr,
            self._tables,
            self.seq_lens,
            info.dtype,
            self.scale,
            self.causal,
            q_dtype=q_dtype,
            kv_scales=self.scales.layer_scales(layer) if self.scales else None,
            window=self.window or None,
            chunk=self.chunk or None,
            sinks=sinks64,
            first_page=self._first_page,
        )
        return host_result(res, q_dtype, q, q_np, out)


def prefill_workspace_elems(work: PrefillWork | PrefillPlan, head_dim: int) -> int:
    """float32 elements of workspace a split prefill needs (0 when it does not split)."""
    if isinstance(work, PrefillPlan):
        work = work.work
    if not work.split:
        return 0
    return work.num_splits * work.total_q * work.num_q_heads * (head_dim + 1)


class _Launch:
    """A plan's parameter blocks for one layout of q and out (checked once): the pointers of q,
    out, the layer and its scales are rewritten per run."""

    def __init__(self, plan: PrefillPlan, qv: ArrayView, ov: ArrayView) -> None:
        info, w = plan.info, plan.work
        d, hq = info.head_dim, plan.num_q_heads
        qa, oa = _dev(qv, "q"), _dev(ov, "out")
        plan._check_q_shape(qa.shape)
        fp8 = info.dtype in _build.FP8_DTYPES
        q_dtype = fp8_query_dtype(qa.kind, qa.itemsize, info.dtype) if fp8 else info.dtype
        check_elem16(qa, "q", q_dtype)
        if fp8:
            check_elem16(oa, "out", q_dtype)
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
        variant = dataclasses.replace(plan.variant, q_dtype=q_dtype if fp8 else None)
        self.variant = variant
        self.kernel = compiled_kernel(
            variant, variant.kernel, info.device_id, variant.dynamic_smem_bytes
        )
        self.merge = compiled_kernel(variant.merge_variant, "merge_prefill_splits", info.device_id)
        ws = plan._workspace
        part_o = ws.ptr if w.split and ws is not None else 0
        part_lse = part_o + 4 * w.num_splits * w.total_q * hq * d if part_o else 0
        ip_ptr, sl_ptr = plan._lens_ptrs
        btv = plan._bt_view
        assert btv is not None
        fields = dict(
            q=0,
            q_tok_stride=qa.strides[0],
            q_head_stride=qa.strides[1],
            out=0,
            out_tok_stride=oa.strides[0],
            out_head_stride=oa.strides[1],
            part_o=part_o,
            part_lse=part_lse,
            k_base=0,
            v_base=0,
            block_stride=st["block"],
            token_stride=st["token"],
            head_stride=st["head"],
            num_blocks=info.num_blocks,
            block_tables=btv.ptr,
            bt_stride=_dev(btv, "block_tables").strides[0],
            bt_width=plan._width,
            seq_lens=sl_ptr,
            qo_indptr=ip_ptr,
            work=int(plan._device_work.data.ptr),
            total_q=w.total_q,
            num_q_heads=hq,
            group=plan.group,
            gh=w.head_tile,
            q_tile_tokens=w.q_tile_tokens,
            causal=int(plan.causal),
            scale_log2=softmax_scale_log2(plan.scale, d),
            first_page=0 if plan._first_page is None else plan._first_page.ptr,
            window=plan.window,
            attn_chunk=plan.chunk,
            sinks=0,
            # Encoded once here (host only, nothing queued); a run rewrites only the layer.
            **_kv_tensor_maps(info, variant),
            layer=0,
        )
        self.fp8 = fp8
        if fp8:
            scales = plan.scales
            assert scales is not None
            fields.update(k_scale=0, v_scale=0, scale_head_stride=scales.head_stride)
            self.args: Any = fill_args(PrefillFp8Args, **fields)
        else:
            self.args = fill_args(PrefillArgs, **fields)
        sm90 = variant.source != "paged_prefill.cu"
        self.params = param_block(self.args, SM80_ONLY if sm90 else SM90_ONLY)
        self.margs = fill_args(
            PrefillMergeArgs,
            part_o=part_o,
            part_lse=part_lse,
            out=0,
            out_tok_stride=oa.strides[0],
            out_head_stride=oa.strides[1],
            total_q=w.total_q,
            num_q_heads=hq,
            num_splits=w.num_splits,
            sinks=0,
        )
        self.mparams = param_block(self.margs)

    def launch(
        self, plan: PrefillPlan, q_ptr: int, out_ptr: int, layer: int, sinks: int = 0
    ) -> None:
        info, w, v = plan.info, plan.work, self.variant
        k_base = info.base_ptr + layer * info.strides["layer"]
        a = self.args
        a.sinks = self.margs.sinks = sinks
        a.q, a.out, a.k_base, a.v_base = q_ptr, out_ptr, k_base, k_base + info.strides["kv"]
        a.layer = layer
        if self.fp8:
            a.k_scale, a.v_scale = plan.scales.ptrs(layer)  # type: ignore[union-attr]
        heads = info.num_kv_heads * (plan.group // w.head_tile)
        grid = (w.num_items, heads, w.num_splits)
        launch(self.kernel, grid, v.threads, v.dynamic_smem_bytes, plan.stream, self.params)
        if w.split:
            self.margs.out = out_ptr
            grid = (w.total_q, plan.num_q_heads, 1)
            launch(self.merge, grid, info.head_dim, 0, plan.stream, self.mparams)


@dataclasses.dataclass(frozen=True)
class KvMapSpec:
    """One tensor map of the Hopper prefill's TMA loads: the tensor_map_tiled arguments."""

    global_address: int
    dims: list[int]
    strides_bytes: list[int]
    box_dims: list[int]


def kv_map_specs(info: PoolInfo, kv_tile: int) -> dict[str, KvMapSpec]:
    """The maps of paged_prefill_sm90.cu's TMA loads (KV_TMA), "k_map" and "v_map": over the
    whole pool, 5-D (head_dim, KV head, token in block, layer, block) from the layout's
    strides, K at the pool's base and V one "kv" stride on; boxes of 64 columns (128 bytes,
    the 128-byte swizzle of the tiles) x one page (or one tile of kv_tile tokens, when a page
    holds more). Block ids outside the pool are outside the maps: they read zeros."""
    st = info.strides
    dims = [info.head_dim, info.num_kv_heads, info.block_size, info.num_layers, info.num_blocks]
    strides = [st["head"], st["token"], st["layer"], st["block"]]
    box = [64, 1, min(info.block_size, kv_tile), 1, 1]
    return {
        name: KvMapSpec(address, dims, strides, box)
        for name, address in (("k_map", info.base_ptr), ("v_map", info.base_ptr + st["kv"]))
    }


def _kv_tensor_maps(info: PoolInfo, variant: _build.PrefillVariant) -> dict[str, Any]:
    """PrefillArgs' k_map and v_map: the encoded kv_map_specs for a TMA module, zeros for the
    other modules (which read none)."""
    words = ctypes.c_uint64 * 16
    if not variant.tma:
        return {"k_map": words(), "v_map": words()}
    from kvpool._core import tensor_map_tiled

    maps = {}
    for name, m in kv_map_specs(info, variant.kv_tile).items():
        raw = tensor_map_tiled(
            m.global_address, info.dtype, m.dims, m.strides_bytes, m.box_dims, 128
        )
        maps[name] = words.from_buffer_copy(raw)
    return maps


def _on_device(a: Any) -> bool:
    return hasattr(a, "__cuda_array_interface__")


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
    window: int | None = None,
    chunk: int | None = None,
    first_page: Any = None,
    sinks: Any = None,
) -> Any:
    """Attention of a varlen batch of query tokens over their sequences' paged K/V in `layer`,
    in one call: ``prefill_plan(pool, qo_indptr, block_tables, seq_lens, q.shape[1], ...)
    .run(q, layer, out=out)`` (see prefill_plan for the arguments; a plan made here from device
    arrays reads them back, which synchronises). Covers prefill, prefix-cached continuation,
    chunked prefill, speculative verification and decode (qo_len 1) in one batch.

    With `plan` (a PrefillPlan of this pool, made for these very arrays and this `causal`) the
    call only runs it; the plan's own arguments (scale, stream, num_splits, workspace, scales)
    are then left out.

    q: [total_q, num_q_heads, head_dim] in the pool's dtype: a torch tensor (bfloat16,
    float16), a CuPy array (a bfloat16 one as 2-byte integers), or NumPy for a host pool. The
    result is `out` when given (written in place), else a new array of q's kind and dtype. An
    fp8 pool (float8_e4m3fn / float8_e5m2) takes float16 or bfloat16 q and out, and `scales`
    (its KvScales): attention over the dequantized cache. window / chunk / first_page: a
    sliding-window or chunked local layer (prefill_plan); sinks: this layer's attention sinks
    (PrefillPlan.run; a plan given here must be made with use_sinks=True).
    """
    layer = index_arg(layer, "layer")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if not 0 <= layer < pool.layout.num_layers:
        raise InvalidArgumentError(f"layer {layer} outside 0..{pool.layout.num_layers - 1}")
    if plan is None:
        plan = prefill_plan(
            pool,
            qo_indptr,
            block_tables,
            seq_lens,
            _num_q_heads(q, pool),
            causal=bool(causal),
            scale=scale,
            scales=scales,
            num_splits=num_splits,
            stream=call_stream(stream, pool, q, out, sinks),
            workspace=workspace,
            window=window,
            chunk=chunk,
            first_page=first_page,
            use_sinks=sinks is not None,
        )
    else:
        check_plan_pool(plan, pool, PrefillPlan)
        if plan.causal != bool(causal):
            raise InvalidArgumentError(
                f"the plan was made with causal={plan.causal}, this call asks causal={causal}"
            )
        given = dict(
            scale=scale,
            stream=stream,
            num_splits=num_splits,
            workspace=workspace,
            scales=scales,
            window=window,
            chunk=chunk,
            first_page=first_page,
        )
        names = [name for name, value in given.items() if value is not None]
        if names:
            raise InvalidArgumentError(
                f"{', '.join(names)}: the plan's own arguments; pass them when making the plan"
            )
        plan.check_batch(qo_indptr, block_tables, seq_lens)
    return plan.run(q, layer, out=out, sinks=sinks)


def _num_q_heads(q: Any, pool: Any) -> int:
    shape = tuple(getattr(q, "shape", None) or np.shape(q))
    head_dim = pool.layout.head_dim
    if len(shape) != 3 or shape[2] != head_dim:
        raise InvalidArgumentError(
            f"q must be [total_q, num_q_heads, {head_dim}], got {tuple(shape)}"
        )
    return int(shape[1])
