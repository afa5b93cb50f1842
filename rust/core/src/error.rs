//! The one error type of the core. The bindings map each variant to one Python exception.

/// Every way a core call can fail. A call that returns an error has changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    #[error("out of blocks: requested {requested}, but only {free} of {num_blocks} are free")]
    OutOfBlocks { requested: usize, free: usize, num_blocks: usize },

    /// A growable pool could not grow enough: `max_num_blocks` is reached, or the system or
    /// driver refused the memory (`reason` says which). The pool is as it was before the call.
    #[error(
        "out of blocks: requested {requested}, but only {free} of {num_blocks} are free, and the pool cannot grow \
         (max_num_blocks {max_num_blocks}): {reason}"
    )]
    CannotGrow {
        requested: usize,
        free: usize,
        num_blocks: usize,
        max_num_blocks: usize,
        reason: String,
    },

    /// The host tier has too few free blocks for a swap-out; nothing moved.
    #[error("host tier full: a swap-out needs {requested} host blocks, but only {free} of {num_blocks} are free")]
    HostTierFull { requested: usize, free: usize, num_blocks: usize },

    /// A request is not on the tier an operation moves it from (`tier` is where it is).
    #[error("cannot {operation} request {request_id}: it is on the {tier} tier")]
    WrongTier { request_id: u64, tier: &'static str, operation: &'static str },

    #[error("double free: block {block_id} is not allocated (its ref count is already 0)")]
    DoubleFree { block_id: u32 },

    /// `value` is the id as the caller wrote it (it may not fit any integer type).
    #[error("invalid block id {value}: {reason}")]
    InvalidBlock { value: String, reason: String },

    #[error("unknown request id {request_id}")]
    UnknownRequest { request_id: u64 },

    #[error("request id {request_id} is already present")]
    DuplicateRequest { request_id: u64 },

    #[error("capacity exceeded: {what} would be {requested}, the limit is {limit}")]
    CapacityExceeded { what: String, requested: usize, limit: usize },

    #[error("cannot allocate {requested_bytes} bytes on {device}: out of memory")]
    OutOfMemory { requested_bytes: usize, device: String },

    /// The operating system refused a call for another reason than lack of memory (an
    /// `mprotect` or `madvise` of a growable host slab, say). `errno` is the OS error code.
    #[error("{operation} failed: {message} (errno {errno})")]
    System { operation: String, errno: i32, message: String },

    /// A prefix-cache reset found cached blocks still referenced.
    #[error("cannot reset the prefix cache: {in_use} cached blocks are still referenced (free their requests first)")]
    CacheInUse { in_use: usize },

    #[error("invalid layout: {0}")]
    InvalidLayout(String),

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("CUDA is unavailable: {0}")]
    CudaUnavailable(String),

    #[error("CUDA driver error: {0}")]
    Cuda(String),
}

impl CoreError {
    pub fn out_of_range_id(block_id: impl std::fmt::Display, num_blocks: usize) -> Self {
        CoreError::InvalidBlock {
            value: block_id.to_string(),
            reason: format!("out of range, the pool has {num_blocks} blocks (ids 0..{num_blocks})"),
        }
    }
}
