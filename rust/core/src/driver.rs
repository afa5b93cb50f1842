//! Thin owning wrappers over the CUDA driver objects the core uses: the primary context,
//! device buffers, pinned host buffers, streams and events. Each frees its object on drop.
//!
//! cudarc panics when it cannot load libcuda, so every entry point goes through
//! [`driver_ready`], which probes once with `is_culib_present` and never panics.

use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys, CudaContext, DriverError};

use crate::error::CoreError;

pub(crate) fn driver_error(what: &str, e: DriverError) -> CoreError {
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

/// The primary context of `ordinal` (the one CuPy's runtime uses), bound to this thread.
pub fn primary_context(ordinal: usize) -> Result<Arc<CudaContext>, CoreError> {
    let count = driver_ready()?;
    if ordinal >= count {
        return Err(CoreError::CudaUnavailable(format!(
            "CUDA device {ordinal} requested, but the driver reports {count} device(s)"
        )));
    }
    let ctx =
        CudaContext::new(ordinal).map_err(|e| driver_error("retaining the primary context", e))?;
    bind(&ctx)?;
    Ok(ctx)
}

/// Makes `ctx` current on the calling thread (driver calls may come from any Python thread).
pub fn bind(ctx: &CudaContext) -> Result<(), CoreError> {
    ctx.bind_to_thread().map_err(|e| driver_error("binding the context", e))
}

/// Refuses a stream that belongs to another context (another device's, say): the driver
/// would otherwise fail, or worse, order our copies on the wrong device.
///
/// # Safety
/// `stream` must be a live stream handle (or 0, the legacy default stream).
pub unsafe fn check_stream_context(
    ctx: &CudaContext,
    stream: sys::CUstream,
) -> Result<(), CoreError> {
    bind(ctx)?;
    let mut owner: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the caller guarantees the handle is live; `owner` is a valid out-pointer.
    unsafe { sys::cuStreamGetCtx(stream, &mut owner) }
        .result()
        .map_err(|e| driver_error("cuStreamGetCtx", e))?;
    if owner != ctx.cu_ctx() {
        return Err(CoreError::InvalidArgument(format!(
            "the stream belongs to another CUDA context than the pool's (device {})",
            ctx.ordinal()
        )));
    }
    Ok(())
}

/// Device memory of one `cuMemAlloc`, zeroed, freed on drop.
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len_bytes: usize,
}

impl DeviceBuffer {
    pub fn zeroed(ctx: &Arc<CudaContext>, len_bytes: usize) -> Result<Self, CoreError> {
        bind(ctx)?;
        // SAFETY: a context is current on this thread; the size is checked non-zero.
        let ptr = unsafe { result::malloc_sync(len_bytes.max(1)) }.map_err(|e| match e.0 {
            sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => CoreError::OutOfMemory {
                requested_bytes: len_bytes,
                device: format!("cuda:{}", ctx.ordinal()),
            },
            _ => driver_error("cuMemAlloc", e),
        })?;
        let buffer = DeviceBuffer { ctx: ctx.clone(), ptr, len_bytes };
        // SAFETY: `ptr` is a live allocation of at least `len_bytes` bytes in this context.
        unsafe { result::memset_d8_sync(ptr, 0, len_bytes) }
            .map_err(|e| driver_error("cuMemsetD8", e))?;
        Ok(buffer)
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Drop may run on any thread; a failure cannot be reported and must not panic.
        if bind(&self.ctx).is_ok() {
            // SAFETY: `ptr` came from `malloc_sync` in this context and is freed only here.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`), the source of asynchronous uploads.
pub struct PinnedBuffer {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len_bytes: usize,
}

// SAFETY: the buffer owns its allocation; access goes through `&mut self` (writes) or
// `&self` (reads), so Rust's borrow rules order every host access.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above; `&PinnedBuffer` allows only reads.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    pub fn zeroed(ctx: &Arc<CudaContext>, len_bytes: usize) -> Result<Self, CoreError> {
        bind(ctx)?;
        // SAFETY: a context is current; flags 0 asks for plain portable-to-this-context pinned memory.
        let raw = unsafe { result::malloc_host(len_bytes.max(1), 0) }
            .map_err(|e| driver_error("cuMemHostAlloc", e))?;
        let ptr = raw as *mut u8;
        // SAFETY: `ptr` is a fresh allocation of at least `len_bytes` bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, len_bytes) };
        Ok(PinnedBuffer { ctx: ctx.clone(), ptr, len_bytes })
    }
    pub fn as_i32_mut(&mut self) -> &mut [i32] {
        // SAFETY: the allocation is `len_bytes` long, page-aligned (so aligned for i32), and
        // `&mut self` makes this the only live reference to it on the host.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut i32, self.len_bytes / 4) }
    }
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: `ptr` came from `malloc_host` and is freed only here; no copy reads it
            // any more (owners synchronize their events before dropping, see tables/upload.rs).
            let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
        }
    }
}

