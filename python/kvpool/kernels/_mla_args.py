"""The parameter blocks of cuda/paged_mla_decode.cu's kernels (paged_mla_decode, mla_merge), in
their order (tests/test_mla.py checks the names against the .cu)."""

from __future__ import annotations

import ctypes

_u64, _i64, _i32, _f32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class MlaArgs(ctypes.Structure):
    """paged_mla_decode's parameters. The q / out strides are per query token and per head;
    qo_indptr 0 (null) is decode: one query token per sequence. group_heads query heads share
    each of the num_kv_heads KV heads, kv_head_stride bytes apart (MLA: all heads, 1, 0).
    kv_scale: the layer's float32 dequantization scale of an fp8 group (0 otherwise)."""

    _fields_ = [
        ("q_nope", _u64),
        ("qn_token_stride", _i64),
        ("qn_head_stride", _i64),
        ("q_pe", _u64),
        ("qp_token_stride", _i64),
        ("qp_head_stride", _i64),
        ("out", _u64),
        ("out_token_stride", _i64),
        ("out_head_stride", _i64),
        ("part_o", _u64),
        ("part_lse", _u64),
        ("kv_base", _u64),
        ("page_stride", _i64),
        ("token_stride", _i64),
        ("kv_head_stride", _i64),
        ("num_pages", _i32),
        ("bs_log2", _i32),
        ("page_tables", _u64),
        ("pt_stride", _i64),
        ("pt_width", _i32),
        ("seq_lens", _u64),
        ("qo_indptr", _u64),
        ("group_heads", _i32),
        ("num_kv_heads", _i32),
        ("rows_per_seq", _i32),
        ("chunk_tokens", _i32),
        ("max_splits", _i32),
        ("scale_log2", _f32),
        ("kv_scale", _u64),
    ]


class MlaMergeArgs(ctypes.Structure):
    """mla_merge's parameters."""

    _fields_ = [
        ("part_o", _u64),
        ("part_lse", _u64),
        ("out", _u64),
        ("out_token_stride", _i64),
        ("out_head_stride", _i64),
        ("seq_lens", _u64),
        ("qo_indptr", _u64),
        ("group_heads", _i32),
        ("num_kv_heads", _i32),
        ("rows_per_seq", _i32),
        ("chunk_tokens", _i32),
        ("max_splits", _i32),
    ]
