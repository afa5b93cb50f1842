//! CUDA device slab: one zeroed `cuMemAlloc` in the device's primary context.

use super::{Device, MemoryInfo, Slab};
use crate::driver::{self, DeviceBuffer};
use crate::error::CoreError;

pub fn memory_info(ordinal: usize) -> Result<MemoryInfo, CoreError> {
    let _ctx = driver::primary_context(ordinal)?;
    let (free_bytes, total_bytes) = cudarc::driver::result::mem_get_info()
        .map_err(|e| driver::driver_error("cuMemGetInfo", e))?;
    Ok(MemoryInfo { free_bytes, total_bytes })
}

pub struct CudaSlab {
    memory: DeviceBuffer,
}

impl CudaSlab {
    pub fn new(ordinal: usize, len_bytes: usize) -> Result<Self, CoreError> {
        let ctx = driver::primary_context(ordinal)?;
        Ok(CudaSlab { memory: DeviceBuffer::zeroed(&ctx, len_bytes)? })
    }
}

impl Slab for CudaSlab {
    fn base_ptr(&self) -> u64 {
        self.memory.ptr()
    }
    fn len_bytes(&self) -> usize {
        self.memory.len_bytes()
    }
    fn device(&self) -> Device {
        Device::Cuda(self.memory.context().ordinal())
    }
    fn memory_info(&self) -> Result<Option<MemoryInfo>, CoreError> {
        memory_info(self.memory.context().ordinal()).map(Some)
    }
}
