"""Paged decode attention: ``decode_plan(...)`` once per step, ``DecodePlan.run(q, layer)`` per
layer, and the one-call form ``paged_attention_decode``."""

from __future__ import annotations

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
from kvpool.kernels._decode_args import (
    TC_ONLY,
    DecodeArgs,
    DecodeFp8Args,
    MergeArgs,
    decode_kernel,
)
from kvpool.kernels._decode_split import SplitKv, split_kv, workspace_elems
from kvpool.kernels._launch import (
    cupy_stream,
    fill_args,
    launch,
    launch_stream,
    param_block,
    wait_producers,
)
from kvpool.kernels._scales import KvScales
from kvpool.kernels._window import (
    WINDOW_SLACK,
    bind_first_page,
    check_host_window_rows,
    check_window,
    device_sinks,
    host_sinks,
    key_extent,
)


def decode_plan(
    pool: Any,
    block_tables: Any,
    seq_lens: Any,
    num_q_heads: int,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    scale: float | None = None,
    scales: KvScales | None = None,
    stream: Any = None,
    workspace: Any = None,
    window: int | None = None,
    chunk: int | None = None,
    first_page: Any = None,
) -> DecodePlan:
    """A decode plan for one step's batch: made once, then ``plan.run(q, layer)`` per layer.

    block_tables: int32 [num_seqs, max_blocks_per_seq] block ids (unused entries -1); seq_lens:
    int32 [num_seqs] tokens per sequence (the new one included); num_q_heads a multiple of the
    pool's num_kv_heads (GQA, MHA, MQA). The plan binds these arrays, the pool, the softmax
    `scale` (default 1/sqrt(head_dim); a finite real number) and, for an fp8 pool, its
    `scales`; every run reads the arrays' contents as they are then.

    On a CUDA pool the arrays are device arrays (CuPy, torch or anything with
    __cuda_array_interface__) and every run is queued on `stream`; by default the current
    stream when the plan is made: torch's when block_tables or seq_lens is a torch tensor,
    else CuPy's. max_seq_len (an upper bound of seq_lens, at most the table's
    width * block_size) sizes the split-KV plan; when omitted it is read from seq_lens, which
    synchronises with the device. num_splits forces a split count (at most
    MAX_DECODE_SPLITS = 128 are used). When the plan splits, it owns its float32 partials (or
    uses `workspace`, of at least workspace_elems() elements) and the tensor-core kernel's
    zeroed merge counters, which every launch leaves zero. Runs of one plan are ordered on its
    stream and reuse them; after the first run per layout of q and out, a run allocates
    nothing and does not synchronise, so it can be captured in a CUDA graph (keep the plan
    alive as long as the graph).

    Sliding window and chunked local layers (`kvpool.kernels._window` states the
    conventions): `window` w, the query at position seq_lens[i] - 1 sees the last w keys;
    `chunk` c, the keys of its own chunk of c. first_page (int32 [num_seqs], like seq_lens; by
    default 0) is the page of the sequence that table entry 0 holds: a window group's table
    holds only its live pages. Only the window's pages are read and the work per query is the
    window's, whatever the context. Attention sinks are a per-layer argument of run().
    These run on the tensor-core kernel (the default pipeline).

    On a host pool the arrays are NumPy (or CPU torch tensors), there is no stream nor
    workspace, and run() computes the float64 reference.
    """
    return DecodePlan(
        pool,
        block_tables,
        seq_lens,
        num_q_heads,
        max_seq_len=max_seq_len,
        num_splits=num_splits,
        scale=scale,
        scales=scales,
        stream=stream,
        workspace=workspace,
        window=window,
        chunk=chunk,
        first_page=first_page,
    )


