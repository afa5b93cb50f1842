"""CUDA kernels over a kvpool Pool: paged decode and prefill attention, KV append, block copy.

Attention follows plan once, run per layer: ``decode_plan(...)`` / ``prefill_plan(...)`` make a
:class:`DecodePlan` / :class:`PrefillPlan` for one step's batch (split plan, work items,
workspace, merge counters), and ``plan.run(q, layer)`` launches it for each layer;
``paged_attention_decode`` / ``paged_attention_prefill`` do both in one call (or take
``plan=``). head_dim 512 with K = V (Gemma 4's global layers) has plans of its own,
``shared_kv_decode_plan`` / ``shared_kv_extend_plan`` (the MLA kernel without its rope part);
MLA has ``mla_decode_plan`` / ``mla_extend_plan`` over a 16-bit or an fp8 (e4m3, ``MlaScales``)
latent group, whose rows ``mla_append_latent`` writes. Inputs and results are torch tensors of their true dtypes or CuPy arrays; torch is
optional.

The sources are in the repository's ``cuda/`` folder (embedded in the extension), compiled at run
time by NVRTC through CuPy and cached per module (for the decode: dtype, padded head width and
head-tile size class). On a host pool the same functions run the NumPy float64 reference in
:mod:`kvpool.reference`. Knobs for tests and benchmark sweeps are in
:mod:`kvpool.kernels._tuning`.
"""

from kvpool.kernels._cache_ops import append_kv, copy_blocks
from kvpool.kernels._decode import DecodePlan, decode_plan, paged_attention_decode
from kvpool.kernels._decode_split import MAX_DECODE_SPLITS, workspace_elems
from kvpool.kernels._metadata import paged_metadata
from kvpool.kernels._mla import (
    MlaDecodePlan,
    MlaExtendPlan,
    mla_decode_plan,
    mla_extend_plan,
    mla_page_tables,
    paged_mla_decode,
)
from kvpool.kernels._mla_append import mla_append_latent
from kvpool.kernels._mla_scales import MlaScales
from kvpool.kernels._prefill import (
    PrefillPlan,
    paged_attention_prefill,
    prefill_plan,
    prefill_workspace_elems,
)
from kvpool.kernels._scales import KvScales
from kvpool.kernels._shared_kv import (
    SharedKvDecodePlan,
    SharedKvExtendPlan,
    shared_kv_decode_plan,
    shared_kv_extend_plan,
)

__all__ = [
    "MAX_DECODE_SPLITS",
    "DecodePlan",
    "KvScales",
    "MlaDecodePlan",
    "MlaExtendPlan",
    "MlaScales",
    "PrefillPlan",
    "SharedKvDecodePlan",
    "SharedKvExtendPlan",
    "append_kv",
    "copy_blocks",
    "decode_plan",
    "mla_append_latent",
    "mla_decode_plan",
    "mla_extend_plan",
    "mla_page_tables",
    "paged_attention_decode",
    "paged_attention_prefill",
    "paged_metadata",
    "paged_mla_decode",
    "prefill_plan",
    "prefill_workspace_elems",
    "shared_kv_decode_plan",
    "shared_kv_extend_plan",
    "workspace_elems",
]
