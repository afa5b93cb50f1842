//! CUDA interop objects: the pool's stream (`__cuda_stream__`) and device arrays
//! (`__cuda_array_interface__` v3 with their stream), so CuPy and PyTorch use the same
//! memory and ordering without copies or extra synchronisation.

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

/// A read-only int32 device array owned by a `BlockTables` (its device copy).
#[pyclass(module = "kvpool._core", name = "DeviceArray", frozen)]
pub struct DeviceArray {
    /// The `BlockTables` whose device copy this is (kept alive by the array).
    owner: Py<PyAny>,
    /// The pool whose kernels may read it: the tables' pool, or the mirror it was synced to.
    pool: Py<PyAny>,
    ptr: u64,
    shape: Vec<usize>,
    stream: u64,
}

impl DeviceArray {
    pub fn new(
        owner: Py<PyAny>,
        pool: Py<PyAny>,
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
        self.pool.clone_ref(py)
    }
    /// The `BlockTables` whose device copy this is.
    #[getter]
    fn tables(&self, py: Python<'_>) -> Py<PyAny> {
        self.owner.clone_ref(py)
    }
}
