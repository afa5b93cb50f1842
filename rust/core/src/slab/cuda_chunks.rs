//! CUDA chunk backend: the driver's virtual memory management.
//!
//! - `cuMemAddressReserve` reserves the whole range once (address space, no memory).
//! - Mapping a chunk: `cuMemCreate` (pinned device memory on our device, one physical
//!   allocation per chunk, so each chunk can be released on its own) and `cuMemMap` at the
//!   chunk's address; then one `cuMemSetAccess` (read/write for our device) over the whole
//!   run of new chunks, which costs one page-table update instead of one per chunk.
//! - Unmapping: the context is synchronised first (a kernel launched before its blocks were
//!   freed may still be reading them; `cuMemUnmap` does not wait), then `cuMemUnmap` and
//!   `cuMemRelease` per chunk, top first.
//! - Drop: everything still mapped is unmapped and released, then `cuMemAddressFree`.
//!
//! New chunks are not zeroed (zeroing 1 GiB would cost as much as the mapping itself): a
//! growable CUDA pool's new blocks hold unspecified bytes until written. The kernels read
//! only the tokens below each sequence's length.

use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, DriverError};

use super::growable::ChunkBackend;
use super::{Device, MemoryInfo};
use crate::driver::{self, driver_error};
use crate::error::CoreError;

pub struct CudaChunks {
    ctx: Arc<CudaContext>,
    base: sys::CUdeviceptr,
    chunk_bytes: usize,
    num_chunks: usize,
    /// `handles[i]` is the physical allocation mapped at chunk `i`; its length is the number
    /// of mapped chunks. Locked only by the slab's (already serialised) resize calls and drop.
    handles: Mutex<Vec<sys::CUmemGenericAllocationHandle>>,
}

fn check(what: &str, code: sys::CUresult) -> Result<(), CoreError> {
    code.result().map_err(|e| driver_error(what, e))
}

/// Out of memory is a refusal (`OutOfMemory`), anything else a driver error.
fn check_alloc(
    what: &str,
    code: sys::CUresult,
    bytes: usize,
    ordinal: usize,
) -> Result<(), CoreError> {
    code.result().map_err(|e: DriverError| match e.0 {
        sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => {
            CoreError::OutOfMemory { requested_bytes: bytes, device: format!("cuda:{ordinal}") }
        }
        _ => driver_error(what, e),
    })
}

fn device_location(ctx: &CudaContext) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ctx.cu_device(),
    }
}

/// Pinned (non-migratable) device memory on the context's device, no exportable handle.
fn allocation_prop(ctx: &CudaContext) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType(0),
        location: device_location(ctx),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The driver's minimum mapping granularity for our allocations (2 MiB on current GPUs).
pub fn granularity(ordinal: usize) -> Result<usize, CoreError> {
    let ctx = driver::primary_context(ordinal)?;
    let prop = allocation_prop(&ctx);
    let mut bytes = 0usize;
    // SAFETY: both pointers are to live locals of the right types; the context is current.
    let code = unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut bytes,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    };
    check("cuMemGetAllocationGranularity", code)?;
    if bytes == 0 {
        return Err(CoreError::Cuda("cuMemGetAllocationGranularity reported 0 bytes".into()));
    }
    Ok(bytes)
}

impl CudaChunks {
    /// Reserves room for `reserved_bytes` on device `ordinal`, in chunks of `chunk_bytes`
    /// rounded up to the granularity.
    pub fn new(
        ordinal: usize,
        reserved_bytes: usize,
        chunk_bytes: usize,
    ) -> Result<Self, CoreError> {
        let ctx = driver::primary_context(ordinal)?;
        let granule = granularity(ordinal)?;
        let chunk_bytes = chunk_bytes.max(1).div_ceil(granule) * granule;
        let num_chunks = reserved_bytes.max(1).div_ceil(chunk_bytes);
        let len = num_chunks.checked_mul(chunk_bytes).ok_or_else(|| {
            CoreError::InvalidArgument(format!("a reservation of {reserved_bytes} bytes overflows"))
        })?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `base` is a live local; alignment 0 and address 0 let the driver choose;
        // flags must be 0. The context is current (primary_context binds it).
        let code = unsafe { sys::cuMemAddressReserve(&mut base, len, 0, 0, 0) };
        check_alloc("cuMemAddressReserve", code, len, ordinal)?;
        Ok(CudaChunks { ctx, base, chunk_bytes, num_chunks, handles: Mutex::new(Vec::new()) })
    }

    fn chunk_ptr(&self, index: usize) -> sys::CUdeviceptr {
        self.base + (index * self.chunk_bytes) as u64
    }

