"""MLA decode attention over a hybrid pool's latent group (DeepSeek-V3 shape, absorbed
projections): ``mla_decode_plan(...)`` once per step, ``MlaDecodePlan.run(q_nope, q_pe, layer)``
per layer, and the one-call form ``paged_mla_decode``.

Semantics (FlashMLA, FlashInfer's BatchMLAPagedAttentionWrapper): per token the group's page
holds one row of latent_dim + rope_dim = 512 + 64 elements, c_kv then k_pe, per layer (layer
`i` of the group at byte ``i * block_size * row_bytes`` of the page: ModelKvSpec's
latent_offset_bytes). Per query head, q_nope [512] (already multiplied into the latent space)
and q_pe [64]; logits = (q_nope . c_kv + q_pe . k_pe) * scale; the output is the softmax-weighted
sum of c_kv, in the latent space [512]. Every query head reads the same latent rows (a GQA group
of all heads): a CTA serves a tile of heads and loads each latent tile once for all of them.

Supported (anything else is refused before a launch, naming this set): an ``mla_latent`` group
of latent_dim 512, rope_dim 64, dtype float16 or bfloat16, any power-of-two page size; 1..128
query heads; q_nope / q_pe / out in the group's dtype with contiguous rows.
"""

from __future__ import annotations

import ctypes
import ctypes as _ct
import math
import threading
from typing import Any

import numpy as np