class DecodePlan:
    """One step's decode batch over one pool, made by :func:`decode_plan`: the split-KV plan,
    its workspace and merge counters, and the launch blocks; ``run(q, layer)`` per layer."""

    def __init__(
        self,
        pool: Any,
        block_tables: Any,
        seq_lens: Any,
        num_q_heads: int,
        *,
        max_seq_len: int | None,
        num_splits: int | None,
        scale: float | None,
        scales: KvScales | None,
        stream: Any,
        workspace: Any,
        window: int | None = None,
        chunk: int | None = None,
        first_page: Any = None,
    ) -> None:
        check_tables_pool(block_tables, pool, "block_tables")
        check_tables_pool(seq_lens, pool, "seq_lens")
        info = PoolInfo(pool)
        check_scales(pool, info, scales, "decode")
        hq = index_arg(num_q_heads, "num_q_heads")
        if hq <= 0 or hq % info.num_kv_heads:
            raise InvalidArgumentError(
                f"num_q_heads {hq} is not a multiple of num_kv_heads {info.num_kv_heads}"
            )
        self.pool, self.info, self.scales = pool, info, scales
        self.num_q_heads, self.group = hq, hq // info.num_kv_heads
        self.scale = host_scale(scale, info.head_dim)
        self.block_tables, self.seq_lens = block_tables, seq_lens
        self.window, self.chunk = check_window(window, chunk)  # 0: none
        self.first_page = first_page
        self._first_page: Any = None  # the bound form (bind_first_page)
        if num_splits is not None:
            num_splits = index_arg(num_splits, "num_splits")
        if max_seq_len is not None:
            max_seq_len = index_arg(max_seq_len, "max_seq_len")
        self.kv_split = SplitKv(chunk_tokens=1, num_splits=1)
        self.counters: Any = None
        self._workspace: Workspace | None = None
        self._bound: tuple[ArrayView, ArrayView] | None = None
        if info.cuda:
            self._plan_cuda(max_seq_len, num_splits, stream, workspace)
        else:
            check_host_stream(stream)
            if workspace is not None:
                raise InvalidArgumentError("a host pool needs no workspace")
            self._plan_host()

    # -- binding -------------------------------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        return self._num_seqs

    @property
    def split(self) -> bool:
        """Whether the plan cuts the sequences' tokens into KV splits (kv_split says how)."""
        return self.kv_split.split

    @property
    def num_splits(self) -> int:
        return self.kv_split.num_splits

    def check_batch(self, block_tables: Any, seq_lens: Any) -> None:
        """Refuse arrays other than the ones the plan was made for (another batch)."""
        btv, slv = self._bound if self._bound else (None, None)
        same_batch_array(block_tables, self.block_tables, btv, "block_tables")
        same_batch_array(seq_lens, self.seq_lens, slv, "seq_lens")

    def _plan_host(self) -> None:
        tables = host_array(self.block_tables, "block_tables")
        lens = host_array(self.seq_lens, "seq_lens")
        for name, a in (("block_tables", tables), ("seq_lens", lens)):
            if a.dtype.kind not in "iu":
                raise InvalidArgumentError(f"{name} must be an integer array, got {a.dtype}")
        if lens.ndim != 1 or tables.ndim != 2 or tables.shape[0] != lens.shape[0]:
            raise InvalidArgumentError(
                f"block_tables [num_seqs, max_blocks] and seq_lens [num_seqs] do not match: "
                f"{tables.shape} and {lens.shape}"
            )
        self._num_seqs = int(lens.shape[0])
        self._host = (tables, lens)
        self._first_page = bind_first_page(self.first_page, self._num_seqs, False, -1)
        self._check_host_rows()

    def _check_host_rows(self) -> None:
        tables, lens = self._host
        if (lens < 0).any():
            raise InvalidArgumentError("a seq_len is negative")
        lens64 = lens.astype(np.int64)
        starts = reference.key_start(
            np.maximum(lens64 - 1, 0), self.window or None, self.chunk or None
        )
        check_host_window_rows(
            tables, lens64, self._first_page, starts, self.info.block_size, self.info.num_blocks
        )

    def _plan_cuda(self, max_seq_len, num_splits, stream, workspace) -> None:
        info = self.info
        self.kernel = decode_kernel(
            info.dtype, info.head_dim, info.block_size, self.group, _tuning.current()
        )
        if self.window or self.chunk or self.first_page is not None:
            if not self.kernel.tc:
                raise InvalidArgumentError(
                    "sliding windows, chunks and window-relative tables (first_page) run on "
                    f"the tensor-core decode (decode_pipeline {_build.TC}), not on the "
                    "CUDA-core baseline"
                )
            k = self.kernel  # the same module compiled with WINDOW=1 (TcVariant.window)
            assert isinstance(k.variant, _build.TcVariant)
            self.kernel = dataclasses.replace(
                k, variant=dataclasses.replace(k.variant, window=True)
            )
        btv, slv = _view(self.block_tables, "block_tables"), _view(self.seq_lens, "seq_lens")
        bt, sl = _dev(btv, "block_tables"), _dev(slv, "seq_lens")
        check_int_array(bt, "block_tables", 4, 2)
        check_int_array(sl, "seq_lens", 4, 1)
        num_seqs = sl.shape[0]
        if bt.shape[0] != num_seqs:
            raise InvalidArgumentError(
                f"block_tables must be [{num_seqs}, max_blocks], got {bt.shape}"
            )
        if num_seqs > 65535:
            raise InvalidArgumentError("at most 65535 sequences per launch")
        self._num_seqs, self._bound, self._bt_stride = num_seqs, (btv, slv), bt.strides[0]
        self.stream = sp = launch_stream(stream, info.device_id, self.block_tables, self.seq_lens)
        dev = info.device_id
        if num_seqs:
            check_ptr(btv.ptr, "block_tables", dev)
            check_ptr(slv.ptr, "seq_lens", dev)
        if max_seq_len is None:
            max_seq_len = _read_max_seq_len(self.seq_lens, slv, dev, sp) if num_seqs else 0
        width = bt.shape[1]
        self._bt_width = width
        self._first_page = bind_first_page(self.first_page, num_seqs, True, dev)
        # A window-relative table needs only the window's pages: the kernel bounds its entries
        # by the row's width instead (an entry outside it reads as a missing token).
        if self._first_page is None and max_seq_len > width * info.block_size:
            raise InvalidArgumentError(
                f"max_seq_len {max_seq_len} exceeds the block tables' {width} blocks of "
                f"{info.block_size} tokens"
            )
        k = self.kernel
        self.ctas_per_seq = info.num_kv_heads * -(-self.group // k.gq)
        # The keys one CTA range covers: a window's (its start rounded down to a tile), not
        # the context's, so a window layer's splits and time do not grow with the context.
        extent = key_extent(self.window, self.chunk)
        span = max_seq_len if extent is None else min(max_seq_len, extent + WINDOW_SLACK)
        self.kv_split = split_kv(
            num_seqs,
            self.ctas_per_seq,
            max(span, 1),
            k.variant.tokens_per_iter,
            num_sms(dev),
            num_splits,
            k.ctas_per_sm,
        )
        hq, d = self.num_q_heads, info.head_dim
        need = (
            workspace_elems(num_seqs, hq, d, self.kv_split.num_splits) if self.kv_split.split else 0
        )
        if self.kv_split.split or workspace is not None:
            self._workspace = Workspace(workspace, need, dev, sp)
        if self.kv_split.split and k.tc:
            import cupy

            with cupy.cuda.Device(dev), cupy_stream(sp):
                self.counters = cupy.zeros(max(num_seqs * self.ctas_per_seq, 1), cupy.int32)
        self._launches: dict[tuple, _Launch] = {}
        self._lock = threading.Lock()

    # -- running -------------------------------------------------------------------------------

    def run(self, q: Any, layer: int, *, out: Any = None, sinks: Any = None) -> Any:
        """Attention of one new query token per sequence (q: [num_seqs, num_q_heads, head_dim],
        bfloat16 or float16 like the pool, or either over an fp8 pool; torch or CuPy) over
        layer `layer`. Returns `out` (written in place when given; else a new array of q's
        kind and dtype). `sinks`: this layer's attention sinks (gpt-oss), a float32
        [num_q_heads] array of logits (device array on a CUDA pool) that join each head's
        softmax denominator only (kvpool.kernels._window)."""
        layer = check_layer(layer, self.info)
        if not self.info.cuda:
            return self._run_host(q, layer, out, sinks)
        if sinks is not None and not self.kernel.tc:
            raise InvalidArgumentError(
                f"attention sinks run on the tensor-core decode (decode_pipeline {_build.TC})"
            )
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
        if self._num_seqs == 0:
            return out
        dev = info.device_id
        if qv.ptr % 16:
            raise InvalidArgumentError("q rows must be contiguous and 16-byte aligned")
        check_ptr(qv.ptr, "q", dev)
        check_ptr(ov.ptr, "out", dev)
        sinks_ptr, sv = device_sinks(sinks, self.num_q_heads, dev)
        btv, slv = self._bound  # type: ignore[misc]
        extra = tuple(x for x in (self._first_page, sv) if x is not None)
        wait_producers(self.stream, dev, qv, btv, slv, ov, *extra)
        k_base = info.base_ptr + layer * info.strides["layer"]
        with self._lock:
            ln.launch(self, qv.ptr, ov.ptr, k_base, layer, sinks_ptr)
        return out

    def _check_q_shape(self, shape: tuple[int, ...]) -> None:
        want = (self._num_seqs, self.num_q_heads, self.info.head_dim)
        if tuple(shape) != want:
            raise InvalidArgumentError(
                f"q must be [num_seqs, num_q_heads, head_dim] = {list(want)}, got {tuple(shape)}"
            )

    def _run_host(self, q: Any, layer: int, out: Any, sinks: Any = None) -> Any:
        info = self.info
        sinks64 = host_sinks(sinks, self.num_q_heads)
        fp8 = self.scales is not None
        q_np, q_dtype, q_bytes = host_query(q, info, fp8, self._check_q_shape, out)
        self._check_host_rows()  # the tables' contents may have changed since the plan
        tables, lens = self._host
        res = reference.paged_attention_decode(
            q_np,
            self.pool.k_view(layer),
            self.pool.v_view(layer),
            tables,
            lens,
            info.dtype,
            self.scale,
            q_dtype=q_dtype,
            kv_scales=self.scales.layer_scales(layer) if self.scales else None,
            window=self.window or None,
            chunk=self.chunk or None,
            sinks=sinks64,
            first_page=self._first_page,
        )
        return host_result(res, q_dtype, q, q_np, out)


class _Launch:
    """A plan's parameter blocks for one layout of q and out (checked once): the pointers of q,
    out, the layer and its scales are rewritten per run."""

    def __init__(self, plan: DecodePlan, qv: ArrayView, ov: ArrayView) -> None:
        info, k = plan.info, plan.kernel
        d, hq = info.head_dim, plan.num_q_heads
        qa, oa = _dev(qv, "q"), _dev(ov, "out")
        plan._check_q_shape(qa.shape)
        fp8 = info.dtype in _build.FP8_DTYPES
        q_dtype = fp8_query_dtype(qa.kind, qa.itemsize, info.dtype) if fp8 else info.dtype
        check_elem16(qa, "q", q_dtype)
        if fp8:
            check_elem16(oa, "out", q_dtype)
        if qa.strides[2] != 1 or qa.strides[0] % 8 or qa.strides[1] % 8:
            raise InvalidArgumentError("q rows must be contiguous and 16-byte aligned")
        if oa.shape != qa.shape or oa.itemsize != 2 or oa.strides[2] != 1:
            raise InvalidArgumentError(
                f"out must be [{plan.num_seqs}, {hq}, {d}] with contiguous rows"
            )
        st = info.strides
        eb = st["elem"]
        if eb != (1 if fp8 else 2) or st["head"] != eb * d or st["token"] % 16:
            raise InvalidArgumentError(f"layout strides {st} do not fit the decode kernel")
        variant = k.for_query(q_dtype)
        self.threads, self.smem = variant.threads, variant.dynamic_smem_bytes
        self.kernel = compiled_kernel(variant, variant.kernel, info.device_id, self.smem)
        # The CUDA-core baseline merges split partials in a second launch; the tensor-core
        # kernel merges inside its own launch.
        self.merge = None if k.tc else compiled_kernel(variant, "merge_splits", info.device_id)
        split, ws = plan.kv_split, plan._workspace
        part_o = ws.ptr if split.split and ws is not None else 0
        part_lse = part_o + 4 * plan.num_seqs * split.num_splits * hq * d if part_o else 0
        btv, slv = plan._bound  # type: ignore[misc]
        fields = dict(
            q=0,
            q_seq_stride=qa.strides[0],
            q_head_stride=qa.strides[1],
            out=0,
            out_seq_stride=oa.strides[0],
            out_head_stride=oa.strides[1],
            part_o=part_o,
            part_lse=part_lse,
            counters=0 if plan.counters is None else int(plan.counters.data.ptr),
            k_base=0,
            v_base=0,
            block_stride=st["block"],
            token_stride=st["token"],
            head_stride=st["head"],
            num_blocks=info.num_blocks,
            bs_log2=info.block_size.bit_length() - 1,
            block_tables=btv.ptr,
            bt_stride=plan._bt_stride,
            seq_lens=slv.ptr,
            num_q_heads=hq,
            head_dim=d,
            group=plan.group,
            gq=k.gq,
            chunk_tokens=split.chunk_tokens,
            max_splits=split.num_splits,
            scale_log2=softmax_scale_log2(plan.scale, d),
            first_page=0 if plan._first_page is None else plan._first_page.ptr,
            bt_width=plan._bt_width,
            window=plan.window,
            attn_chunk=plan.chunk,
            sinks=0,
        )
        self.fp8 = fp8
        if fp8:
            scales = plan.scales
            assert scales is not None
            fields.update(k_scale=0, v_scale=0, scale_head_stride=scales.head_stride)
            self.args: Any = fill_args(DecodeFp8Args, **fields)
        else:
            self.args = fill_args(DecodeArgs, **fields)
        self.params = param_block(self.args, () if k.tc else TC_ONLY)
        self.margs = fill_args(
            MergeArgs,
            part_o=part_o,
            part_lse=part_lse,
            out=0,
            out_seq_stride=oa.strides[0],
            out_head_stride=oa.strides[1],
            seq_lens=slv.ptr,
            num_q_heads=hq,
            chunk_tokens=split.chunk_tokens,
            max_splits=split.num_splits,
        )
        self.mparams = param_block(self.margs)

    def launch(
        self, plan: DecodePlan, q_ptr: int, out_ptr: int, k_base: int, layer: int, sinks: int = 0
    ) -> None:
        a, split = self.args, plan.kv_split
        a.q, a.out, a.k_base, a.v_base = q_ptr, out_ptr, k_base, k_base + plan.info.strides["kv"]
        a.sinks = sinks
        if self.fp8:
            a.k_scale, a.v_scale = plan.scales.ptrs(layer)  # type: ignore[union-attr]
        grid = (split.num_splits, plan.ctas_per_seq, plan.num_seqs)
        launch(self.kernel, grid, self.threads, self.smem, plan.stream, self.params)
        if split.split and self.merge is not None:
            self.margs.out = out_ptr
            grid = (plan.num_q_heads, plan.num_seqs, 1)
            launch(self.merge, grid, plan.info.head_dim, 0, plan.stream, self.mparams)


def _read_max_seq_len(seq_lens: Any, slv: ArrayView, device_id: int, stream: int) -> int:
    """The longest sequence, read back from the device (synchronises) on the launch stream,
    after the producers of seq_lens."""
    import cupy

    wait_producers(stream, device_id, slv)
    with cupy.cuda.Device(device_id), cupy_stream(stream):
        return int(cupy.asarray(seq_lens).max())


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
    scales: KvScales | None = None,
    plan: DecodePlan | None = None,
    window: int | None = None,
    chunk: int | None = None,
    first_page: Any = None,
    sinks: Any = None,
) -> Any:
    """Attention of one new query token per sequence over its paged K/V in layer `layer`, in
    one call: ``decode_plan(pool, block_tables, seq_lens, q.shape[1], ...).run(q, layer,
    out=out)`` (see decode_plan for the arguments). With `plan` (a DecodePlan of this pool and
    these very arrays) the call only runs it; the plan's own arguments (scale, stream,
    max_seq_len, num_splits, workspace, scales) are then left out.

    q: [num_seqs, num_q_heads, head_dim] in the pool's dtype: a torch tensor (bfloat16,
    float16), a CuPy array (a bfloat16 one as 2-byte integers, which CuPy has no type for), or
    for a host pool a NumPy array. The result is `out` when given (written in place), else a
    new array of q's kind and dtype. Supported on a CUDA pool: dtype float16 or bfloat16,
    head_dim a multiple of 8 in 32..256, block_size a power of two in 1..256, any group size;
    anything else is refused before a launch, naming that set.

    An fp8 pool (float8_e4m3fn / float8_e5m2; head_dim a multiple of 16 in 32..256) needs
    `scales` (its KvScales); q and out are float16 or bfloat16 (q's type decides), K/V are
    dequantized inside the kernel, fp32 accumulation. bfloat16 queries run through fp16 there
    (exact for |q| in 6.1e-5 .. 65504).

    window / chunk / first_page: a sliding-window or chunked local layer over a full or a
    window-relative table (decode_plan); sinks: this layer's attention sinks (DecodePlan.run).
    """
    layer = index_arg(layer, "layer")
    if not 0 <= layer < pool.layout.num_layers:
        raise InvalidArgumentError(f"layer {layer} outside 0..{pool.layout.num_layers - 1}")
    if plan is None:
        plan = decode_plan(
            pool,
            block_tables,
            seq_lens,
            _num_q_heads(q, pool),
            max_seq_len=max_seq_len,
            num_splits=num_splits,
            scale=scale,
            scales=scales,
            stream=call_stream(stream, pool, q, out, sinks),
            workspace=workspace,
            window=window,
            chunk=chunk,
            first_page=first_page,
        )
    else:
        check_plan_pool(plan, pool, DecodePlan)
        _no_plan_arguments(
            scale=scale,
            stream=stream,
            max_seq_len=max_seq_len,
            num_splits=num_splits,
            workspace=workspace,
            scales=scales,
            window=window,
            chunk=chunk,
            first_page=first_page,
        )
        plan.check_batch(block_tables, seq_lens)
    return plan.run(q, layer, out=out, sinks=sinks)


def _num_q_heads(q: Any, pool: Any) -> int:
    shape = tuple(getattr(q, "shape", None) or np.shape(q))
    head_dim = pool.layout.head_dim
    if len(shape) != 3 or shape[2] != head_dim:
        raise InvalidArgumentError(
            f"q must be [num_seqs, num_q_heads, {head_dim}], got {tuple(shape)}"
        )
    return int(shape[1])


def _no_plan_arguments(**given: Any) -> None:
    names = [name for name, value in given.items() if value is not None]
    if names:
        raise InvalidArgumentError(
            f"{', '.join(names)}: the plan's own arguments; pass them when making the plan"
        )
