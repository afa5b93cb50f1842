//! CUDA interop objects: the pool's stream (`__cuda_stream__`) and device arrays
//! (`__cuda_array_interface__` v3 with their stream), so CuPy and PyTorch use the same
//! memory and ordering without copies or extra synchronisation.

use std::sync::Arc;

use kvpool_core::CoreError;

use crate::errors::PyKvError;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// The raw `cudaStream_t` of an object implementing the CUDA stream protocol
/// (`__cuda_stream__() -> (version, handle)`: CuPy and PyTorch streams, `pool.stream`). Bare
/// ints are refused: nothing could check that they name a live stream. An object without the
/// protocol is a wrong type (TypeError); one whose protocol answers something else, a wrong
/// value (InvalidArgumentError).
pub fn handle_of(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    let Ok(method) = obj.getattr("__cuda_stream__") else {
        return Err(PyTypeError::new_err(format!(
            "stream must implement __cuda_stream__ (a CuPy or PyTorch stream, or pool.stream), got {}",
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        )));
    };
    let (_version, handle): (u64, u64) = method.call0().and_then(|r| r.extract()).map_err(|e| {
        PyKvError(CoreError::InvalidArgument(format!(
            "__cuda_stream__() did not return (version, handle): {e}"
        )))
    })?;
    Ok(handle)
}

/// A CUDA stream owned by a pool, for `cupy.cuda.Stream.from_external(pool.stream)`.
#[pyclass(module = "kvpool._core", name = "CudaStream", frozen)]
pub struct CudaStream {
    /// Keeps the stream's owner (the pool) alive.
    #[allow(dead_code)]
    owner: Py<PyAny>,
    handle: u64,
}

impl CudaStream {
    pub fn new(owner: Py<PyAny>, handle: u64) -> Self {
        CudaStream { owner, handle }
    }
}

#[pymethods]
impl CudaStream {
    /// CUDA stream protocol: `(version, handle)`.
    fn __cuda_stream__(&self) -> (u32, u64) {
        (0, self.handle)
    }
    #[getter]
    fn ptr(&self) -> u64 {
        self.handle
    }
    fn __repr__(&self) -> String {
        format!("CudaStream(0x{:x})", self.handle)
    }
}

/// A read-only int32 device array owned by a `BlockTables` (its device copy), seen through
/// `__cuda_array_interface__` (CuPy, Numba) or DLPack (`torch.from_dlpack`). The memory is the
/// tables' device copy: a later `sync` rewrites it in place (the changed rows), so a consumer
/// must not write it and sees the contents of the latest sync.
#[pyclass(module = "kvpool._core", name = "DeviceArray", frozen)]
pub struct DeviceArray {
    /// The `BlockTables` whose device copy this is (kept alive by the array).
    owner: Py<PyAny>,
    /// The pool whose kernels may read it: the tables' pool, or the mirror it was synced to.
    pool: ArrayPool,
    ptr: u64,
    shape: Vec<usize>,
    stream: u64,
}

/// A device array's pool: the Python object (`DeviceArray.pool`) and the core pool inside
/// it, taken by whoever makes the array, so that this module needs no `pool.rs`.
pub struct ArrayPool {
    pub object: Py<PyAny>,
    pub inner: Arc<kvpool_core::Pool>,
}

impl ArrayPool {
    pub fn clone_ref(&self, py: Python<'_>) -> Self {
        ArrayPool { object: self.object.clone_ref(py), inner: self.inner.clone() }
    }
}

impl DeviceArray {
    pub fn new(
        owner: Py<PyAny>,
        pool: ArrayPool,
        ptr: u64,
        shape: Vec<usize>,
        stream: u64,
    ) -> Self {
        DeviceArray { owner, pool, ptr, shape, stream }
    }
}

