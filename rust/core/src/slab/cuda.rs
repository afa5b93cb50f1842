//! CUDA device slab: one zeroed `cuMemAlloc` in the device's primary context, plus the
//! pool's own non-blocking stream (block-table uploads and the kernels that read them are
//! ordered on it).

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::{Device, MemoryInfo, Slab};
use crate::cuda::{self, DeviceBuffer, Stream};
use crate::error::CoreError;

pub fn memory_info(ordinal: usize) -> Result<MemoryInfo, CoreError> {
    let _ctx = cuda::primary_context(ordinal)?;
    let (free_bytes, total_bytes) =
        cudarc::driver::result::mem_get_info().map_err(|e| cuda::driver_error("cuMemGetInfo", e))?;
    Ok(MemoryInfo { free_bytes, total_bytes })
}

pub struct CudaSlab {
    memory: DeviceBuffer,
    stream: Stream,
}

impl CudaSlab {
    pub fn new(ordinal: usize, len_bytes: usize) -> Result<Self, CoreError> {
        let ctx = cuda::primary_context(ordinal)?;
        let memory = DeviceBuffer::zeroed(&ctx, len_bytes)?;
        let stream = Stream::new(&ctx)?;
        Ok(CudaSlab { memory, stream })
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
    fn cuda(&self) -> Option<(&Arc<CudaContext>, &Stream)> {
        Some((self.memory.context(), &self.stream))
    }
}
