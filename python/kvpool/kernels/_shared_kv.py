"""Attention of head_dim 512 with K = V (Gemma 4's global layers, ``attention_k_eq_v``: the
value projection is the key projection, so a token's key row is also its value row) over a
pool's paged cache, decode and extend: ``shared_kv_decode_plan(...)`` (one query token per
sequence) or ``shared_kv_extend_plan(...)`` (qo_len >= 1 per sequence, ragged, causal) once per
step, ``plan.run(q, layer)`` per layer.

The kernel is MLA's (cuda/paged_mla_decode.cu) compiled without a rope part (``-DROPE=0``):
one 512-wide row per token and KV head, loaded once into shared memory and read there as K
(S = Q K^T) and as V (O += P V). Each KV head is read by its own GQA group: the CTA rows of KV
head kvh are the (query position, head) pairs of query heads kvh * g .. kvh * g + g - 1
(g = num_q_heads / num_kv_heads), so a 64-token tile of that head's rows serves all of them.
The rows are the K half of each layer of the pool's layout (``KvLayout.strides()``: block,
layer, token, head); the V half is never read, so a model may leave it unwritten (or write
the same rows there: ``append_kv(k, k, ...)``). A pool whose V rows differ from its K rows at
head_dim 512 has no kernel: the plans cannot tell, so the caller states K = V by using them;
``decode_plan`` / ``prefill_plan`` refuse head_dim 512, naming these plans.

Semantics as ``decode_plan`` / ``prefill_plan`` with v = k: decode, the query of sequence i
(at position seq_lens[i] - 1) sees its seq_lens[i] keys; extend, query j of a sequence of
seq_len L and qo_len Q sees keys 0 .. L - Q + j (the new tokens are the last Q, their rows
already written). `scale` defaults to 1/sqrt(512). The plans keep the host-side checks of the
MLA plans (kernels/_mla.py): split-KV over long sequences merged by a second launch, a
workspace the plan owns or the caller's, runs that allocate nothing after the first and can
be captured in a CUDA graph; an extend plan of qo_len 1 everywhere gives the decode plan's
output bit for bit.

Supported (anything else is refused before a launch, naming this set): see supported_set().
On a host pool the arrays are NumPy and run() computes the float64 reference
(``reference.paged_attention_decode`` / ``paged_attention_prefill`` with the K cache as V).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool import reference
from kvpool.exceptions import InvalidArgumentError
from kvpool.kernels import _build
from kvpool.kernels._args import index_arg
from kvpool.kernels._common import PoolInfo, host_array, host_scale
from kvpool.kernels._mla import MAX_ROWS_PER_SEQ, MlaDecodePlan, MlaExtendPlan

SHARED_KV_HEAD_DIM = _build.MLA_LATENT_DIM  # 512: the kernel's row width, K and V alike


def supported_set() -> str:
    return (
        f"head_dim {SHARED_KV_HEAD_DIM} with K = V (the K rows are read as both; the V half is "
        "not read): dtype float16 or bfloat16, block_size a power of two, num_q_heads a multiple "
        f"of num_kv_heads; extend: qo_len <= seq_len, qo_len x num_q_heads / num_kv_heads <= "
        f"{MAX_ROWS_PER_SEQ}; K != V at head_dim {SHARED_KV_HEAD_DIM} is not supported"
    )


def check_shared_kv_pool(pool: Any) -> PoolInfo:
    """The pool's numbers, refused unless its layout is in the supported set."""
    if not hasattr(pool, "layout") or not hasattr(pool, "base_ptr"):
        raise TypeError(f"pool must be a kvpool Pool, got {type(pool).__name__}")
    info = PoolInfo(pool)
    bs = info.block_size
    if (
        info.head_dim != SHARED_KV_HEAD_DIM
        or info.dtype not in _build.MLA_DTYPES
        or bs < 1
        or bs & (bs - 1)
    ):
        raise InvalidArgumentError(
            f"no shared K = V kernel for dtype {info.dtype}, head_dim {info.head_dim}, "
            f"block_size {bs}; supported: {supported_set()}"
        )
    return info


