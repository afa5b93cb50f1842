"""MLA attention over a hybrid pool's latent group (DeepSeek-V3 shape, absorbed projections),
decode and extend: ``mla_decode_plan(...)`` (one query token per sequence) or
``mla_extend_plan(...)`` (qo_len >= 1 per sequence, ragged, causal: chunked prefill over the
latent cache, speculative verify) once per step, ``plan.run(q_nope, q_pe, layer)`` per layer,
and the one-call decode form ``paged_mla_decode``. Both plans launch the one kernel
(cuda/paged_mla_decode.cu), whose CTA rows are (query position, head) pairs.

Semantics (FlashMLA, FlashInfer's BatchMLAPagedAttentionWrapper): per token the group's page
holds one row of latent_dim + rope_dim = 512 + 64 elements, c_kv then k_pe, per layer (layer
`i` of the group at byte ``i * block_size * row_bytes`` of the page: ModelKvSpec's
latent_offset_bytes). Per query head, q_nope [512] (already multiplied into the latent space)
and q_pe [64]; logits = (q_nope . c_kv + q_pe . k_pe) * scale; the output is the softmax-weighted
sum of c_kv, in the latent space [512]. Every query head reads the same latent rows (a GQA group
of all heads and query positions): a CTA serves a tile of query rows and loads each latent
tile once for all of them.

Supported (anything else is refused before a launch, naming this set): an ``mla_latent`` group
of latent_dim 512, rope_dim 64, dtype float16 or bfloat16, any power-of-two page size; 1..128
query heads; q_nope / q_pe / out in the group's dtype with contiguous rows; extend: every
sequence holds at least its query tokens, at most MAX_ROWS_PER_SEQ query rows (qo_len x heads).

An fp8 group (dtype float8_e4m3fn, one scale per layer: ``scales=MlaScales(pool, spec, group)``,
kernels/_mla_scales.py; rows written by mla_append_latent) is read by the same kernel built with
KV_FP8: q_nope, q_pe and out are then float16 or bfloat16 (q_nope's type decides, the other two
follow it); the rows are converted to that type in shared memory and the layer's scale is
applied to the logits and the output. The host backend computes the float64 reference of the
dequantized cache.
"""

from __future__ import annotations

import ctypes
import dataclasses
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
    fp8_query_dtype,
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
from kvpool.kernels._mla_args import MlaArgs, MlaMergeArgs
from kvpool.kernels._mla_scales import MlaScales, group_layer_index
from kvpool.kernels._prefill_work import host_lengths

MAX_MLA_HEADS = 128
MAX_ROWS_PER_SEQ = 1 << 30  # query rows of one sequence: int arithmetic in the kernel
MLA_HEAD_TILES = tuple(16 * mt for mt, _ in _build.MLA_VARIANT_CHOICES)  # 16, 32, 64


def supported_set() -> str:
    return (
        "an mla_latent group of latent_dim 512, rope_dim 64, dtype float16 or bfloat16 (or "
        f"{' / '.join(_build.MLA_FP8_DTYPES)} with MlaScales, float16 or bfloat16 queries), a "
        f"power-of-two page size; 1..{MAX_MLA_HEADS} query heads; extend: qo_len <= seq_len, "
        f"qo_len x heads <= {MAX_ROWS_PER_SEQ}"
    )


def default_head_tile(num_rows: int) -> int:
    """Query rows per CTA for a sequence of `num_rows` rows (decode: its heads; extend: the
    longest qo_len x heads): 16 up to 16 rows, 32 up to 32, else 64 (128 decode heads: 2 CTAs
    per chunk, side by side in the grid so that their reads of the same rows can meet in L2;
    at 128 heads on the H200 tile 64 was the fastest of 16 / 32 / 64:
    bench/results/2026-12-03_de41d1c_h200/)."""
    return next((t for t in MLA_HEAD_TILES if num_rows <= t), MLA_HEAD_TILES[-1])


