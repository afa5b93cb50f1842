//! The copy engines of a host tier: how the runs of a plan move.
//!
//! - Host (a host pool's tier, what CI runs): `memcpy` per run, complete when the call returns.
//! - CUDA (`cuda.rs`): asynchronous copies on the tier's own copy stream, ordered after the
//!   compute stream's work, with an event saying when they are done.

use super::plan::Run;
use crate::error::CoreError;

#[cfg(feature = "cuda")]
pub use super::cuda::CudaEngine;

/// Where a swap's copies stand: complete already (host), or when an event fires (CUDA).
pub struct Done {
    #[cfg(feature = "cuda")]
    event: Option<crate::driver::Event>,
}

impl Done {
    pub fn complete() -> Self {
        Done {
            #[cfg(feature = "cuda")]
            event: None,
        }
    }
    #[cfg(feature = "cuda")]
    pub fn after(event: crate::driver::Event) -> Self {
        Done { event: Some(event) }
    }
    /// Whether the copies have finished (never blocks).
    pub fn is_complete(&self) -> Result<bool, CoreError> {
        #[cfg(feature = "cuda")]
        if let Some(event) = &self.event {
            return event.query();
        }
        Ok(true)
    }
    /// Blocks until the copies have finished.
    pub fn wait(&self) -> Result<(), CoreError> {
        #[cfg(feature = "cuda")]
        if let Some(event) = &self.event {
            return event.wait();
        }
        Ok(())
    }
}

/// The two pools' geometry for one direction of a swap.
#[derive(Debug, Clone, Copy)]
pub struct Endpoints {
    pub src_base: u64,
    pub dst_base: u64,
    pub block_bytes: usize,
}

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
