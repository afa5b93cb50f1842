"""kvpool: paged KV-cache memory for LLM inference.

A Rust core owns a slab of host or GPU memory carved into fixed-size KV blocks and hands
them out through a lock-free free list. See README.md for the tour.
"""

from kvpool import events, exceptions, reference

# Left out of the top level: the types a user only receives and never constructs or names
# (AddResult from BlockTables.add_request, HybridAddResult from HybridTables.add_request,
# SlabView under the arrays of Pool.k_view / v_view, DeviceArray from BlockTables.sync,
# CudaStream from Pool.stream, EvictionStage from Pool.attach_eviction_stage, EvictedBlocks
# from EvictionStage.take). They stay in
# kvpool._core, typed in _core.pyi. The KV-cache events (BlockStored, BlockRemoved,
# AllBlocksCleared) stay: a consumer of Pool.take_kv_events dispatches on their types, as do
# the batch and snapshot a router reads (KvEventBatch, KvCacheSnapshot, CachedBlock).
from kvpool._core import (
    MAX_NUM_BLOCKS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockTables,
    CachedBlock,
    HostTier,
    HybridHostTier,
    HybridTables,
    KvCacheSnapshot,
    KvEventBatch,
    KvGroup,
    KvLayout,
    ModelKvSpec,
    Pool,
    cuda_available,
)

# The exceptions, re-exported; their one list is kvpool.exceptions.__all__.
from kvpool.exceptions import *  # noqa: F403
from kvpool.kernels import (
    DecodePlan,
    KvScales,
    PrefillPlan,
    append_kv,
    copy_blocks,
    decode_plan,
    paged_attention_decode,
    paged_attention_prefill,
    paged_metadata,
    prefill_plan,
)
from kvpool.tp import PoolGroup


def _installed_version() -> str:
    """The installed distribution's version. maturin writes Cargo.toml's [workspace.package]
    version into the wheel's metadata, so the Python and the Rust halves of a build agree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvpool")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"


__version__ = _installed_version()

__all__ = [
    "MAX_NUM_BLOCKS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "BlockTables",
    "CachedBlock",
    "DecodePlan",
    "HostTier",
    "HybridHostTier",
    "HybridTables",
    "KvCacheSnapshot",
    "KvEventBatch",
    "KvGroup",
    "KvLayout",
    "KvScales",
    "ModelKvSpec",
    "Pool",
    "PoolGroup",
    "PrefillPlan",
    "append_kv",
    "copy_blocks",
    "cuda_available",
    "decode_plan",
    "events",
    "paged_attention_decode",
    "paged_attention_prefill",
    "paged_metadata",
    "prefill_plan",
    "reference",
]
__all__ += exceptions.__all__
