//! Host-memory slab: one zeroed allocation aligned to 256 bytes.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use super::{Device, MemoryInfo, Slab};
use crate::error::CoreError;
use crate::layout::BLOCK_ALIGN_BYTES;

pub struct HostSlab {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the slab owns its allocation exclusively and hands out only its address; the bytes
// are written by callers through views, never through `&HostSlab`, so sharing the handle
// between threads shares no Rust-visible mutable state.
unsafe impl Send for HostSlab {}
// SAFETY: as above: `&HostSlab` gives access to nothing but two integers.
unsafe impl Sync for HostSlab {}

impl HostSlab {
    pub fn new(len_bytes: usize) -> Result<Self, CoreError> {
        let layout = Layout::from_size_align(len_bytes.max(1), BLOCK_ALIGN_BYTES)
            .map_err(|e| CoreError::InvalidArgument(format!("host slab of {len_bytes} bytes: {e}")))?;
        // SAFETY: `layout` has a non-zero size (max(1) above).
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)
            .ok_or(CoreError::OutOfMemory { requested_bytes: len_bytes, device: "host".into() })?;
        Ok(HostSlab { ptr, layout })
    }
}

impl Drop for HostSlab {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed(self.layout)` and is freed only here, once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl Slab for HostSlab {
    fn base_ptr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
    fn len_bytes(&self) -> usize {
        self.layout.size()
    }
    fn device(&self) -> Device {
        Device::Host
    }
    fn memory_info(&self) -> Result<Option<MemoryInfo>, CoreError> {
        Ok(None)
    }
}
