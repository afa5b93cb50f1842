"""CUDA kernels over a kvpool Pool: paged decode and prefill attention, KV append, block copy.

The sources are in the repository's ``cuda/`` folder (embedded in the extension), compiled at run
time by NVRTC through CuPy and cached per module (for the decode: dtype, padded head width and
head-tile size class). On a host pool the same functions run the NumPy float64 reference in
:mod:`kvpool.reference`.
"""

from kvpool.kernels._cache_ops import append_kv, copy_blocks
from kvpool.kernels._decode import paged_attention_decode, workspace_elems
from kvpool.kernels._metadata import paged_metadata
from kvpool.kernels._plan import DecodePlan, plan_decode
from kvpool.kernels._prefill import (
    paged_attention_prefill,
    prefill_plan,
    prefill_workspace_elems,
)
from kvpool.kernels._prefill_plan import PrefillPlan
from kvpool.kernels._scales import KvScales

__all__ = [
    "DecodePlan",
    "KvScales",
    "PrefillPlan",
    "append_kv",
    "copy_blocks",
    "paged_attention_decode",
    "paged_attention_prefill",
    "paged_metadata",
    "plan_decode",
    "prefill_plan",
    "prefill_workspace_elems",
    "workspace_elems",
]
