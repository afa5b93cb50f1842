"""kvpool: paged KV-cache memory for LLM inference.

A Rust core owns a slab of host or GPU memory carved into fixed-size KV blocks and hands
them out through a lock-free free list. See README.md for the tour.
"""

from kvpool._core import (
    MAX_NUM_BLOCKS,
    AddResult,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockTables,
    CacheInUseError,
    CapacityError,
    CudaError,
    CudaStream,
    CudaUnavailableError,
    DeviceArray,
    DoubleFreeError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidBlockError,
    KvError,
    KvLayout,
    LayoutError,
    OutOfBlocksError,
    OutOfMemoryError,
    Pool,
    SlabView,
    UnknownRequestError,
    cuda_available,
)
from kvpool import reference
from kvpool.kernels import append_kv, copy_blocks, paged_attention_decode

__all__ = [
    "MAX_NUM_BLOCKS",
    "AddResult",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "BlockTables",
    "CacheInUseError",
    "CapacityError",
    "CudaError",
    "CudaStream",
    "CudaUnavailableError",
    "DeviceArray",
    "DoubleFreeError",
    "DuplicateRequestError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "KvError",
    "KvLayout",
    "LayoutError",
    "OutOfBlocksError",
    "OutOfMemoryError",
    "Pool",
    "SlabView",
    "UnknownRequestError",
    "append_kv",
    "copy_blocks",
    "cuda_available",
    "paged_attention_decode",
    "reference",
]