def mla_variant(
    dtype: str, head_tile: int, rope: int = _build.MLA_ROPE_DIM, kv_fp8: bool = False
) -> _build.MlaVariant:
    """The module of a row tile (rope 0: a shared K = V head of 512, kernels/_shared_kv.py;
    kv_fp8: an e4m3 latent cache read with `dtype` queries)."""
    mt = head_tile // 16
    j = dict(_build.MLA_VARIANT_CHOICES)[mt]
    return _build.MlaVariant(dtype, mt, j, rope=rope, kv_fp8=kv_fp8)


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
        or kv.dtype not in _build.MLA_DTYPES + _build.MLA_FP8_DTYPES
        or bs is None
        or bs & (bs - 1)
    ):
        raise InvalidArgumentError(
            f"no MLA decode kernel for latent_dim {kv.latent_dim}, rope_dim {kv.rope_dim}, "
            f"dtype {kv.dtype}, page size {bs}; supported: {supported_set()}"
        )
    return g, kv


def host_latent_layer(pool: Any, spec: Any, group: int, idx: int, dtype: str) -> np.ndarray:
    """Layer `idx` of MLA group `group` of a host pool as [num_pages, block_size, 576]
    elements (bfloat16 as uint16, fp8 as uint8 codes), a view of the pool's memory."""
    n = pool.num_blocks * pool.block_bytes
    slab = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(pool.base_ptr))
    start = spec.latent_offset_bytes(group, 0, idx, 0, 0)
    width = _build.MLA_LATENT_DIM + _build.MLA_ROPE_DIM
    fp8 = dtype in _build.MLA_FP8_DTYPES
    elem = np.uint8 if fp8 else np.float16 if dtype == "float16" else np.uint16
    bs = int(spec.block_size(group))
    pages = slab.reshape(pool.num_blocks, pool.block_bytes)
    layer = pages[:, start : start + bs * width * np.dtype(elem).itemsize]
    return layer.view(elem).reshape(pool.num_blocks, bs, width)


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
    scales: MlaScales | None = None,
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
    >= plan.workspace_elems float32 is given; runs allocate nothing after the first per layout
    and can be captured in a CUDA graph). head_tile (16, 32 or 64) forces the heads per CTA
    (default: default_head_tile). An fp8 group needs `scales` (its MlaScales; each run reads
    the layer's scale then) and takes float16 or bfloat16 queries.

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
        scales=scales,
    )


def mla_extend_plan(
    pool: Any,
    spec: Any,
    group: int,
    qo_indptr: Any,
    page_tables: Any,
    seq_lens: Any,
    num_heads: int,
    *,
    scale: float,
    num_splits: int | None = None,
    stream: Any = None,
    workspace: Any = None,
    head_tile: int | None = None,
    scales: MlaScales | None = None,
) -> MlaExtendPlan:
    """An MLA extend (chunked prefill, speculative verify) plan for one step's ragged batch
    over MLA group `group` of `spec`: made once, then ``plan.run(q_nope, q_pe, layer)`` for
    every layer of the group.

    qo_indptr: [num_seqs + 1] offsets of each sequence's query tokens in q_nope / q_pe / out
    (from 0); seq_lens: [num_seqs] cached tokens per sequence, the new ones included (they are
    its LAST qo_len tokens, their latents already written); page_tables as for
    mla_decode_plan. Causal: query j of sequence i sees keys 0 .. seq_lens[i] - qo_len + j.
    The plan is made on the host, like prefill_plan's: give qo_indptr and seq_lens as host
    arrays (NumPy, lists, CPU tensors) and it keeps checked copies (uploaded to device arrays
    it owns, which the kernel reads); device arrays are read back (which synchronises).
    page_tables is bound as given (a device array on a CUDA pool) and read at every run.

    The query rows of a sequence (qo_len x num_heads, position-major) share its latent rows: a
    CTA takes a tile of 16 / 32 / 64 rows (head_tile forces it; default: default_head_tile of
    the longest qo_len x num_heads) and reads each latent tile once for them, up to the last
    key its last row sees. scale, num_splits, stream and workspace as for mla_decode_plan; a
    qo_len of 1 everywhere runs exactly the decode launch (the same results, bit for bit).
    `scales` as for mla_decode_plan (an fp8 group).

    On a host pool the arrays are NumPy and run() computes the float64 reference."""
    return MlaExtendPlan(
        pool,
        spec,
        group,
        qo_indptr,
        page_tables,
        seq_lens,
        num_heads,
        scale=scale,
        num_splits=num_splits,
        stream=stream,
        workspace=workspace,
        head_tile=head_tile,
        scales=scales,
    )