/// A non-blocking stream created by us (so it never syncs with the legacy default stream).
pub struct Stream {
    ctx: Arc<CudaContext>,
    raw: sys::CUstream,
}

// SAFETY: CUDA streams are usable from any thread of the process once their context is bound.
unsafe impl Send for Stream {}
// SAFETY: as above; the handle itself is never mutated.
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, CoreError> {
        bind(ctx)?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| driver_error("cuStreamCreate", e))?;
        Ok(Stream { ctx: ctx.clone(), raw })
    }
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: we created this stream and destroy it once; pending work still completes
            // (cuStreamDestroy does not wait but lets queued work finish).
            let _ = unsafe { result::stream::destroy(self.raw) };
        }
    }
}

/// An event without timing, used to know when an upload's source buffer is free again.
pub struct Event {
    ctx: Arc<CudaContext>,
    raw: sys::CUevent,
    recorded: bool,
}

// SAFETY: events are usable from any thread once the context is bound.
unsafe impl Send for Event {}
// SAFETY: `&Event` exposes nothing that mutates the handle.
unsafe impl Sync for Event {}

impl Event {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, CoreError> {
        bind(ctx)?;
        let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver_error("cuEventCreate", e))?;
        Ok(Event { ctx: ctx.clone(), raw, recorded: false })
    }

    /// # Safety
    /// `stream` must be a live stream of this event's context.
    pub unsafe fn record(&mut self, stream: sys::CUstream) -> Result<(), CoreError> {
        // SAFETY: the event is live; the caller guarantees the stream is.
        unsafe { result::event::record(self.raw, stream) }
            .map_err(|e| driver_error("cuEventRecord", e))?;
        self.recorded = true;
        Ok(())
    }

    /// Makes `stream` wait (on the device, not the CPU) for the work recorded before this event.
    ///
    /// # Safety
    /// `stream` must be a live stream of this event's context.
    pub unsafe fn make_wait(&self, stream: sys::CUstream) -> Result<(), CoreError> {
        if !self.recorded {
            return Ok(());
        }
        // SAFETY: the event is live and recorded; the caller guarantees the stream is live.
        unsafe {
            result::stream::wait_event(
                stream,
                self.raw,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| driver_error("cuStreamWaitEvent", e))
    }

    /// Whether the work recorded before this event has finished (true if never recorded).
    pub fn query(&self) -> Result<bool, CoreError> {
        if !self.recorded {
            return Ok(true);
        }
        bind(&self.ctx)?;
        // SAFETY: the event is live and was recorded.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::cudaError_enum::CUDA_SUCCESS => Ok(true),
            sys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(driver_error("cuEventQuery", DriverError(e))),
        }
    }

    /// Blocks until the work recorded before this event has finished (no-op if never recorded).
    pub fn wait(&self) -> Result<(), CoreError> {
        if !self.recorded {
            return Ok(());
        }
        // SAFETY: the event is live and was recorded.
        unsafe { result::event::synchronize(self.raw) }
            .map_err(|e| driver_error("cuEventSynchronize", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: we created this event and destroy it once.
            let _ = unsafe { result::event::destroy(self.raw) };
        }
    }
}
