//! The CUDA copy engine: the tier's own non-blocking copy stream, so swaps overlap compute.
//!
//! A copy call:
//!   1. records an event on the compute stream and makes the copy stream wait for it, so the
//!      copies come after every kernel queued so far (one that writes a block being swapped
//!      out, or still reads a block just freed and now reallocated for a swap-in);
//!   2. queues the runs: with `cuMemcpyBatchAsync` (one driver call for all runs, CUDA 12.8+
//!      drivers) or one `cuMemcpyAsync` per run;
//!   3. records the returned event on the copy stream.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, DriverError};

use super::done::{Done, Endpoints};
use super::plan::Run;
use crate::driver::{self, driver_error, Event, Stream};
use crate::error::CoreError;

/// How the runs of a plan are queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMethod {
    /// `Batch` when there is more than one run and the driver has it, else `Runs`.
    Auto,
    /// One `cuMemcpyBatchAsync` for all runs (refused on drivers older than 12.8).
    Batch,
    /// One `cuMemcpyAsync` per run.
    Runs,
}

impl CopyMethod {
    pub fn parse(name: &str) -> Result<Self, CoreError> {
        match name {
            "auto" => Ok(CopyMethod::Auto),
            "batch" => Ok(CopyMethod::Batch),
            "runs" => Ok(CopyMethod::Runs),
            _ => Err(CoreError::InvalidArgument(format!(
                "copy_method {name:?} is not one of \"auto\", \"batch\", \"runs\""
            ))),
        }
    }
}

/// The first driver with `cuMemcpyBatchAsync` (its 12.8 signature, which later drivers keep).
const BATCH_DRIVER_VERSION: i32 = 12080;

pub struct CudaEngine {
    ctx: Arc<CudaContext>,
    stream: Stream,
    method: CopyMethod,
    has_batch: bool,
}

impl CudaEngine {
    pub fn new(ctx: &Arc<CudaContext>, method: CopyMethod) -> Result<Self, CoreError> {
        driver::bind(ctx)?;
        let mut version = 0i32;
        // SAFETY: `version` is a valid out-pointer; the driver is initialised (context bound).
        unsafe { sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(|e| driver_error("cuDriverGetVersion", e))?;
        // cudarc panics on a call into a missing symbol: look it up first.
        // SAFETY: the driver library is loaded (a context is bound); looking a symbol up calls
        // nothing.
        let has_symbol =
            unsafe { sys::culib().get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync\0") }.is_ok();
        let has_batch = version >= BATCH_DRIVER_VERSION && has_symbol;
        if method == CopyMethod::Batch && !has_batch {
            return Err(CoreError::InvalidArgument(format!(
                "copy_method \"batch\" needs cuMemcpyBatchAsync (a CUDA 12.8 driver), this driver is {version}"
            )));
        }
        Ok(CudaEngine { ctx: ctx.clone(), stream: Stream::new(ctx)?, method, has_batch })
    }

    pub fn stream(&self) -> u64 {
        self.stream.raw() as u64
    }

    /// See [`Engine::copy`](super::Engine::copy).
    ///
    /// # Safety
    /// As `Engine::copy`.
    pub unsafe fn copy(
        &self,
        runs: &[Run],
        ends: Endpoints,
        compute_stream: u64,
    ) -> Result<Done, CoreError> {
        driver::bind(&self.ctx)?;
        let copy_stream = self.stream.raw();
        let mut after_compute = Event::new(&self.ctx)?;
        // SAFETY: the caller guarantees `compute_stream` is live in this context; ours is.
        unsafe {
            after_compute.record(compute_stream as sys::CUstream)?;
            after_compute.make_wait(copy_stream)?;
        }
        let mut done = Event::new(&self.ctx)?;
        // SAFETY: the caller guarantees every run lies in both slabs and stays reserved.
        let queued = unsafe { self.queue(runs, ends) };
        // SAFETY: our stream is live. Recorded even after a failure: what was queued must be
        // waited for before the caller frees the destination blocks.
        let recorded = unsafe { done.record(copy_stream) };
        if queued.is_err() || recorded.is_err() {
            // SAFETY: our stream is live; waiting for it makes every queued copy finished.
            let _ = unsafe { result::stream::synchronize(copy_stream) };
            queued?;
            recorded?;
        }
        Ok(Done::after(done))
    }

    /// Queues the runs on the copy stream with the configured method.
    ///
    /// # Safety
    /// As `Engine::copy`.
    unsafe fn queue(&self, runs: &[Run], ends: Endpoints) -> Result<(), CoreError> {
        let use_batch = match self.method {
            CopyMethod::Batch => true,
            CopyMethod::Runs => false,
            CopyMethod::Auto => self.has_batch && runs.len() > 1,
        };
        let span = |run: &Run| {
            let bytes = run.num_blocks as usize * ends.block_bytes;
            let src = ends.src_base + run.src as u64 * ends.block_bytes as u64;
            let dst = ends.dst_base + run.dst as u64 * ends.block_bytes as u64;
            (src, dst, bytes)
        };
        if use_batch && !runs.is_empty() {
            let (mut srcs, mut dsts, mut sizes) = (Vec::new(), Vec::new(), Vec::new());
            for run in runs {
                let (src, dst, bytes) = span(run);
                srcs.push(src);
                dsts.push(dst);
                sizes.push(bytes);
            }
            // SAFETY: an all-zero attribute block is valid plain data (location hints only
            // matter for managed memory); we set the one field the driver requires.
            let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
            attrs.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
            let mut attr_index = [0usize];
            let mut fail_index = usize::MAX;
            // SAFETY: the arrays hold `runs.len()` entries each and live across the call (the
            // driver reads them during the call); every (src, dst, size) lies in its slab and
            // under unified addressing the pinned host pointers are valid copy operands.
            unsafe {
                sys::cuMemcpyBatchAsync(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    runs.len(),
                    &mut attrs,
                    attr_index.as_mut_ptr(),
                    1,
                    &mut fail_index,
                    self.stream.raw(),
                )
            }
            .result()
            .map_err(|e: DriverError| {
                driver_error(&format!("cuMemcpyBatchAsync (failed at copy {fail_index})"), e)
            })
        } else {
            for run in runs {
                let (src, dst, bytes) = span(run);
                // SAFETY: as above, for one run.
                unsafe { sys::cuMemcpyAsync(dst, src, bytes, self.stream.raw()) }
                    .result()
                    .map_err(|e| driver_error("cuMemcpyAsync", e))?;
            }
            Ok(())
        }
    }

    /// A `Done` completing after every copy queued so far on the copy stream.
    pub fn mark(&self) -> Result<Done, CoreError> {
        let mut event = Event::new(&self.ctx)?;
        // SAFETY: our stream is live.
        unsafe { event.record(self.stream.raw()) }?;
        Ok(Done::after(event))
    }
}
