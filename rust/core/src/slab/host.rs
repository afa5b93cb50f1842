//! Host-memory slab: one zeroed allocation aligned to 256 bytes.
//!
//! The memory comes from `alloc_zeroed` with the allocator's natural alignment, over-sized by
//! the alignment and offset to a 256-byte boundary. Asking the allocator for 256-byte
//! alignment directly makes it allocate and then memset every byte; with natural alignment a
//! large request is served by `calloc`, whose fresh pages are zero without being touched, so
//! a 16 GiB slab costs nothing until blocks are written.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use super::{Device, MemoryInfo, Slab};
use crate::error::CoreError;
use crate::layout::BLOCK_ALIGN_BYTES;

pub struct HostSlab {
    /// What the allocator returned (freed with `layout`).
    raw: NonNull<u8>,
    layout: Layout,
    /// First 256-byte boundary at or after `raw`.
    aligned: NonNull<u8>,
    len_bytes: usize,
}

// SAFETY: the slab owns its allocation exclusively and hands out only its address; the bytes
// are written by callers through views, never through `&HostSlab`, so sharing the handle
// between threads shares no Rust-visible mutable state.
unsafe impl Send for HostSlab {}
// SAFETY: as above: `&HostSlab` gives access to nothing but integers.
unsafe impl Sync for HostSlab {}

impl HostSlab {
    pub fn new(len_bytes: usize) -> Result<Self, CoreError> {
        let out_of_memory =
            || CoreError::OutOfMemory { requested_bytes: len_bytes, device: "host".into() };
        let padded = len_bytes.checked_add(BLOCK_ALIGN_BYTES).ok_or_else(out_of_memory)?;
        let layout =
            Layout::from_size_align(padded, std::mem::align_of::<u128>()).map_err(|e| {
                CoreError::InvalidArgument(format!("host slab of {len_bytes} bytes: {e}"))
            })?;
        // SAFETY: `layout` has a non-zero size (at least BLOCK_ALIGN_BYTES).
        let raw = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or_else(out_of_memory)?;
        let offset = raw.as_ptr().align_offset(BLOCK_ALIGN_BYTES);
        debug_assert!(offset < BLOCK_ALIGN_BYTES);
        // SAFETY: `offset < BLOCK_ALIGN_BYTES`, so `raw + offset + len_bytes <= raw + padded`
        // stays inside the allocation.
        let aligned = unsafe { raw.add(offset) };
        Ok(HostSlab { raw, layout, aligned, len_bytes })
    }
}

impl Drop for HostSlab {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `alloc_zeroed(self.layout)` and is freed only here, once.
        unsafe { dealloc(self.raw.as_ptr(), self.layout) }
    }
}

impl Slab for HostSlab {
    fn base_ptr(&self) -> u64 {
        self.aligned.as_ptr() as u64
    }
    fn len_bytes(&self) -> usize {
        self.len_bytes
    }
    fn device(&self) -> Device {
        Device::Host
    }
    fn memory_info(&self) -> Result<Option<MemoryInfo>, CoreError> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_slabs_are_aligned_and_cheap() {
        // 8 GiB: only possible quickly if the pages are not touched.
        let slab = HostSlab::new(8 << 30).unwrap();
        assert_eq!(slab.base_ptr() % BLOCK_ALIGN_BYTES as u64, 0);
        let small = HostSlab::new(1000).unwrap();
        assert_eq!(small.base_ptr() % BLOCK_ALIGN_BYTES as u64, 0);
        assert_eq!(small.len_bytes(), 1000);
    }
}