class _MlaPlan:
    """What the decode and extend plans share: the group, head and scale checks, the layer
    lookup, the host reference run, the split / workspace choice and the launch. A subclass
    binds its lengths (`_bind_cuda` / `_bind_host`) and names its query rows.

    `_bind_source` says where the rows are: MLA's latent group of a spec (one 576-wide row a
    token, one "KV head" for all query heads) here; the shared K = V head_dim 512 plans
    (kernels/_shared_kv.py) override it, the layer lookup and the host run for a pool's
    layout (num_kv_heads heads of 512, each read by its GQA group)."""

    _token_rows = "num_seqs"  # what q's first dimension counts, for messages
    _tables_name, _heads_name = "page_tables", "num_heads"  # the public arguments' names
    # Bound by the subclass: the batch's sizes, the host copies (host pool) or the device
    # pointers the kernel reads (CUDA pool; _qo_ptr 0: decode).
    _num_seqs: int
    _num_tokens: int
    _host_tables_lens: tuple[np.ndarray, np.ndarray]
    device_id: int
    stream: int
    _pt_ptr: int
    _lens_ptr: int
    _qo_ptr: int
    # Bound by _bind_source: the row geometry the kernel reads.
    _rope: int  # elements after the 512 of a row (MLA 64, shared K = V 0)
    _num_kv_heads: int
    _kv_head_stride: int  # bytes between KV heads' rows (MLA: 0)
    _page_stride: int
    _token_stride: int
    # An fp8 latent group and its scales (set by the MLA _bind_source; shared K = V: none).
    _fp8 = False
    scales: MlaScales | None = None

    def __init__(
        self,
        pool: Any,
        spec: Any,
        group: int,
        num_heads: int,
        *,
        scale: float,
        stream: Any,
        workspace: Any,
        head_tile: int | None,
        scales: MlaScales | None = None,
    ) -> None:
        self._bind_source(pool, spec, group)
        self._bind_scales(pool, scales)
        self.num_heads = h = self._check_heads(num_heads)
        self._group_heads = h // self._num_kv_heads
        self.scale = self._check_scale(scale)
        if head_tile is not None:
            head_tile = index_arg(head_tile, "head_tile")
            if head_tile not in MLA_HEAD_TILES:
                raise InvalidArgumentError(f"head_tile must be one of {MLA_HEAD_TILES}")
        self._head_tile_arg = head_tile
        self.pool = pool
        self.kv_split = SplitKv(chunk_tokens=1, num_splits=1)
        self._workspace: Workspace | None = None
        self._bound_views: tuple[ArrayView, ...] = ()
        self.cuda = pool_is_cuda(pool)
        if not self.cuda and (stream is not None or workspace is not None):
            raise InvalidArgumentError("a host pool takes no stream and no workspace")

    def _bind_source(self, pool: Any, spec: Any, group: int) -> None:
        self.group, kv = mla_group(spec, group)
        if spec.page_bytes != pool.block_bytes:
            raise InvalidArgumentError(
                f"the pool's blocks ({pool.block_bytes} bytes) are not the spec's pages "
                f"({spec.page_bytes}): make the pool with Pool.for_spec(spec, ...)"
            )
        self.spec, self.kv_group, self.dtype = spec, kv, kv.dtype
        self._fp8 = kv.dtype in _build.MLA_FP8_DTYPES
        self.block_size = int(spec.block_size(self.group))
        g = self.group
        self._rope, self._num_kv_heads, self._kv_head_stride = _build.MLA_ROPE_DIM, 1, 0
        self._page_stride = spec.page_bytes
        self._token_stride = spec.latent_offset_bytes(g, 0, 0, 1, 0) - spec.latent_offset_bytes(
            g, 0, 0, 0, 0
        )

    def _bind_scales(self, pool: Any, scales: Any) -> None:
        """An fp8 group needs its own MlaScales; any other takes none."""
        if self._fp8:
            if not isinstance(scales, MlaScales):
                raise InvalidArgumentError(
                    f"MLA attention over a {self.dtype} group needs scales=MlaScales(pool, "
                    f"spec, {self.group}), got {type(scales).__name__}"
                )
            if scales.pool is not pool or scales.spec != self.spec or scales.group != self.group:
                raise InvalidArgumentError(
                    "the MlaScales were made for another pool, spec or group than the plan's"
                )
            self.scales = scales
        elif scales is not None:
            raise InvalidArgumentError(
                f"scales are for fp8 MLA groups; this plan reads {self.dtype} rows"
            )

    def _q_dtype(self, kind: str, itemsize: int) -> str:
        """The query / output dtype: the group's, or over an fp8 group q_nope's (float16 or
        bfloat16)."""
        if self._fp8:
            return fp8_query_dtype(kind, itemsize, self.dtype)
        return self.dtype

    def _check_heads(self, num_heads: Any) -> int:
        h = index_arg(num_heads, "num_heads")
        if not 1 <= h <= MAX_MLA_HEADS:
            raise InvalidArgumentError(
                f"num_heads {h}: MLA attention runs 1..{MAX_MLA_HEADS} query heads"
            )
        return h

    def _check_scale(self, scale: Any) -> float:
        if scale is None:
            raise InvalidArgumentError(
                "scale is required: the model's softmax scale (DeepSeek-V3: 1/sqrt(192) "
                "times its YaRN mscale squared)"
            )
        return host_scale(scale, 1)

    def _kv_base(self, idx: int) -> int:
        """The device address of layer `idx` (of the plan's group) in page 0, KV head 0."""
        return int(self.pool.base_ptr) + self.spec.latent_offset_bytes(self.group, 0, idx, 0, 0)

    @property
    def num_seqs(self) -> int:
        return self._num_seqs

    @property
    def split(self) -> bool:
        return self.kv_split.split

    @property
    def num_splits(self) -> int:
        return self.kv_split.num_splits

    @property
    def workspace_elems(self) -> int:
        """float32 elements of split partials this plan's runs need (0: it does not split)."""
        if not self.kv_split.split:
            return 0
        return workspace_elems(
            self._num_seqs,
            self._rows_per_seq * self._num_kv_heads,
            _build.MLA_LATENT_DIM,
            self.kv_split.num_splits,
        )

    def layer_index(self, layer: int) -> int:
        """The index inside the plan's group of model layer `layer`."""
        return group_layer_index(self.spec, self.group, layer, "the plan's")

    def _choose_variant(self, max_qo_len: int) -> None:
        """The row tile (forced, or by the longest sequence's query rows per KV head) and its
        module."""
        self._rows_per_seq = max_qo_len * self._group_heads
        if self._rows_per_seq > MAX_ROWS_PER_SEQ:
            raise InvalidArgumentError(
                f"qo_len {max_qo_len} x {self._group_heads} heads: at most {MAX_ROWS_PER_SEQ} "
                "query rows per sequence and KV head"
            )
        tile = self._head_tile_arg or default_head_tile(max(self._rows_per_seq, 1))
        # An fp8 group's module is chosen per run by q's dtype (_MlaLaunch); this one is the
        # bfloat16-query module, whose tiling and split are the same.
        if self._fp8:
            self.variant = mla_variant("bfloat16", tile, self._rope, kv_fp8=True)
        else:
            self.variant = mla_variant(self.dtype, tile, self._rope)

    # -- host ----------------------------------------------------------------------------------

    def _host_tables(self, page_tables: Any, num_seqs: int) -> np.ndarray:
        name = self._tables_name
        tables = host_array(page_tables, name)
        if tables.dtype.kind not in "iu":
            raise InvalidArgumentError(f"{name} must be an integer array, got {tables.dtype}")
        if tables.ndim != 2 or tables.shape[0] != num_seqs:
            raise InvalidArgumentError(
                f"{name} must be [{num_seqs}, max_pages] (num_seqs from seq_lens), got "
                f"{tables.shape}"
            )
        return tables

    def _check_host_rows(self) -> None:
        tables, lens = self._host_tables_lens
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
        uint16, fp8 as uint8 codes), a view of the host pool's memory."""
        return host_latent_layer(self.pool, self.spec, self.group, idx, self.dtype)

    def _reference(
        self, qn: np.ndarray, qp: np.ndarray, cache: np.ndarray, q_dtype: str, kv_scale: float
    ) -> np.ndarray:
        raise NotImplementedError

    def _run_host(self, q_nope: Any, q_pe: Any, idx: int, out: Any) -> Any:
        qn, qp = host_array(q_nope, "q_nope"), host_array(q_pe, "q_pe")
        q_dtype = self._q_dtype(qn.dtype.kind, qn.itemsize)
        for name, a, d in (
            ("q_nope", qn, _build.MLA_LATENT_DIM),
            ("q_pe", qp, _build.MLA_ROPE_DIM),
        ):
            self._check_q(name, a.shape, a.dtype.kind, a.itemsize, d, q_dtype)
        o = None
        if out is not None:
            o = host_array(out, "out")
            self._check_q("out", o.shape, o.dtype.kind, o.itemsize, _build.MLA_LATENT_DIM, q_dtype)
        self._check_host_rows()
        kv_scale = 1.0
        if self.scales is not None:
            kv_scale = float(np.asarray(self.scales.scale)[idx])
        res = self._reference(qn, qp, self._host_latent(idx), q_dtype, kv_scale)
        res16 = reference.from_float64(res, q_dtype).view(qn.dtype)
        if o is None:
            return res16
        o[...] = res16
        return out

    def _check_q(
        self,
        name: str,
        shape: tuple,
        kind: str,
        itemsize: int,
        dim: int,
        q_dtype: str | None = None,
    ) -> None:
        want = (self._num_tokens, self.num_heads, dim)
        if tuple(shape) != want:
            raise InvalidArgumentError(
                f"{name} must be [{self._token_rows}, {self._heads_name}, {dim}] = {list(want)}, "
                "got "
                f"{tuple(shape)}"
            )
        dtype = q_dtype or self.dtype
        if not elem_ok(kind, itemsize, dtype, 2):
            what = "q_nope's dtype" if self._fp8 else "the group's dtype"
            raise InvalidArgumentError(
                f"{name} must hold {what} {dtype} (bfloat16: 2-byte non-float "
                f"data or torch.bfloat16), got a {itemsize}-byte {kind!r} type"
            )

    # -- CUDA ----------------------------------------------------------------------------------

    def _bind_page_tables(self, page_tables: Any, num_seqs: int | None) -> ArrayView:
        name = self._tables_name
        ptv = _view(page_tables, name)
        pt = _dev(ptv, name)
        check_int_array(pt, name, 4, 2)
        if num_seqs is not None and pt.shape[0] != num_seqs:
            raise InvalidArgumentError(
                f"{name} must be [{num_seqs}, max_pages], got {tuple(pt.shape)}"
            )
        self._pt_stride, self._pt_width = pt.strides[0], pt.shape[1]
        return ptv

    def _plan_cuda(self, max_seq_len: int, num_splits: int | None, workspace: Any) -> None:
        """The split and the workspace, once the lengths are bound (`_lens_ptr`, `_qo_ptr`)."""
        n = self._num_seqs
        if n > 65535:
            raise InvalidArgumentError("at most 65535 sequences per launch")
        if max_seq_len > self._pt_width * self.block_size:
            raise InvalidArgumentError(
                f"a seq_len ({max_seq_len}) exceeds the page tables' {self._pt_width} pages of "
                f"{self.block_size} tokens"
            )
        if num_splits is not None:
            num_splits = index_arg(num_splits, "num_splits")
        v = self.variant
        self.ctas_per_seq = self._num_kv_heads * -(-self._rows_per_seq // v.heads_per_cta)
        self.kv_split = split_kv(
            n,
            max(self.ctas_per_seq, 1),
            max(max_seq_len, 1),
            v.tokens_per_iter,
            num_sms(self.device_id),
            num_splits,
            1,
        )
        if self.kv_split.split or workspace is not None:
            self._workspace = Workspace(
                workspace, self.workspace_elems, self.device_id, self.stream
            )
        self._launches: dict[tuple, _MlaLaunch] = {}
        self._lock = threading.Lock()

    def run(self, q_nope: Any, q_pe: Any, layer: int, *, out: Any = None) -> Any:
        """MLA attention of the plan's query tokens over model layer `layer` (in the plan's
        group): q_nope [tokens, num_heads, 512], q_pe [tokens, num_heads, 64] in the group's
        dtype (torch or CuPy; a bfloat16 CuPy array as uint16), tokens = num_seqs for a
        decode plan, qo_indptr[-1] for an extend plan. Returns `out` [tokens, num_heads, 512]
        (written in place when given, else a new array of q_nope's kind and dtype)."""
        idx = self.layer_index(layer)
        if not self.cuda:
            return self._run_host(q_nope, q_pe, idx, out)
        return self._run_cuda(q_nope, q_pe, idx, out, "q_nope")

    def _run_cuda(self, q_nope: Any, q_pe: Any, idx: int, out: Any, q_name: str) -> Any:
        """The launch over layer `idx` of the group; q_pe None without a rope part."""
        qnv = _view(q_nope, q_name)
        qpv = _view(q_pe, "q_pe") if q_pe is not None else None
        if out is None:
            q_dtype = self._q_dtype(qnv.typestr[1], int(qnv.typestr[2:]))
            self._check_q(q_name, qnv.shape, qnv.typestr[1], int(qnv.typestr[2:]), 512, q_dtype)
            out = new_out(q_nope, qnv, self.device_id)
        ov = _view(out, "out")
        key = (qnv.layout_key, qpv.layout_key if qpv else None, ov.layout_key)
        ln = self._launches.get(key)
        if ln is None:
            ln = self._launches[key] = _MlaLaunch(self, qnv, qpv, ov, q_name)
        if self._num_seqs == 0 or self._rows_per_seq == 0:
            return out
        dev = self.device_id
        views = [(q_name, qnv), ("out", ov)] + ([("q_pe", qpv)] if qpv else [])
        for name, v in views:
            if v.ptr % 16:
                raise InvalidArgumentError(f"{name} must be 16-byte aligned")
            check_ptr(v.ptr, name, dev)
        wait_producers(self.stream, dev, *(v for _, v in views), *self._bound_views)
        with self._lock:
            kv_scale = self.scales.index_ptr(idx) if self.scales is not None else 0
            ln.launch(self, qnv.ptr, qpv.ptr if qpv else 0, ov.ptr, self._kv_base(idx), kv_scale)
        return out


class MlaDecodePlan(_MlaPlan):
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
        scales: MlaScales | None = None,
    ) -> None:
        super().__init__(
            pool,
            spec,
            group,
            num_heads,
            scale=scale,
            stream=stream,
            workspace=workspace,
            head_tile=head_tile,
            scales=scales,
        )
        self.page_tables, self.seq_lens = page_tables, seq_lens
        self._choose_variant(1)
        if max_seq_len is not None:
            max_seq_len = index_arg(max_seq_len, "max_seq_len")
        if num_splits is not None:
            num_splits = index_arg(num_splits, "num_splits")
        if not self.cuda:
            lens = host_array(seq_lens, "seq_lens")
            if lens.dtype.kind not in "iu" or lens.ndim != 1:
                raise InvalidArgumentError(
                    f"seq_lens must be a 1-d integer array, got {lens.dtype} {lens.shape}"
                )
            self._num_seqs = self._num_tokens = int(lens.shape[0])
            self._host_tables_lens = (self._host_tables(page_tables, self._num_seqs), lens)
            return
        slv = _view(seq_lens, "seq_lens")
        check_int_array(_dev(slv, "seq_lens"), "seq_lens", 4, 1)
        n = self._num_seqs = self._num_tokens = slv.shape[0]
        ptv = self._bind_page_tables(page_tables, n)
        self.device_id = dev = device_index(self.pool)
        self._bound_views = (ptv, slv)
        self._pt_ptr, self._lens_ptr, self._qo_ptr = ptv.ptr, slv.ptr, 0
        self.stream = sp = launch_stream(stream, dev, page_tables, seq_lens)
        if n:
            check_ptr(ptv.ptr, self._tables_name, dev)
            check_ptr(slv.ptr, "seq_lens", dev)
        if max_seq_len is None:
            max_seq_len = 0
            if n:
                import cupy

                wait_producers(sp, dev, slv)
                with cupy.cuda.Device(dev), cupy_stream(sp):
                    max_seq_len = int(cupy.asarray(seq_lens).max())
        self._plan_cuda(max_seq_len, num_splits, workspace)

    def _reference(
        self, qn: np.ndarray, qp: np.ndarray, cache: np.ndarray, q_dtype: str, kv_scale: float
    ) -> np.ndarray:
        tables, lens = self._host_tables_lens
        return reference.mla_decode_reference(
            qn, qp, cache, tables, lens, self.scale, q_dtype, kv_dtype=self.dtype, kv_scale=kv_scale
        )


