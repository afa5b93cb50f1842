//! Pinned host slab: one `cuMemHostAlloc` in a device's primary context, for a host tier that
//! the device copies to and from asynchronously (DMA needs page-locked memory; a pageable
//! source would make every "async" copy a staged, synchronous one).
//!
//! The memory is host memory (`device()` is `Host`, views are NumPy arrays) and, with unified
//! addressing, the same pointer is valid on the device. Its pages come from the kernel already
//! zeroed, so they are not written again here (zeroing 64 GiB would take seconds).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use super::{Device, MemoryInfo, Slab};
use crate::driver::{self, driver_error};
use crate::error::CoreError;

pub struct PinnedSlab {
    ctx: Arc<CudaContext>,
    ptr: *mut c_void,
    len_bytes: usize,
}

// SAFETY: the slab owns its allocation and hands out only its address; bytes are written
// through views or by the device, never through `&PinnedSlab`.
unsafe impl Send for PinnedSlab {}
// SAFETY: as above: `&PinnedSlab` gives access to nothing but integers.
unsafe impl Sync for PinnedSlab {}

impl PinnedSlab {
    /// Page-locks `len_bytes` of host memory for device `ordinal`. A refusal for lack of
    /// memory is `OutOfMemory` on "pinned host memory", anything else the driver's error.
    pub fn new(ordinal: usize, len_bytes: usize) -> Result<Self, CoreError> {
        let ctx = driver::primary_context(ordinal)?;
        // SAFETY: a context is current on this thread (bound by `primary_context`); flags 0
        // ask for plain pinned memory, mapped into the device's address space under UVA.
        let ptr = unsafe { result::malloc_host(len_bytes.max(1), 0) }.map_err(|e| match e.0 {
            sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => CoreError::OutOfMemory {
                requested_bytes: len_bytes,
                device: "pinned host memory".into(),
            },
            _ => driver_error("cuMemHostAlloc (pinned host memory)", e),
        })?;
        Ok(PinnedSlab { ctx, ptr, len_bytes })
    }
}

impl Drop for PinnedSlab {
    fn drop(&mut self) {
        if driver::bind(&self.ctx).is_ok() {
            // SAFETY: `ptr` came from `malloc_host` and is freed only here. The host tier waits
            // for every copy touching its slab before it drops the pool (`HostTier::drop`).
            let _ = unsafe { result::free_host(self.ptr) };
        }
    }
}

impl Slab for PinnedSlab {
    fn base_ptr(&self) -> u64 {
        self.ptr as u64
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
