//! Slabs kvpool does not allocate: memory a caller owns (an engine's KV tensor), and none
//! at all (a metadata-only pool: ids, tables, prefix cache and events over memory that
//! lives elsewhere).

use super::{Device, MemoryInfo, Slab};
use crate::error::CoreError;
use crate::layout::BLOCK_ALIGN_BYTES;

/// Memory a caller owns. kvpool never frees it; `owner` (the Python object that owns the
/// buffer, say) is kept alive as long as the slab, and dropped with it.
pub struct ExternalSlab {
    base_ptr: u64,
    len_bytes: usize,
    device: Device,
    _owner: Box<dyn Send + Sync>,
}

impl ExternalSlab {
    /// Wraps `len_bytes` at `base_ptr` on `device`. Refuses a null or unaligned address
    /// (blocks start at `BLOCK_ALIGN_BYTES` boundaries) with `InvalidArgument`.
    pub fn new(
        base_ptr: u64,
        len_bytes: usize,
        device: Device,
        owner: Box<dyn Send + Sync>,
    ) -> Result<Self, CoreError> {
        if base_ptr == 0 {
            return Err(CoreError::InvalidArgument("an external buffer's address is null".into()));
        }
        if base_ptr % BLOCK_ALIGN_BYTES as u64 != 0 {
            return Err(CoreError::InvalidArgument(format!(
                "an external buffer must start at a {BLOCK_ALIGN_BYTES}-byte boundary, got address {base_ptr:#x} ({} past one)",
                base_ptr % BLOCK_ALIGN_BYTES as u64
            )));
        }
        Ok(ExternalSlab { base_ptr, len_bytes, device, _owner: owner })
    }
}

impl Slab for ExternalSlab {
    fn base_ptr(&self) -> u64 {
        self.base_ptr
    }
    fn len_bytes(&self) -> usize {
        self.len_bytes
    }
    fn device(&self) -> Device {
        self.device
    }
    fn memory_info(&self) -> Result<Option<MemoryInfo>, CoreError> {
        super::device_memory_info(self.device)
    }
}

/// No memory: the slab of a metadata-only pool. Its address is 0 and it holds no bytes;
/// the pool refuses every call that would reach block memory.
pub struct NoSlab;

impl Slab for NoSlab {
    fn base_ptr(&self) -> u64 {
        0
    }
    fn len_bytes(&self) -> usize {
        0
    }
    fn device(&self) -> Device {
        Device::Host
    }
    fn memory_info(&self) -> Result<Option<MemoryInfo>, CoreError> {
        Ok(None)
    }
    fn has_memory(&self) -> bool {
        false
    }
}
