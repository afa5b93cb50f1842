//! CUDA device slab through `cudarc`: one `cuMemAlloc` in the device's primary context
//! (the one CuPy's runtime uses too), freed on drop.
//!
//! cudarc panics when it cannot load libcuda, so every entry point goes through
//! [`driver_ready`], which probes once with `is_culib_present` and never panics.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys, CudaContext, DriverError};

use super::{Device, MemoryInfo, Slab};
use crate::error::CoreError;

fn driver_error(what: &str, e: DriverError) -> CoreError {
    CoreError::Cuda(format!("{what}: {e:?}"))
}

/// Loads and initialises the driver once; the device count, or why there is no driver.
fn driver_ready() -> Result<usize, CoreError> {
    static PROBE: OnceLock<Result<usize, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // SAFETY: `is_culib_present` only tries to dlopen the driver library; it has no
            // preconditions and reports failure as `false`.
            if !unsafe { sys::is_culib_present() } {
                return Err("the CUDA driver library (libcuda) was not found".into());
            }
            result::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
            result::device::get_count()
                .map(|n| n as usize)
                .map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))
        })
        .clone()
        .map_err(CoreError::CudaUnavailable)
}

pub fn device_count() -> Result<usize, CoreError> {
    driver_ready()
}

/// The primary context of `ordinal`, bound to the calling thread.
pub fn primary_context(ordinal: usize) -> Result<Arc<CudaContext>, CoreError> {
    let count = driver_ready()?;
    if ordinal >= count {
        return Err(CoreError::CudaUnavailable(format!(
            "CUDA device {ordinal} requested, but the driver reports {count} device(s)"
        )));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| driver_error("retaining the primary context", e))?;
    ctx.bind_to_thread().map_err(|e| driver_error("binding the context", e))?;
    Ok(ctx)
}

pub fn memory_info(ordinal: usize) -> Result<MemoryInfo, CoreError> {
    let _ctx = primary_context(ordinal)?;
    let (free_bytes, total_bytes) = result::mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))?;
    Ok(MemoryInfo { free_bytes, total_bytes })
}

pub struct CudaSlab {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len_bytes: usize,
}

impl CudaSlab {
    /// Allocates `len_bytes` of zeroed device memory on device `ordinal`.
    pub fn new(ordinal: usize, len_bytes: usize) -> Result<Self, CoreError> {
        let ctx = primary_context(ordinal)?;
        // SAFETY: a context is current on this thread (primary_context bound it); the size is
        // positive (pools hold at least one block).
        let ptr = unsafe { result::malloc_sync(len_bytes) }.map_err(|e| match e.0 {
            sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => {
                CoreError::OutOfMemory { requested_bytes: len_bytes, device: format!("cuda:{ordinal}") }
            }
            _ => driver_error("cuMemAlloc", e),
        })?;
        let slab = CudaSlab { ctx, ptr, len_bytes };
        // SAFETY: `ptr` is a live allocation of exactly `len_bytes` bytes in the current context.
        unsafe { result::memset_d8_sync(ptr, 0, len_bytes) }.map_err(|e| driver_error("cuMemsetD8", e))?;
        Ok(slab)
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Drop for CudaSlab {
    fn drop(&mut self) {
        // Drop may run on any thread: make our context current before freeing. A failure here
        // cannot be reported (drop has no caller to tell) and must not panic.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` was allocated by `malloc_sync` in this context and is freed only
            // here, once; nothing of ours uses it after the pool is dropped.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

impl Slab for CudaSlab {
    fn base_ptr(&self) -> u64 {
        self.ptr
    }
    fn len_bytes(&self) -> usize {
        self.len_bytes
    }
    fn device(&self) -> Device {
        Device::Cuda(self.ctx.ordinal())
    }
    fn memory_info(&self) -> Result<Option<MemoryInfo>, CoreError> {
        memory_info(self.ctx.ordinal()).map(Some)
    }
}