    fn handles(&self) -> std::sync::MutexGuard<'_, Vec<sys::CUmemGenericAllocationHandle>> {
        self.handles.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Creates one physical chunk and maps it at chunk `index`; releases it again on failure.
    fn create_and_map(&self, index: usize) -> Result<sys::CUmemGenericAllocationHandle, CoreError> {
        let prop = allocation_prop(&self.ctx);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` and `prop` are live locals; the size is a multiple of the
        // granularity; flags must be 0. The caller bound the context.
        let code = unsafe { sys::cuMemCreate(&mut handle, self.chunk_bytes, &prop, 0) };
        check_alloc("cuMemCreate", code, self.chunk_bytes, self.ctx.ordinal())?;
        // SAFETY: the chunk's range lies inside our reservation and is unmapped (chunks are
        // mapped as a prefix, this one is past it); `handle` is a fresh allocation of exactly
        // `chunk_bytes`, mapped from offset 0.
        let code = unsafe { sys::cuMemMap(self.chunk_ptr(index), self.chunk_bytes, 0, handle, 0) };
        if let Err(e) = check("cuMemMap", code) {
            // SAFETY: `handle` was created above and is not mapped anywhere.
            let _ = unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        Ok(handle)
    }

    /// Unmaps and releases the top `count` chunks; stops at the first failure. A handle leaves
    /// the vector only once its chunk is unmapped, so the vector always mirrors the mapping.
    fn release_top(
        &self,
        handles: &mut Vec<sys::CUmemGenericAllocationHandle>,
        count: usize,
    ) -> Result<(), CoreError> {
        for _ in 0..count {
            let Some(&handle) = handles.last() else { break };
            let ptr = self.chunk_ptr(handles.len() - 1);
            // SAFETY: chunk `handles.len() - 1` is mapped to `handle` (the vector mirrors the
            // mapping) and holds no allocated block; the context was synchronised, so no
            // kernel still reads it.
            check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, self.chunk_bytes) })?;
            handles.pop();
            // SAFETY: `handle` is no longer mapped; it is released once, here (if this fails,
            // the physical memory leaks, but the address range is free).
            check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })?;
        }
        Ok(())
    }
}

impl ChunkBackend for CudaChunks {
    fn base_ptr(&self) -> u64 {
        self.base
    }
    fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }
    fn num_chunks(&self) -> usize {
        self.num_chunks
    }
    fn device(&self) -> Device {
        Device::Cuda(self.ctx.ordinal())
    }
    fn memory_info(&self) -> Result<Option<MemoryInfo>, CoreError> {
        super::cuda::memory_info(self.ctx.ordinal()).map(Some)
    }

    fn map_chunks(&self, first: usize, count: usize) -> Result<(), CoreError> {
        if count == 0 {
            return Ok(());
        }
        if first + count > self.num_chunks {
            return Err(CoreError::Cuda(format!(
                "chunks {first}..{} lie outside the reservation",
                first + count
            )));
        }
        driver::bind(&self.ctx)?;
        let mut handles = self.handles();
        if handles.len() != first {
            return Err(CoreError::Cuda(format!(
                "asked to map from chunk {first}, but {} chunks are mapped",
                handles.len()
            )));
        }
        let mapped = (first..first + count).try_for_each(|index| {
            handles.push(self.create_and_map(index)?);
            Ok(())
        });
        let access = mapped.and_then(|()| {
            let desc = sys::CUmemAccessDesc {
                location: device_location(&self.ctx),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the range is exactly the chunks mapped above (contiguous, all mapped);
            // `desc` is a live local and the count is 1.
            let code = unsafe {
                sys::cuMemSetAccess(self.chunk_ptr(first), count * self.chunk_bytes, &desc, 1)
            };
            check("cuMemSetAccess", code)
        });
        if let Err(e) = access {
            // Undo this call's chunks. Nothing ran on them, so no synchronisation is needed.
            let created = handles.len() - first;
            let _ = self.release_top(&mut handles, created);
            return Err(e);
        }
        Ok(())
    }

    fn unmap_chunks(&self, first: usize, count: usize) -> Result<(), CoreError> {
        if count == 0 {
            return Ok(());
        }
        driver::bind(&self.ctx)?;
        let mut handles = self.handles();
        if handles.len() != first + count {
            return Err(CoreError::Cuda(format!(
                "asked to unmap chunks {first}..{}, but {} chunks are mapped",
                first + count,
                handles.len()
            )));
        }
        self.ctx.synchronize().map_err(|e| driver_error("cuCtxSynchronize before unmapping", e))?;
        self.release_top(&mut handles, count)
    }

    /// The handles mirror the mapping: after a failed unmap, the chunks not yet unmapped.
    fn mapped_chunks(&self) -> Option<usize> {
        Some(self.handles().len())
    }
}

impl Drop for CudaChunks {
    fn drop(&mut self) {
        // Drop may run on any thread; failures cannot be reported and must not panic.
        if driver::bind(&self.ctx).is_err() {
            return;
        }
        let _ = self.ctx.synchronize();
        let mut handles = std::mem::take(&mut *self.handles());
        let count = handles.len();
        let released = self.release_top(&mut handles, count);
        if released.is_ok() {
            // SAFETY: the range is our reservation, now with nothing mapped in it; freed once.
            let _ = unsafe { sys::cuMemAddressFree(self.base, self.num_chunks * self.chunk_bytes) };
        }
    }
}