class _SharedKvSource:
    """The MLA plans' row source replaced by a pool layout's K rows (num_kv_heads heads of 512,
    no rope part); the subclasses below put it in front of MlaDecodePlan / MlaExtendPlan."""

    _tables_name, _heads_name = "block_tables", "num_q_heads"

    pool: Any
    dtype: str
    block_size: int
    num_heads: int
    scale: float
    _rope: int
    _num_kv_heads: int
    _kv_head_stride: int
    _page_stride: int
    _token_stride: int
    _host_tables_lens: tuple[np.ndarray, np.ndarray]

    def _bind_source(self, pool: Any, spec: Any, group: Any) -> None:
        info = self.info = check_shared_kv_pool(pool)
        st = pool.layout.strides()
        self.dtype, self.block_size = info.dtype, int(info.block_size)
        self._rope, self._num_kv_heads = 0, int(info.num_kv_heads)
        self._kv_head_stride, self._page_stride = int(st["head"]), int(st["block"])
        self._token_stride, self._layer_stride = int(st["token"]), int(st["layer"])

    def _check_heads(self, num_q_heads: Any) -> int:
        hq = index_arg(num_q_heads, "num_q_heads")
        if hq <= 0 or hq % self._num_kv_heads:
            raise InvalidArgumentError(
                f"num_q_heads {hq} is not a multiple of num_kv_heads {self._num_kv_heads}"
            )
        return hq

    def _check_scale(self, scale: Any) -> float:
        return host_scale(scale, SHARED_KV_HEAD_DIM)

    def _kv_base(self, idx: int) -> int:
        """Layer `idx`'s K rows in block 0 (KV head 0): the kernel reads them as K and V."""
        return int(self.pool.base_ptr) + idx * self._layer_stride

    def layer_index(self, layer: int) -> int:
        layer = index_arg(layer, "layer")
        if not 0 <= layer < self.info.num_layers:
            raise InvalidArgumentError(f"layer {layer} outside 0..{self.info.num_layers - 1}")
        return layer

    def _shared_reference(self, q64: np.ndarray, k: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _run_host_q(self, q: Any, idx: int, out: Any) -> Any:
        qa = host_array(q, "q")
        self._check_q("q", qa.shape, qa.dtype.kind, qa.itemsize, SHARED_KV_HEAD_DIM)  # type: ignore[attr-defined]
        self._check_host_rows()  # type: ignore[attr-defined]
        res = self._shared_reference(qa, self.pool.k_view(idx))
        res16 = reference.from_float64(res, self.dtype).view(qa.dtype)
        if out is None:
            return res16
        o = host_array(out, "out")
        self._check_q("out", o.shape, o.dtype.kind, o.itemsize, SHARED_KV_HEAD_DIM)  # type: ignore[attr-defined]
        o[...] = res16
        return out

    def run(self, q: Any, layer: int, *, out: Any = None) -> Any:  # type: ignore[override]
        """Attention of the plan's query tokens over layer `layer`'s K = V rows: q [tokens,
        num_q_heads, 512] in the pool's dtype (torch or CuPy; a bfloat16 CuPy array as
        uint16), tokens = num_seqs for a decode plan, qo_indptr[-1] for an extend plan.
        Returns `out` [tokens, num_q_heads, 512] (written in place when given, else a new
        array of q's kind and dtype)."""
        idx = self.layer_index(layer)
        if not self.cuda:  # type: ignore[attr-defined]
            return self._run_host_q(q, idx, out)
        return self._run_cuda(q, None, idx, out, "q")  # type: ignore[attr-defined]


class SharedKvDecodePlan(_SharedKvSource, MlaDecodePlan):  # type: ignore[misc]
    """A head_dim 512 K = V decode plan (Gemma 4 global layers) for one step's batch: made
    once, then ``plan.run(q, layer)`` for every layer of the pool.

    block_tables: int32 [num_seqs, max_blocks] block ids (-1 unused); seq_lens: int32
    [num_seqs] (the new token included); num_q_heads a multiple of the pool's num_kv_heads.
    scale (default 1/sqrt(512)), max_seq_len, num_splits, stream and workspace as for
    decode_plan; head_tile (16, 32 or 64) forces the query rows per CTA (default: the
    smallest that holds a KV head's group). The layer's K rows are read as K and V."""

    def __init__(
        self,
        pool: Any,
        block_tables: Any,
        seq_lens: Any,
        num_q_heads: int,
        *,
        scale: float | None = None,
        max_seq_len: int | None = None,
        num_splits: int | None = None,
        stream: Any = None,
        workspace: Any = None,
        head_tile: int | None = None,
    ) -> None:
        super().__init__(
            pool,
            None,
            None,  # type: ignore[arg-type]  # no spec / group: _bind_source reads the layout
            block_tables,
            seq_lens,
            num_q_heads,
            scale=scale,  # type: ignore[arg-type]  # None: 1/sqrt(512), by _check_scale
            max_seq_len=max_seq_len,
            num_splits=num_splits,
            stream=stream,
            workspace=workspace,
            head_tile=head_tile,
        )

    def _shared_reference(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        tables, lens = self._host_tables_lens
        return reference.paged_attention_decode(q, k, k, tables, lens, self.dtype, self.scale)


class SharedKvExtendPlan(_SharedKvSource, MlaExtendPlan):  # type: ignore[misc]
    """A head_dim 512 K = V extend plan (chunked prefill, prefix-cached continuation,
    speculative verify; causal) for one step's ragged batch: made once, then
    ``plan.run(q, layer)`` per layer.

    qo_indptr [num_seqs + 1] (from 0) packs each sequence's query tokens in q / out; seq_lens
    [num_seqs] counts its cached tokens, the new ones (its last qo_len) included. qo_indptr and
    seq_lens are host arrays (device ones are read back, which synchronises); block_tables is
    bound as given and read at every run. Query j of a sequence sees keys 0 .. seq_len - qo_len
    + j. scale, num_splits, stream, workspace and head_tile as for shared_kv_decode_plan.

    `qo_indptr` and `seq_lens` on the plan are its checked host copies."""

    def __init__(
        self,
        pool: Any,
        qo_indptr: Any,
        block_tables: Any,
        seq_lens: Any,
        num_q_heads: int,
        *,
        scale: float | None = None,
        num_splits: int | None = None,
        stream: Any = None,
        workspace: Any = None,
        head_tile: int | None = None,
    ) -> None:
        super().__init__(
            pool,
            None,
            None,  # type: ignore[arg-type]  # no spec / group: _bind_source reads the layout
            qo_indptr,
            block_tables,
            seq_lens,
            num_q_heads,
            scale=scale,  # type: ignore[arg-type]  # None: 1/sqrt(512), by _check_scale
            num_splits=num_splits,
            stream=stream,
            workspace=workspace,
            head_tile=head_tile,
        )

    def _shared_reference(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        tables, lens = self._host_tables_lens
        return reference.paged_attention_prefill(
            q, k, k, self.qo_indptr, tables, lens, self.dtype, self.scale, causal=True
        )


# The plan functions, named as the other kernels' (decode_plan, mla_decode_plan): the classes
# themselves, whose constructors a function would only forward to.
shared_kv_decode_plan = SharedKvDecodePlan
shared_kv_extend_plan = SharedKvExtendPlan
