"""CUDA kernels over a kvpool Pool: paged decode attention, KV append, block copy.

The sources are in the repository's ``cuda/`` folder (embedded in the extension), compiled at run
time by NVRTC through CuPy and cached per (dtype, head_dim, block_size, query-head tile). On a host pool the same
functions run the NumPy float64 reference in :mod:`kvpool.reference`.
"""

from kvpool.kernels._cache_ops import append_kv, copy_blocks
from kvpool.kernels._decode import paged_attention_decode, workspace_elems
from kvpool.kernels._plan import DecodePlan, plan_decode

__all__ = [
    "DecodePlan",
    "append_kv",
    "copy_blocks",
    "paged_attention_decode",
    "plan_decode",
    "workspace_elems",
]
