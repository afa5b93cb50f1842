"""kvpool: paged KV-cache memory for LLM inference.

A Rust core owns a slab of host or GPU memory carved into fixed-size KV blocks and hands
them out through a lock-free free list. See README.md for the tour.
"""

from kvpool._core import (
    MAX_NUM_BLOCKS,
    BlockTables,
    CapacityError,
    CudaError,
    CudaStream,
    CudaUnavailableError,
    DeviceArray,
    DoubleFreeError,
    DuplicateRequestError,
    HostTier,
    HostTierFullError,
    InvalidArgumentError,
    InvalidBlockError,
    KvError,
    KvLayout,
    KvSystemError,
    LayoutError,
    OutOfBlocksError,
    OutOfMemoryError,
    Pool,
    SlabView,
    TransferError,
    UnknownRequestError,
    WrongTierError,
    cuda_available,
)
from kvpool import reference
from kvpool.kernels import (
    append_kv,
    copy_blocks,
    paged_attention_decode,
    paged_attention_prefill,
    prefill_plan,
)
from kvpool.tp import PoolGroup

__all__ = [
    "MAX_NUM_BLOCKS",
    "BlockTables",
    "CapacityError",
    "CudaError",
    "CudaStream",
    "CudaUnavailableError",
    "DeviceArray",
    "DoubleFreeError",
    "DuplicateRequestError",
    "HostTier",
    "HostTierFullError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "KvError",
    "KvLayout",
    "KvSystemError",
    "LayoutError",
    "OutOfBlocksError",
    "OutOfMemoryError",
    "Pool",
    "PoolGroup",
    "SlabView",
    "TransferError",
    "UnknownRequestError",
    "WrongTierError",
    "append_kv",
    "copy_blocks",
    "cuda_available",
    "paged_attention_decode",
    "paged_attention_prefill",
    "prefill_plan",
    "reference",
]