class MlaExtendPlan(_MlaPlan):
    """One step's ragged MLA extend batch over one pool's MLA group (see
    :func:`mla_extend_plan`): `qo_indptr` and `seq_lens` are the plan's checked host copies."""

    _token_rows = "total_q"

    def __init__(
        self,
        pool: Any,
        spec: Any,
        group: int,
        qo_indptr: Any,
        page_tables: Any,
        seq_lens: Any,
        num_heads: int,
        *,
        scale: float,
        num_splits: int | None,
        stream: Any,
        workspace: Any,
        head_tile: int | None,
        scales: MlaScales | None = None,
    ) -> None:
        super().__init__(
            pool,
            spec,
            group,
            num_heads,
            scale=scale,
            stream=stream,
            workspace=workspace,
            head_tile=head_tile,
            scales=scales,
        )
        self.page_tables = page_tables
        if self.cuda:
            self.device_id = dev = device_index(pool)
            self.stream = launch_stream(stream, dev, page_tables, qo_indptr, seq_lens)
            qo_indptr = self._to_host(qo_indptr, "qo_indptr")
            seq_lens = self._to_host(seq_lens, "seq_lens")
        else:
            qo_indptr = host_array(qo_indptr, "qo_indptr")
            seq_lens = host_array(seq_lens, "seq_lens")
        self.qo_indptr, self.seq_lens = host_lengths(qo_indptr, seq_lens)
        n = self._num_seqs = int(self.seq_lens.shape[0])
        self._num_tokens = self.total_q = int(self.qo_indptr[-1])
        if self.total_q > 2**31 - 1:
            raise InvalidArgumentError("at most 2**31 - 1 query tokens per launch")
        qo_lens = np.diff(self.qo_indptr)
        self.max_qo_len = int(qo_lens.max()) if n else 0
        self._choose_variant(self.max_qo_len)
        if not self.cuda:
            self._host_tables_lens = (self._host_tables(page_tables, n), self.seq_lens)
            return
        import cupy

        ptv = self._bind_page_tables(page_tables, n)
        self._bound_views = (ptv,)
        if n:
            check_ptr(ptv.ptr, self._tables_name, dev)
        with cupy.cuda.Device(dev), cupy_stream(self.stream):
            # The plan's own device copies: the kernel reads exactly what the plan checked.
            self._device_lens = (
                cupy.asarray(self.qo_indptr.astype(np.int32)),
                cupy.asarray(self.seq_lens.astype(np.int32)),
            )
        self._pt_ptr = ptv.ptr
        self._qo_ptr, self._lens_ptr = (int(a.data.ptr) for a in self._device_lens)
        max_seq_len = int(self.seq_lens.max()) if n else 0
        self._plan_cuda(max_seq_len, num_splits, workspace)

    def _to_host(self, a: Any, name: str) -> np.ndarray:
        """A length array as NumPy: a device one read back on the plan's stream (synchronises)."""
        if not hasattr(a, "__cuda_array_interface__"):
            return host_array(a, name)
        import cupy

        v = _view(a, name)
        check_int_array(_dev(v, name), name, 4, 1)
        if v.ptr:
            check_ptr(v.ptr, name, self.device_id)
        wait_producers(self.stream, self.device_id, v)
        with cupy.cuda.Device(self.device_id), cupy_stream(self.stream):
            return cupy.asnumpy(cupy.asarray(a))

    def _reference(
        self, qn: np.ndarray, qp: np.ndarray, cache: np.ndarray, q_dtype: str, kv_scale: float
    ) -> np.ndarray:
        tables, lens = self._host_tables_lens
        return reference.mla_extend_reference(
            qn,
            qp,
            cache,
            tables,
            lens,
            self.qo_indptr,
            self.scale,
            q_dtype,
            kv_dtype=self.dtype,
            kv_scale=kv_scale,
        )


