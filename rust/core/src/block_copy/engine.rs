//! The two engines: `memcpy` per run on the host, the CUDA engine (`cuda.rs`) on a device.

#[cfg(feature = "cuda")]
use super::cuda::CudaEngine;
use super::done::{Done, Endpoints};
use super::plan::Run;
use crate::error::CoreError;

/// How copies move: `memcpy` between two host slabs, or the CUDA engine.
pub enum Engine {
    Host,
    #[cfg(feature = "cuda")]
    Cuda(CudaEngine),
}

impl Engine {
    /// Queues the copies of `runs` (after the work queued so far on `compute_stream`, for CUDA).
    /// On error, whatever was queued has finished by the time it returns, so the caller may
    /// free the destination blocks at once.
    ///
    /// # Safety
    /// Every run lies inside both pools' slabs; the source blocks stay allocated and the
    /// destination blocks reserved for this copy until the returned `Done` completes;
    /// `compute_stream` is a live stream of the engine's context (CUDA).
    pub unsafe fn copy(
        &self,
        runs: &[Run],
        ends: Endpoints,
        compute_stream: u64,
    ) -> Result<Done, CoreError> {
        match self {
            Engine::Host => {
                let _ = compute_stream;
                for run in runs {
                    let bytes = run.num_blocks as usize * ends.block_bytes;
                    let src = ends.src_base as usize + run.src as usize * ends.block_bytes;
                    let dst = ends.dst_base as usize + run.dst as usize * ends.block_bytes;
                    // SAFETY: the caller guarantees both ranges lie in their slabs; the slabs
                    // are two distinct allocations, so the ranges do not overlap.
                    unsafe {
                        std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes)
                    };
                }
                Ok(Done::complete())
            }
            // SAFETY: forwarded; the caller upholds the same contract.
            #[cfg(feature = "cuda")]
            Engine::Cuda(engine) => unsafe { engine.copy(runs, ends, compute_stream) },
        }
    }

    /// A `Done` that completes after every copy queued so far.
    pub fn mark(&self) -> Result<Done, CoreError> {
        match self {
            Engine::Host => Ok(Done::complete()),
            #[cfg(feature = "cuda")]
            Engine::Cuda(engine) => engine.mark(),
        }
    }

    /// Makes `stream` wait (on the device) for `done`: kernels queued on it afterwards see the
    /// copied blocks.
    ///
    /// # Safety
    /// `stream` is a live stream of the engine's context (CUDA).
    pub unsafe fn order_before(&self, done: &Done, stream: u64) -> Result<(), CoreError> {
        let _ = stream;
        #[cfg(feature = "cuda")]
        if let Some(event) = &done.event {
            // SAFETY: the caller guarantees the stream is live in the event's context.
            return unsafe { event.make_wait(stream as cudarc::driver::sys::CUstream) };
        }
        let _ = done;
        Ok(())
    }
}