#[pymethods]
impl DeviceArray {
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", PyTuple::new(py, &self.shape)?)?;
        d.set_item("typestr", "<i4")?;
        // The interface asks for a null pointer when the array is empty.
        let ptr = if self.shape.contains(&0) { 0 } else { self.ptr };
        d.set_item("data", (ptr, true))?;
        d.set_item("strides", py.None())?;
        d.set_item("version", 3)?;
        // The upload was queued on this stream: a consumer on another stream must wait on it.
        // The interface reserves 0; the null stream is the legacy default stream, 1.
        d.set_item("stream", if self.stream == 0 { 1 } else { self.stream })?;
        Ok(d)
    }
    /// A DLPack capsule over the array (int32, zero-copy, marked read-only in a versioned
    /// capsule). `stream` is the consumer's (DLPack's convention: None or 1 the legacy
    /// default stream, 2 the per-thread default stream, -1 no synchronisation, any other
    /// int a stream handle of the pool's device): it is made to wait, on the device, for the
    /// upload the array came from, so the consumer never reads a half-written table.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        slf: &Bound<'_, Self>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<&Bound<'_, PyAny>>,
        dl_device: Option<&Bound<'_, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let this = slf.get();
        let pool = &this.pool.inner;
        let consumer = match stream.filter(|s| !s.is_none()) {
            None => 1, // DLPack: no stream given means the legacy default stream
            Some(s) => {
                crate::ids::index(s, "argument 'stream'")?.extract::<i64>().map_err(|_| {
                    PyKvError(CoreError::InvalidArgument("stream is not a stream handle".into()))
                })?
            }
        };
        if consumer == 0 || consumer < -1 {
            return Err(PyKvError(CoreError::InvalidArgument(format!(
                "stream {consumer} is no DLPack stream (0 is reserved; -1 asks no synchronisation)"
            )))
            .into());
        }
        let shape: Vec<i64> = this.shape.iter().map(|&n| n as i64).collect();
        let export = crate::dlpack::Export {
            data: if this.shape.contains(&0) { 0 } else { this.ptr },
            device: pool.device(),
            dtype: crate::dlpack::DlType::INT32,
            strides: crate::dlpack::contiguous_strides(&shape),
            shape,
            read_only: true,
        };
        // Refuse what cannot be met before ordering anything on the consumer's stream.
        let capsule = crate::dlpack::to_capsule(
            py,
            slf.clone().into_any().unbind(),
            export,
            max_version,
            dl_device,
            copy,
        )?;
        if consumer != -1 && consumer as u64 != this.stream {
            // SAFETY: DLPack's contract: a consumer passes a live stream of the array's device
            // (or 1 / 2, the driver's legacy and per-thread default streams, valid handles).
            unsafe { wait_for_upload(pool, this.stream, consumer as u64) }.map_err(PyKvError)?;
        }
        Ok(capsule)
    }

    /// `(2, ordinal)`: CUDA memory of the pool's device.
    fn __dlpack_device__(&self) -> PyResult<(i32, i32)> {
        let device = self.pool.inner.device();
        Ok(crate::dlpack::dl_device(device))
    }
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }
    #[getter]
    fn ptr(&self) -> u64 {
        self.ptr
    }
    #[getter]
    fn stream(&self) -> u64 {
        self.stream
    }
    /// The pool whose kernels read this array: the pool of the block tables that produced
    /// it, or the mirror pool it was synced to (kernels check it is theirs).
    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyAny> {
        self.pool.object.clone_ref(py)
    }
    /// The `BlockTables` whose device copy this is.
    #[getter]
    fn tables(&self, py: Python<'_>) -> Py<PyAny> {
        self.owner.clone_ref(py)
    }
}

/// Makes `consumer` wait (on the device) for the work queued so far on `upload`, the stream a
/// sync's copy was queued on.
///
/// # Safety
/// `upload` and `consumer` are live streams of the pool's context (or the driver's special
/// handles 0, 1, 2).
unsafe fn wait_for_upload(
    pool: &kvpool_core::Pool,
    upload: u64,
    consumer: u64,
) -> Result<(), CoreError> {
    let Some(dc) = pool.device_context() else {
        return Err(CoreError::InvalidArgument("the pool is on the host".into()));
    };
    if consumer > 2 {
        // SAFETY: per the contract, a live stream handle.
        unsafe { kvpool_core::driver::check_stream_context(dc.context(), consumer as usize as _) }?;
    }
    let mut event = kvpool_core::driver::Event::new(dc.context())?;
    // SAFETY: per the contract, both streams are live in the event's context. The event may be
    // destroyed (on drop) while the wait is pending: CUDA frees it once the wait is done.
    unsafe {
        event.record(upload as usize as _)?;
        event.make_wait(consumer as usize as _)
    }
}
