"""The decode kernels' parameter blocks and the choice of kernel for a pool's shape."""

from __future__ import annotations

import ctypes
import dataclasses
import functools

from kvpool.exceptions import InvalidArgumentError
from kvpool.kernels import _build
from kvpool.kernels._decode_split import CTAS_PER_SM, TC_CTAS_PER_SM
from kvpool.kernels._tuning import Tuning

_u64, _i64, _i32, _f32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class DecodeArgs(ctypes.Structure):
    """paged_decode_tc's parameters (cuda/paged_decode_tc.cu), in order; the CUDA-core kernel
    takes the same less TC_ONLY."""

    _fields_ = [
        ("q", _u64),
        ("q_seq_stride", _i64),
        ("q_head_stride", _i64),
        ("out", _u64),
        ("out_seq_stride", _i64),
        ("out_head_stride", _i64),
        ("part_o", _u64),
        ("part_lse", _u64),
        ("counters", _u64),
        ("k_base", _u64),
        ("v_base", _u64),
        ("block_stride", _i64),
        ("token_stride", _i64),
        ("head_stride", _i64),
        ("num_blocks", _i32),
        ("bs_log2", _i32),
        ("block_tables", _u64),
        ("bt_stride", _i64),
        ("seq_lens", _u64),
        ("num_q_heads", _i32),
        ("head_dim", _i32),
        ("group", _i32),
        ("gq", _i32),
        ("chunk_tokens", _i32),
        ("max_splits", _i32),
        ("scale_log2", _f32),
        # Windows and sinks (tensor-core kernel only): the per-sequence first page of a
        # window-relative table (0: null), the table width, the sliding window, the chunk, the
        # per-head sink logits of the run's layer (0: null).
        ("first_page", _u64),
        ("bt_width", _i32),
        ("window", _i32),
        ("attn_chunk", _i32),
        ("sinks", _u64),
    ]


class DecodeFp8Args(ctypes.Structure):
    """The tensor-core kernel's parameters over an fp8 cache: DecodeArgs' and the scales."""

    _fields_ = [
        *DecodeArgs._fields_,
        ("k_scale", _u64),
        ("v_scale", _u64),
        ("scale_head_stride", _i32),
    ]


# DecodeArgs fields the tensor-core kernel has and the CUDA-core kernel does not.
TC_ONLY = (
    "counters",
    "bs_log2",
    "head_dim",
    "gq",
    "first_page",
    "bt_width",
    "window",
    "attn_chunk",
    "sinks",
)


class MergeArgs(ctypes.Structure):
    """merge_splits' parameters (cuda/paged_decode.cu), the CUDA-core kernel's second launch."""

    _fields_ = [
        ("part_o", _u64),
        ("part_lse", _u64),
        ("out", _u64),
        ("out_seq_stride", _i64),
        ("out_head_stride", _i64),
        ("seq_lens", _u64),
        ("num_q_heads", _i32),
        ("chunk_tokens", _i32),
        ("max_splits", _i32),
    ]


@dataclasses.dataclass(frozen=True)
class DecodeKernel:
    """The decode module a plan launches (for an fp8 cache: with float16 queries; run picks the
    query dtype), its head tile and what the split plan needs of it."""

    variant: _build.TcVariant | _build.DecodeVariant
    gq: int
    ctas_per_sm: int

    @property
    def tc(self) -> bool:
        return isinstance(self.variant, _build.TcVariant)

    def for_query(self, q_dtype: str) -> _build.TcVariant | _build.DecodeVariant:
        """The module for queries of `q_dtype` (only an fp8 cache's modules depend on it)."""
        v = self.variant
        if isinstance(v, _build.TcVariant) and v.fp8 and v.q_dtype != q_dtype:
            return dataclasses.replace(v, q_dtype=q_dtype)
        return v


def decode_kernel(
    dtype: str, head_dim: int, block_size: int, group: int, t: Tuning
) -> DecodeKernel:
    """The kernel for this pool shape and GQA group under the tuning `t`; a shape no kernel runs
    is refused, naming the supported set."""
    why = unsupported(dtype, head_dim, block_size, t.decode_pipeline)
    if why is not None:
        raise InvalidArgumentError(why)
    if t.decode_pipeline == _build.TC:
        fp8 = dtype in _build.FP8_DTYPES
        try:  # a tuning whose stages cannot fit: nothing planned
            variant, gq = _build.tc_variant(
                dtype, head_dim, group, "float16" if fp8 else None, t.fp8_decode
            )
        except ValueError as e:
            raise InvalidArgumentError(str(e)) from None
        fill = t.fp8_decode.fill if fp8 and t.fp8_decode.fill else TC_CTAS_PER_SM
        return DecodeKernel(variant, gq, fill)
    gq = _build.group_tile(group)
    return DecodeKernel(
        _build.DecodeVariant(dtype, head_dim, block_size, gq, t.decode_pipeline), gq, CTAS_PER_SM
    )


@functools.cache
def unsupported(dtype: str, head_dim: int, block_size: int, pipeline: int) -> str | None:
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
            f"with head_dim a multiple of 16 in 32..256 and block_size a power of two in 1..256"
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
