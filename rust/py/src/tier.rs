//! `HostTier` for Python: swaps of whole requests between the device pool and a host pool.

use kvpool_core::pool::PoolSize;
use kvpool_core::tier::{CopyMethod, HostTier, SwapStats, Tier};
use kvpool_core::CoreError;
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{KvResult, PyKvError};
use crate::ids::{self, Int};
use crate::pool::PyPool;
use crate::tables::{request_id, request_ids, PyBlockTables};

/// A host tier for the requests of a `BlockTables`: a pool of host memory (pinned for a CUDA
/// pool) with the same layout, and swaps of whole requests between the tiers.
///
/// Dropping the tier drops the requests it holds, as `free` does: their KV goes with the
/// tier's memory and their ids are free in the tables again. The tier's `pool` is for reading
/// (counts, views): its blocks are taken only by swaps, and its `alloc`/`alloc_many` refuse.
#[pyclass(module = "kvpool._core", name = "HostTier", frozen)]
pub struct PyHostTier {
    inner: HostTier,
    tables: Py<PyBlockTables>,
    pool: Py<PyPool>,
}

fn stats_dict<'py>(py: Python<'py>, s: SwapStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("num_requests", s.num_requests)?;
    d.set_item("num_blocks", s.num_blocks)?;
    d.set_item("num_copies", s.num_copies)?;
    Ok(d)
}

fn stream_arg(stream: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    stream.map(crate::stream::handle_of).transpose()
}

#[pymethods]
impl PyHostTier {
    #[new]
    #[pyo3(signature = (tables, num_blocks = None, *, memory_bytes = None, copy_method = "auto"))]
    fn new(
        py: Python<'_>,
        tables: Bound<'_, PyBlockTables>,
        num_blocks: Option<Int>,
        memory_bytes: Option<Int>,
        copy_method: &str,
    ) -> KvResult<Self> {
        let size = match (num_blocks, memory_bytes) {
            (Some(n), None) => PoolSize::NumBlocks(ids::count(n, "num_blocks")?),
            (None, Some(b)) => PoolSize::MemoryBytes(ids::count(b, "memory_bytes")?),
            _ => {
                return Err(CoreError::InvalidArgument(
                    "give exactly one of num_blocks, memory_bytes".into(),
                )
                .into())
            }
        };
        let method = CopyMethod::parse(copy_method)?;
        let core_tables = tables.get().inner.clone();
        // Pinning host memory takes time: let other threads run.
        let inner = py.detach(|| HostTier::new(core_tables, size, method))?;
        let pool = Py::new(py, PyPool { inner: inner.host_pool().clone() }).map_err(|e| {
            PyKvError(CoreError::InvalidArgument(format!("wrapping the host pool: {e}")))
        })?;
        Ok(PyHostTier { inner, tables: tables.unbind(), pool })
    }

    /// Moves the requests (all in the block tables) to the host tier, all or none; returns
    /// {"num_requests", "num_blocks", "num_copies"}. On CUDA the copies run on the copy stream
    /// after the work queued on `stream` (default: the pool's); the device blocks are reused
    /// only after they finish.
    #[pyo3(signature = (request_ids, stream = None))]
    fn swap_out<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ids = self::request_ids(request_ids)?;
        let stream = stream_arg(stream)?;
        // SAFETY: a caller's stream comes from `__cuda_stream__` of an object held for the call
        // (bare ints are refused), and its context is checked by the core.
        let stats =
            py.detach(|| unsafe { self.inner.swap_out(&ids, stream) }).map_err(PyKvError)?;
        stats_dict(py, stats)
    }

    /// Moves the requests (all swapped out) back into the block tables, all or none. Kernels
    /// queued on `stream` (default: the pool's) after this call see their blocks.
    #[pyo3(signature = (request_ids, stream = None))]
    fn swap_in<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ids = self::request_ids(request_ids)?;
        let stream = stream_arg(stream)?;
        // SAFETY: as in `swap_out`.
        let stats = py.detach(|| unsafe { self.inner.swap_in(&ids, stream) }).map_err(PyKvError)?;
        stats_dict(py, stats)
    }

    /// Drops a swapped-out request (its host blocks return once no copy uses them).
    fn free(&self, request_id: &Bound<'_, PyAny>) -> KvResult<()> {
        Ok(self.inner.free(self::request_id(request_id)?)?)
    }

    /// Releases the blocks of finished copies; returns (device, host) blocks released.
    fn poll(&self) -> KvResult<(usize, usize)> {
        Ok(self.inner.poll()?)
    }

    /// Waits for every queued copy and releases every pending block; (device, host) released.
    fn wait(&self, py: Python<'_>) -> KvResult<(usize, usize)> {
        Ok(py.detach(|| self.inner.wait())?)
    }

    /// "device", "host", or None if neither tier holds the request.
    fn location(&self, request_id: &Bound<'_, PyAny>) -> KvResult<Option<&'static str>> {
        Ok(self.inner.location(self::request_id(request_id)?).map(Tier::name))
    }

    /// Tokens of a swapped-out request.
    fn num_tokens(&self, request_id: &Bound<'_, PyAny>) -> KvResult<usize> {
        Ok(self.inner.swapped(self::request_id(request_id)?)?.0)
    }

    /// Host block ids of a swapped-out request, in logical order (int32).
    fn blocks<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
    ) -> KvResult<Bound<'py, PyArray1<i32>>> {
        let (_, blocks) = self.inner.swapped(self::request_id(request_id)?)?;
        Ok(PyArray1::from_iter(py, blocks.into_iter().map(|b| b as i32)))
    }

    /// Swapped-out request ids, sorted.
    fn request_ids(&self) -> Vec<u64> {
        self.inner.request_ids()
    }

    /// Blocks held back until their copy finishes: (device, host).
    #[getter]
    fn num_pending(&self) -> (usize, usize) {
        self.inner.num_pending()
    }
    /// The host pool, for reading: counts and views (NumPy arrays over the tier's memory).
    /// Its blocks are the tier's: allocating from it raises `InvalidArgumentError`.
    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyPool> {
        self.pool.clone_ref(py)
    }
    #[getter]
    fn tables(&self, py: Python<'_>) -> Py<PyBlockTables> {
        self.tables.clone_ref(py)
    }
    /// The copy stream (`__cuda_stream__`) of a CUDA pool's tier, None on the host.
    #[getter]
    fn copy_stream(slf: &Bound<'_, Self>) -> PyResult<Option<Py<crate::stream::CudaStream>>> {
        match slf.get().inner.copy_stream() {
            None => Ok(None),
            Some(handle) => {
                let owner = slf.clone().into_any().unbind();
                Py::new(slf.py(), crate::stream::CudaStream::new(owner, handle)).map(Some)
            }
        }
    }

    /// The tier's invariants and the host pool's, with exact references.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.check_invariants())
            .map_err(|m| crate::errors::KvError::new_err(format!("invariant violated: {m}")))
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
    fn __contains__(&self, request_id: &Bound<'_, PyAny>) -> bool {
        self::request_id(request_id)
            .map(|r| self.inner.location(r) == Some(Tier::Host))
            .unwrap_or(false)
    }
    fn __repr__(&self) -> String {
        let pool = self.inner.host_pool();
        format!(
            "HostTier(len={}, num_blocks={}, num_free={})",
            self.inner.len(),
            pool.num_blocks(),
            pool.num_free()
        )
    }
}
