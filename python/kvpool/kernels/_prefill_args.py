"""The prefill kernels' parameter blocks (cuda/paged_prefill.cu, cuda/paged_prefill_sm90.cu),
in order."""

from __future__ import annotations

import ctypes

_u64, _i64, _i32, _f32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class PrefillArgs(ctypes.Structure):
    _fields_ = [
        ("q", _u64),
        ("q_tok_stride", _i64),
        ("q_head_stride", _i64),
        ("out", _u64),
        ("out_tok_stride", _i64),
        ("out_head_stride", _i64),
        ("part_o", _u64),
        ("part_lse", _u64),
        ("k_base", _u64),
        ("v_base", _u64),
        ("block_stride", _i64),
        ("token_stride", _i64),
        ("head_stride", _i64),
        ("num_blocks", _i32),
        ("block_tables", _u64),
        ("bt_stride", _i64),
        ("bt_width", _i32),
        ("seq_lens", _u64),
        ("qo_indptr", _u64),
        ("work", _u64),
        ("total_q", _i32),
        ("num_q_heads", _i32),
        ("group", _i32),
        ("gh", _i32),
        ("q_tile_tokens", _i32),
        ("causal", _i32),
        ("scale_log2", _f32),
        # Windows and sinks (paged_prefill.cu only; the sm_90 kernel takes none: SM80_ONLY):
        # the per-sequence first page of a window-relative table (0: null), the sliding
        # window, the chunk (0: none), the run's per-head sink logits (0: null).
        ("first_page", _u64),
        ("window", _i32),
        ("attn_chunk", _i32),
        ("sinks", _u64),
        # paged_prefill_sm90.cu only (SM90_ONLY): the TMA maps of the pool's K and V (128
        # bytes each, by value; zeros for its cp.async modules, which read none) and the layer.
        ("k_map", _u64 * 16),
        ("v_map", _u64 * 16),
        ("layer", _i32),
    ]


# PrefillArgs fields paged_prefill.cu has and paged_prefill_sm90.cu does not, and the reverse.
SM80_ONLY = ("first_page", "window", "attn_chunk", "sinks")
SM90_ONLY = ("k_map", "v_map", "layer")


class PrefillFp8Args(ctypes.Structure):
    """The prefill kernel's parameters over an fp8 cache: PrefillArgs' and the scales."""

    _fields_ = [
        *PrefillArgs._fields_,
        ("k_scale", _u64),
        ("v_scale", _u64),
        ("scale_head_stride", _i32),
    ]


class PrefillMergeArgs(ctypes.Structure):
    """merge_prefill_splits' parameters."""

    _fields_ = [
        ("part_o", _u64),
        ("part_lse", _u64),
        ("out", _u64),
        ("out_tok_stride", _i64),
        ("out_head_stride", _i64),
        ("total_q", _i32),
        ("num_q_heads", _i32),
        ("num_splits", _i32),
        ("sinks", _u64),
    ]
