"""kvpool: paged KV-cache memory for LLM inference.

A Rust core owns a slab of host or GPU memory carved into fixed-size KV blocks and hands
them out through a lock-free free list. See README.md for the tour.
"""

from kvpool import exceptions, reference
from kvpool._core import (
    MAX_NUM_BLOCKS,
    AddResult,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockTables,
    CudaStream,
    DeviceArray,
    HostTier,
    KvLayout,
    Pool,
    SlabView,
    cuda_available,
)

# The exceptions, re-exported; their one list is kvpool.exceptions.__all__.
from kvpool.exceptions import *  # noqa: F403
from kvpool.kernels import (
    KvScales,
    append_kv,
    copy_blocks,
    paged_attention_decode,
    paged_attention_prefill,
    paged_metadata,
    prefill_plan,
)
from kvpool.tp import PoolGroup

__all__ = [
    "MAX_NUM_BLOCKS",
    "AddResult",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "BlockTables",
    "CudaStream",
    "DeviceArray",
    "HostTier",
    "KvLayout",
    "KvScales",
    "Pool",
    "PoolGroup",
    "SlabView",
    "append_kv",
    "copy_blocks",
    "cuda_available",
    "paged_attention_decode",
    "paged_attention_prefill",
    "paged_metadata",
    "prefill_plan",
    "reference",
]
__all__ += exceptions.__all__