from kvpool import reference
from kvpool.exceptions import InvalidArgumentError
from kvpool.kernels import _build
from kvpool.kernels._args import (
    ArrayView,
    check_int_array,
    check_ptr,
    device_index,
    elem_ok,
    index_arg,
)
from kvpool.kernels._args import dev as _dev
from kvpool.kernels._args import view as _view
from kvpool.kernels._common import (
    Workspace,
    compiled_kernel,
    host_array,
    host_scale,
    new_out,
    num_sms,
    pool_is_cuda,
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

_u64, _i64, _i32, _f32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_float

MAX_MLA_HEADS = 128
MLA_HEAD_TILES = tuple(16 * mt for mt, _ in _build.MLA_VARIANT_CHOICES)  # 16, 32, 64


def supported_set() -> str:
    return (
        "an mla_latent group of latent_dim 512, rope_dim 64, dtype float16 or bfloat16, a "
        f"power-of-two page size; 1..{MAX_MLA_HEADS} query heads"
    )


class MlaArgs(ctypes.Structure):
    """paged_mla_decode's parameters (cuda/paged_mla_decode.cu), in order."""

    _fields_ = [
        ("q_nope", _u64),
        ("qn_seq_stride", _i64),
        ("qn_head_stride", _i64),
        ("q_pe", _u64),
        ("qp_seq_stride", _i64),
        ("qp_head_stride", _i64),
        ("out", _u64),
        ("out_seq_stride", _i64),
        ("out_head_stride", _i64),
        ("part_o", _u64),
        ("part_lse", _u64),
        ("kv_base", _u64),
        ("page_stride", _i64),
        ("token_stride", _i64),
        ("num_pages", _i32),
        ("bs_log2", _i32),
        ("page_tables", _u64),
        ("pt_stride", _i64),
        ("pt_width", _i32),
        ("seq_lens", _u64),
        ("num_heads", _i32),
        ("chunk_tokens", _i32),
        ("max_splits", _i32),
        ("scale_log2", _f32),
    ]


class MlaMergeArgs(ctypes.Structure):
    """mla_merge's parameters, in order."""

    _fields_ = [
        ("part_o", _u64),
        ("part_lse", _u64),
        ("out", _u64),
        ("out_seq_stride", _i64),
        ("out_head_stride", _i64),
        ("seq_lens", _u64),
        ("num_heads", _i32),
        ("chunk_tokens", _i32),
        ("max_splits", _i32),
    ]


def default_head_tile(num_heads: int) -> int:
    """Heads per CTA: 16 up to 16 heads, 32 up to 32, else 64 (128 heads: 2 CTAs per chunk,
    side by side in the grid so that their reads of the same rows can meet in L2; at 128
    heads on the H200 tile 64 was the fastest of 16 / 32 / 64: bench/results/2026-12-03_de41d1c_h200/)."""
    return next((t for t in MLA_HEAD_TILES if num_heads <= t), MLA_HEAD_TILES[-1])


def mla_variant(dtype: str, head_tile: int) -> _build.MlaVariant:
    mt = head_tile // 16
    j = dict(_build.MLA_VARIANT_CHOICES)[mt]
    return _build.MlaVariant(dtype, mt, j)


def check_spec(spec: Any) -> None:
    """A ModelKvSpec (checked by its type's name: importing the class here would close an
    import cycle through the package's __init__)."""
    if type(spec).__name__ != "ModelKvSpec" or not hasattr(spec, "latent_offset_bytes"):
        raise TypeError(f"spec must be a ModelKvSpec, got {type(spec).__name__}")


def mla_group(spec: Any, group: Any) -> tuple[int, Any]:
    """The MLA group `group` of `spec` (its index and KvGroup), checked against the supported
    set."""
    check_spec(spec)
    g = index_arg(group, "group")
    if not 0 <= g < spec.num_groups:
        raise InvalidArgumentError(f"group {g} outside 0..{spec.num_groups - 1}")
    kv = spec.groups[g]
    if kv.kind != "mla_latent":
        raise InvalidArgumentError(
            f"group {g} is a {kv.kind} group, not mla_latent: MLA decode reads {supported_set()}"
        )
    bs = spec.block_size(g)
    if (
        kv.latent_dim != _build.MLA_LATENT_DIM
        or kv.rope_dim != _build.MLA_ROPE_DIM
        or kv.dtype not in _build.MLA_DTYPES
        or bs is None
        or bs & (bs - 1)
    ):
        raise InvalidArgumentError(
            f"no MLA decode kernel for latent_dim {kv.latent_dim}, rope_dim {kv.rope_dim}, "
            f"dtype {kv.dtype}, page size {bs}; supported: {supported_set()}"
        )
    return g, kv


def mla_page_tables(tables: Any, request_ids: Any, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(page_tables int32 [n, max_pages] padded with -1, seq_lens int32 [n]) of the requests
    `request_ids` of a HybridTables for its MLA group `group` (host arrays: upload them for a
    CUDA pool)."""
    rows, lens = [], []
    for rid in request_ids:
        first, ids, n = tables.table(int(rid), group)
        if first != 0:
            raise InvalidArgumentError(f"request {rid}: an MLA group's table starts at page 0")
        rows.append(np.asarray(ids, dtype=np.int32))
        lens.append(n)
    width = max([len(r) for r in rows] + [1])
    out = np.full((len(rows), width), -1, dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out, np.asarray(lens, dtype=np.int32)


def mla_decode_plan(
    pool: Any,
    spec: Any,
    group: int,
    page_tables: Any,
    seq_lens: Any,
    num_heads: int,
    *,
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    stream: Any = None,
    workspace: Any = None,
    head_tile: int | None = None,
) -> MlaDecodePlan:
    """An MLA decode plan for one step's batch over MLA group `group` of `spec` (the
    ModelKvSpec `pool` was made for): made once, then ``plan.run(q_nope, q_pe, layer)`` for
    every layer of the group.

    page_tables: int32 [num_seqs, max_pages] page ids (HybridTables.table's for the group; -1
    unused; mla_page_tables builds them); seq_lens: int32 [num_seqs]. `scale` is the softmax
    scale, required: the model's (DeepSeek-V3: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) =
    1/sqrt(192), times its YaRN mscale squared), not 1/sqrt(576). num_heads: 1..128.
    max_seq_len, num_splits, stream and workspace as for decode_plan (split-KV over long
    sequences, merged by a second launch; the plan owns its partials unless `workspace` of
    >= workspace_elems(num_seqs, num_heads, 512, num_splits) float32 is given; runs allocate
    nothing after the first per layout and can be captured in a CUDA graph). head_tile (16,
    32 or 64) forces the heads per CTA (default: default_head_tile).

    On a host pool the arrays are NumPy and run() computes the float64 reference."""
    return MlaDecodePlan(
        pool,
        spec,
        group,
        page_tables,
        seq_lens,
        num_heads,
        scale=scale,
        max_seq_len=max_seq_len,
        num_splits=num_splits,
        stream=stream,
        workspace=workspace,
        head_tile=head_tile,
    )


class MlaDecodePlan:
    """One step's MLA decode batch over one pool's MLA group (see :func:`mla_decode_plan`)."""

    def __init__(
        self,
        pool: Any,
        spec: Any,
        group: int,
        page_tables: Any,
        seq_lens: Any,
        num_heads: int,
        *,
        scale: float,
        max_seq_len: int | None,
        num_splits: int | None,
        stream: Any,
        workspace: Any,
        head_tile: int | None,
    ) -> None:
        self.group, kv = mla_group(spec, group)
        if spec.page_bytes != pool.block_bytes:
            raise InvalidArgumentError(
                f"the pool's blocks ({pool.block_bytes} bytes) are not the spec's pages "
                f"({spec.page_bytes}): make the pool with Pool.for_spec(spec, ...)"
            )
        h = index_arg(num_heads, "num_heads")
        if not 1 <= h <= MAX_MLA_HEADS:
            raise InvalidArgumentError(
                f"num_heads {h}: MLA decode runs 1..{MAX_MLA_HEADS} query heads"
            )
        if scale is None:
            raise InvalidArgumentError(
                "scale is required: the model's softmax scale (DeepSeek-V3: 1/sqrt(192) "
                "times its YaRN mscale squared)"
            )
        self.scale = host_scale(scale, 1)
        if head_tile is None:
            head_tile = default_head_tile(h)
        head_tile = index_arg(head_tile, "head_tile")
        if head_tile not in MLA_HEAD_TILES:
            raise InvalidArgumentError(f"head_tile must be one of {MLA_HEAD_TILES}")
        self.pool, self.spec, self.kv_group = pool, spec, kv
        self.num_heads, self.dtype = h, kv.dtype
        self.block_size = int(spec.block_size(self.group))
        self.page_tables, self.seq_lens = page_tables, seq_lens
        self.variant = mla_variant(kv.dtype, head_tile)
        self.kv_split = SplitKv(chunk_tokens=1, num_splits=1)
        self._bound: tuple[ArrayView, ArrayView] | None = None
        self._workspace: Workspace | None = None
        self.cuda = pool_is_cuda(pool)
        if max_seq_len is not None:
            max_seq_len = index_arg(max_seq_len, "max_seq_len")
        if num_splits is not None:
            num_splits = index_arg(num_splits, "num_splits")
        if self.cuda:
            self._plan_cuda(max_seq_len, num_splits, stream, workspace)
        else:
            if stream is not None or workspace is not None:
                raise InvalidArgumentError("a host pool takes no stream and no workspace")
            self._plan_host()

    @property
    def num_seqs(self) -> int:
        return self._num_seqs

    @property
    def split(self) -> bool:
        return self.kv_split.split

    @property
    def num_splits(self) -> int:
        return self.kv_split.num_splits

    def layer_index(self, layer: int) -> int:
        """The index inside the plan's group of model layer `layer`."""
        layer = index_arg(layer, "layer")
        if not 0 <= layer < self.spec.num_layers:
            raise InvalidArgumentError(f"layer {layer} outside 0..{self.spec.num_layers - 1}")
        g, idx = self.spec.group_of_layer(layer)
        if g != self.group:
            raise InvalidArgumentError(
                f"layer {layer} is in group {g} ({self.spec.groups[g].kind}), not in the plan's "
                f"MLA group {self.group}"
            )
        return int(idx)

    # -- host ----------------------------------------------------------------------------------

    def _plan_host(self) -> None:
        tables = host_array(self.page_tables, "page_tables")
        lens = host_array(self.seq_lens, "seq_lens")
        for name, a in (("page_tables", tables), ("seq_lens", lens)):
            if a.dtype.kind not in "iu":
                raise InvalidArgumentError(f"{name} must be an integer array, got {a.dtype}")
        if lens.ndim != 1 or tables.ndim != 2 or tables.shape[0] != lens.shape[0]:
            raise InvalidArgumentError(
                "page_tables [num_seqs, max_pages] and seq_lens [num_seqs] do not match: "
                f"{tables.shape} and {lens.shape}"
            )
        self._num_seqs = int(lens.shape[0])
        self._host = (tables, lens)

    def _check_host_rows(self) -> None:
        tables, lens = self._host
        bs = self.block_size
        for i, n in enumerate(lens.astype(np.int64)):
            pages = -(-int(n) // bs)
            if n < 0 or pages > tables.shape[1]:
                raise InvalidArgumentError(
                    f"sequence {i}: {n} tokens need {pages} pages, its row has {tables.shape[1]}"
                )
            row = tables[i, :pages].astype(np.int64)
            if ((row < 0) | (row >= self.pool.num_blocks)).any():
                raise InvalidArgumentError(f"sequence {i}: a page id outside the pool")

    def _host_latent(self, idx: int) -> np.ndarray:
        """Layer `idx` of the group as [num_pages, block_size, 576] elements (bfloat16 as
        uint16), a view of the host pool's memory."""
        pool, spec, g = self.pool, self.spec, self.group
        n = pool.num_blocks * pool.block_bytes
        slab = np.ctypeslib.as_array((_ct.c_uint8 * n).from_address(pool.base_ptr))
        start = spec.latent_offset_bytes(g, 0, idx, 0, 0)
        row = 2 * (_build.MLA_LATENT_DIM + _build.MLA_ROPE_DIM)
        pages = slab.reshape(pool.num_blocks, pool.block_bytes)
        layer = pages[:, start : start + self.block_size * row]
        elem = np.float16 if self.dtype == "float16" else np.uint16
        return layer.view(elem).reshape(pool.num_blocks, self.block_size, row // 2)

    def _run_host(self, q_nope: Any, q_pe: Any, idx: int, out: Any) -> Any:
        qn, qp = host_array(q_nope, "q_nope"), host_array(q_pe, "q_pe")
        for name, a, d in (
            ("q_nope", qn, _build.MLA_LATENT_DIM),
            ("q_pe", qp, _build.MLA_ROPE_DIM),
        ):
            self._check_q(name, a.shape, a.dtype.kind, a.itemsize, d)
        self._check_host_rows()
        tables, lens = self._host
        res = reference.mla_decode_reference(
            qn, qp, self._host_latent(idx), tables, lens, self.scale, self.dtype
        )
        res16 = reference.from_float64(res, self.dtype).view(qn.dtype)
        if out is None:
            return res16
        o = host_array(out, "out")
        self._check_q("out", o.shape, o.dtype.kind, o.itemsize, _build.MLA_LATENT_DIM)
        o[...] = res16
        return out

    def _check_q(self, name: str, shape: tuple, kind: str, itemsize: int, dim: int) -> None:
        want = (self._num_seqs, self.num_heads, dim)
        if tuple(shape) != want:
            raise InvalidArgumentError(
                f"{name} must be [num_seqs, num_heads, {dim}] = {list(want)}, got {tuple(shape)}"
            )
        if not elem_ok(kind, itemsize, self.dtype, 2):
            raise InvalidArgumentError(
                f"{name} must hold the group's dtype {self.dtype} (bfloat16: 2-byte non-float "
                f"data or torch.bfloat16), got a {itemsize}-byte {kind!r} type"
            )

    # -- CUDA ----------------------------------------------------------------------------------

    def _plan_cuda(self, max_seq_len, num_splits, stream, workspace) -> None:
        ptv, slv = _view(self.page_tables, "page_tables"), _view(self.seq_lens, "seq_lens")
        pt, sl = _dev(ptv, "page_tables"), _dev(slv, "seq_lens")
        check_int_array(pt, "page_tables", 4, 2)
        check_int_array(sl, "seq_lens", 4, 1)
        n = sl.shape[0]
        if pt.shape[0] != n:
            raise InvalidArgumentError(f"page_tables must be [{n}, max_pages], got {pt.shape}")
        if n > 65535:
            raise InvalidArgumentError("at most 65535 sequences per launch")
        self.device_id = dev = device_index(self.pool)
        self._num_seqs, self._bound, self._pt_stride, self._pt_width = (
            n,
            (ptv, slv),
            pt.strides[0],
            pt.shape[1],
        )
        self.stream = sp = launch_stream(stream, dev, self.page_tables, self.seq_lens)
        if n:
            check_ptr(ptv.ptr, "page_tables", dev)
            check_ptr(slv.ptr, "seq_lens", dev)
        if max_seq_len is None:
            max_seq_len = 0
            if n:
                import cupy

                wait_producers(sp, dev, slv)
                with cupy.cuda.Device(dev), cupy_stream(sp):
                    max_seq_len = int(cupy.asarray(self.seq_lens).max())
        if max_seq_len > pt.shape[1] * self.block_size:
            raise InvalidArgumentError(
                f"max_seq_len {max_seq_len} exceeds the page tables' {pt.shape[1]} pages of "
                f"{self.block_size} tokens"
            )
        v = self.variant
        self.ctas_per_seq = -(-self.num_heads // v.heads_per_cta)
        self.kv_split = split_kv(
            n,
            self.ctas_per_seq,
            max(max_seq_len, 1),
            v.tokens_per_iter,
            num_sms(dev),
            num_splits,
            1,
        )
        need = (
            workspace_elems(n, self.num_heads, _build.MLA_LATENT_DIM, self.kv_split.num_splits)
            if self.kv_split.split
            else 0
        )
        if self.kv_split.split or workspace is not None:
            self._workspace = Workspace(workspace, need, dev, sp)
        self._launches: dict[tuple, _MlaLaunch] = {}
        self._lock = threading.Lock()

    def run(self, q_nope: Any, q_pe: Any, layer: int, *, out: Any = None) -> Any:
        """MLA attention of one query token per sequence over model layer `layer` (in the
        plan's group): q_nope [num_seqs, num_heads, 512], q_pe [num_seqs, num_heads, 64] in the
        group's dtype (torch or CuPy; a bfloat16 CuPy array as uint16). Returns `out`
        [num_seqs, num_heads, 512] (written in place when given, else a new array of
        q_nope's kind and dtype)."""
        idx = self.layer_index(layer)
        if not self.cuda:
            return self._run_host(q_nope, q_pe, idx, out)
        pool = self.pool
        qnv, qpv = _view(q_nope, "q_nope"), _view(q_pe, "q_pe")
        if out is None:
            self._check_q("q_nope", qnv.shape, qnv.typestr[1], int(qnv.typestr[2:]), 512)
            out = new_out(q_nope, qnv, self.device_id)
        ov = _view(out, "out")
        key = (qnv.layout_key, qpv.layout_key, ov.layout_key)
        ln = self._launches.get(key)
        if ln is None:
            ln = self._launches[key] = _MlaLaunch(self, qnv, qpv, ov)
        if self._num_seqs == 0:
            return out
        dev = self.device_id
        for name, v in (("q_nope", qnv), ("q_pe", qpv), ("out", ov)):
            if v.ptr % 16:
                raise InvalidArgumentError(f"{name} must be 16-byte aligned")
            check_ptr(v.ptr, name, dev)
        ptv, slv = self._bound  # type: ignore[misc]
        wait_producers(self.stream, dev, qnv, qpv, ptv, slv, ov)
        kv_base = pool.base_ptr + self.spec.latent_offset_bytes(self.group, 0, idx, 0, 0)
        with self._lock:
            ln.launch(self, qnv.ptr, qpv.ptr, ov.ptr, kv_base)
        return out


class _MlaLaunch:
    """A plan's parameter blocks for one layout of q_nope, q_pe and out (checked once)."""

    def __init__(self, plan: MlaDecodePlan, qnv: ArrayView, qpv: ArrayView, ov: ArrayView):
        qn, qp, o = _dev(qnv, "q_nope"), _dev(qpv, "q_pe"), _dev(ov, "out")
        for name, a, d in (
            ("q_nope", qn, _build.MLA_LATENT_DIM),
            ("q_pe", qp, _build.MLA_ROPE_DIM),
            ("out", o, _build.MLA_LATENT_DIM),
        ):
            plan._check_q(name, a.shape, a.kind, a.itemsize, d)
            if a.strides[2] != 1 or a.strides[0] % 8 or a.strides[1] % 8:
                raise InvalidArgumentError(
                    f"{name} rows must be contiguous and 16-byte aligned (strides {a.strides})"
                )
        v = plan.variant
        self.threads, self.smem = v.threads, v.dynamic_smem_bytes
        self.kernel = compiled_kernel(v, v.kernel, plan.device_id, self.smem)
        self.merge = compiled_kernel(v, "mla_merge", plan.device_id) if plan.split else None
        split, ws, n, h = plan.kv_split, plan._workspace, plan.num_seqs, plan.num_heads
        part_o = ws.ptr if split.split and ws is not None else 0
        part_lse = part_o + 4 * n * split.num_splits * h * _build.MLA_LATENT_DIM if part_o else 0
        spec, g = plan.spec, plan.group
        row = spec.latent_offset_bytes(g, 0, 0, 1, 0) - spec.latent_offset_bytes(g, 0, 0, 0, 0)
        ptv, slv = plan._bound  # type: ignore[misc]
        self.args = fill_args(
            MlaArgs,
            q_nope=0,
            qn_seq_stride=qn.strides[0],
            qn_head_stride=qn.strides[1],
            q_pe=0,
            qp_seq_stride=qp.strides[0],
            qp_head_stride=qp.strides[1],
            out=0,
            out_seq_stride=o.strides[0],
            out_head_stride=o.strides[1],
            part_o=part_o,
            part_lse=part_lse,
            kv_base=0,
            page_stride=spec.page_bytes,
            token_stride=row,
            num_pages=plan.pool.num_blocks,
            bs_log2=plan.block_size.bit_length() - 1,
            page_tables=ptv.ptr,
            pt_stride=plan._pt_stride,
            pt_width=plan._pt_width,
            seq_lens=slv.ptr,
            num_heads=h,
            chunk_tokens=split.chunk_tokens,
            max_splits=split.num_splits,
            scale_log2=plan.scale * math.log2(math.e),
        )
        self.params = param_block(self.args)
        self.margs = fill_args(
            MlaMergeArgs,
            part_o=part_o,
            part_lse=part_lse,
            out=0,
            out_seq_stride=o.strides[0],
            out_head_stride=o.strides[1],
            seq_lens=slv.ptr,
            num_heads=h,
            chunk_tokens=split.chunk_tokens,
            max_splits=split.num_splits,
        )
        self.mparams = param_block(self.margs)

    def launch(self, plan: MlaDecodePlan, qn: int, qp: int, out: int, kv_base: int) -> None:
        a = self.args
        a.q_nope, a.q_pe, a.out, a.kv_base = qn, qp, out, kv_base
        split = plan.kv_split
        grid = (plan.ctas_per_seq, split.num_splits, plan.num_seqs)
        launch(self.kernel, grid, self.threads, self.smem, plan.stream, self.params)
        if self.merge is not None:
            self.margs.out = out
            launch(
                self.merge, (plan.num_heads, plan.num_seqs, 1), 128, 0, plan.stream, self.mparams
            )


def paged_mla_decode(
    q_nope: Any,
    q_pe: Any,
    pool: Any,
    spec: Any,
    layer: int,
    page_tables: Any,
    seq_lens: Any,
    *,
    scale: float | None = None,
    out: Any = None,
    stream: Any = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    workspace: Any = None,
    plan: MlaDecodePlan | None = None,
) -> Any:
    """MLA decode of model layer `layer` (an mla_latent layer of `spec`) in one call:
    ``mla_decode_plan(pool, spec, group_of(layer), page_tables, seq_lens, q_nope.shape[1],
    scale=scale, ...).run(q_nope, q_pe, layer, out=out)``; with `plan` only its run (the plan's
    own arguments are then left out)."""
    if plan is None:
        check_spec(spec)
        lay = index_arg(layer, "layer")
        if not 0 <= lay < spec.num_layers:
            raise InvalidArgumentError(f"layer {lay} outside 0..{spec.num_layers - 1}")
        group, _ = spec.group_of_layer(lay)
        shape = tuple(getattr(q_nope, "shape", None) or np.shape(q_nope))
        if len(shape) != 3:
            raise InvalidArgumentError(f"q_nope must be [num_seqs, num_heads, 512], got {shape}")
        plan = mla_decode_plan(
            pool,
            spec,
            group,
            page_tables,
            seq_lens,
            int(shape[1]),
            scale=scale,  # type: ignore[arg-type]  # None is refused by the plan, naming it
            max_seq_len=max_seq_len,
            num_splits=num_splits,
            stream=stream,
            workspace=workspace,
        )
    else:
        if not isinstance(plan, MlaDecodePlan):
            raise TypeError(f"plan must be an MlaDecodePlan, got {type(plan).__name__}")
        if plan.pool is not pool or plan.spec != spec:
            raise InvalidArgumentError("the MlaDecodePlan was made for another pool or spec")
        given = [
            k
            for k, v in dict(
                scale=scale,
                stream=stream,
                max_seq_len=max_seq_len,
                num_splits=num_splits,
                workspace=workspace,
            ).items()
            if v is not None
        ]
        if given:
            raise InvalidArgumentError(
                f"{', '.join(given)}: the plan's own arguments; pass them when making the plan"
            )
    return plan.run(q_nope, q_pe, layer, out=out)