class _MlaLaunch:
    """A plan's parameter blocks for one layout of q_nope, q_pe and out (checked once)."""

    def __init__(
        self,
        plan: _MlaPlan,
        qnv: ArrayView,
        qpv: ArrayView | None,
        ov: ArrayView,
        q_name: str = "q_nope",
    ):
        qn, o = _dev(qnv, q_name), _dev(ov, "out")
        qp = _dev(qpv, "q_pe") if qpv is not None else None
        q_dtype = plan._q_dtype(qn.kind, qn.itemsize)
        checks = [(q_name, qn, _build.MLA_LATENT_DIM), ("out", o, _build.MLA_LATENT_DIM)]
        if qp is not None:
            checks.append(("q_pe", qp, plan._rope))
        for name, a, d in checks:
            plan._check_q(name, a.shape, a.kind, a.itemsize, d, q_dtype)
            if a.strides[2] != 1 or a.strides[0] % 8 or a.strides[1] % 8:
                raise InvalidArgumentError(
                    f"{name} rows must be contiguous and 16-byte aligned (strides {a.strides})"
                )
        v = plan.variant
        if v.kv_fp8:  # the module of q's dtype
            v = dataclasses.replace(v, dtype=q_dtype)
        self.threads, self.smem = v.threads, v.dynamic_smem_bytes
        self.kernel = compiled_kernel(v, v.kernel, plan.device_id, self.smem)
        self.merge = compiled_kernel(v, "mla_merge", plan.device_id) if plan.split else None
        split, ws, n, rows = plan.kv_split, plan._workspace, plan.num_seqs, plan._rows_per_seq
        part_o = ws.ptr if split.split and ws is not None else 0
        all_rows = rows * plan._num_kv_heads
        part_lse = (
            part_o + 4 * n * split.num_splits * all_rows * _build.MLA_LATENT_DIM if part_o else 0
        )
        common = dict(
            part_o=part_o,
            part_lse=part_lse,
            out=0,
            out_token_stride=o.strides[0],
            out_head_stride=o.strides[1],
            seq_lens=plan._lens_ptr,
            qo_indptr=plan._qo_ptr,
            group_heads=plan._group_heads,
            num_kv_heads=plan._num_kv_heads,
            rows_per_seq=rows,
            chunk_tokens=split.chunk_tokens,
            max_splits=split.num_splits,
        )
        self.args = fill_args(
            MlaArgs,
            **common,
            q_nope=0,
            qn_token_stride=qn.strides[0],
            qn_head_stride=qn.strides[1],
            q_pe=0,
            qp_token_stride=qp.strides[0] if qp is not None else 0,
            qp_head_stride=qp.strides[1] if qp is not None else 0,
            kv_base=0,
            page_stride=plan._page_stride,
            token_stride=plan._token_stride,
            kv_head_stride=plan._kv_head_stride,
            num_pages=plan.pool.num_blocks,
            bs_log2=plan.block_size.bit_length() - 1,
            page_tables=plan._pt_ptr,
            pt_stride=plan._pt_stride,
            pt_width=plan._pt_width,
            scale_log2=plan.scale * math.log2(math.e),
            kv_scale=0,
        )
        self.params = param_block(self.args)
        self.margs = fill_args(MlaMergeArgs, **common)
        self.mparams = param_block(self.margs)

    def launch(
        self, plan: _MlaPlan, qn: int, qp: int, out: int, kv_base: int, kv_scale: int
    ) -> None:
        a = self.args
        a.q_nope, a.q_pe, a.out, a.kv_base, a.kv_scale = qn, qp, out, kv_base, kv_scale
        split = plan.kv_split
        grid = (plan.ctas_per_seq, split.num_splits, plan.num_seqs)
        launch(self.kernel, grid, self.threads, self.smem, plan.stream, self.params)
        if self.merge is not None:
            self.margs.out = out
            grid = (plan._rows_per_seq * plan._num_kv_heads, plan.num_seqs, 1)
            launch(self.merge, grid, 128, 0, plan.stream, self.mparams)


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
    scales: MlaScales | None = None,
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
            scales=scales,
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
                scales=scales,
            ).items()
            if v is not None
        ]
        if given:
            raise InvalidArgumentError(
                f"{', '.join(given)}: the plan's own arguments; pass them when making the plan"
            )
    return plan.run(q_nope, q_pe, layer, out=out)
