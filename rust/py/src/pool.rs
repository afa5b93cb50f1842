//! `Pool` for Python: argument checking, GIL release and NumPy conversion around the core
//! pool. No allocator logic lives here.

use std::sync::Arc;

use kvpool_core::layout::KvPart;
use kvpool_core::pool::{PoolGeometry, PoolSize};
use kvpool_core::{CoreError, Device, GrowableSize, Pool};
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::KvResult;
use crate::ids::{self, Fraction, Int, DETACH_MIN_BLOCKS};
use crate::int_array::NewIdArray;
use crate::layout::PyKvLayout;

/// A pool of fixed-size KV blocks carved from one slab of host or CUDA memory.
///
/// A growable pool (`growable=True`) reserves `max_num_blocks` (at most `MAX_NUM_BLOCKS`)
/// and maps chunks of `chunk_bytes` as it needs them: at least 1, rounded up to the page size
/// (host) or the driver's granularity (CUDA), capped at `max_num_blocks * block_bytes`.
#[pyclass(module = "kvpool._core", name = "Pool", frozen)]
pub struct PyPool {
    pub inner: Arc<Pool>,
}

/// A count of blocks: one past 64 bits is named against `MAX_NUM_BLOCKS`, the limit every
/// block count has (smaller ones the core checks and names alike).
fn block_count(value: Int, what: &str) -> Result<usize, CoreError> {
    if value.too_large().is_some() {
        return Err(CoreError::InvalidArgument(format!(
            "{what} {} is past MAX_NUM_BLOCKS ({}), the most blocks a pool holds",
            value.shown(),
            kvpool_core::MAX_NUM_BLOCKS
        )));
    }
    ids::count(value, what)
}

fn pool_size(
    num_blocks: Option<Int>,
    memory_bytes: Option<Int>,
    gpu_memory_utilization: Option<Fraction>,
) -> Result<PoolSize, CoreError> {
    match (num_blocks, memory_bytes, gpu_memory_utilization) {
        (Some(n), None, None) => Ok(PoolSize::NumBlocks(block_count(n, "num_blocks")?)),
        (None, Some(b), None) => Ok(PoolSize::MemoryBytes(ids::count(b, "memory_bytes")?)),
        (None, None, Some(Fraction(f))) => Ok(PoolSize::DeviceMemoryFraction(f)),
        _ => Err(CoreError::InvalidArgument(
            "give exactly one of num_blocks, memory_bytes, gpu_memory_utilization".into(),
        )),
    }
}

/// The growable pool's sizes, or why the arguments do not describe one.
fn growable_size(
    fixed_size_given: bool,
    max_num_blocks: Option<Int>,
    initial_num_blocks: Option<Int>,
    chunk_bytes: Option<Int>,
) -> Result<GrowableSize, CoreError> {
    if fixed_size_given {
        return Err(CoreError::InvalidArgument(
            "a growable pool is sized by max_num_blocks (and initial_num_blocks), not num_blocks, memory_bytes or gpu_memory_utilization".into(),
        ));
    }
    let max_num_blocks = max_num_blocks
        .ok_or_else(|| CoreError::InvalidArgument("growable=True needs max_num_blocks".into()))?;
    Ok(GrowableSize {
        max_num_blocks: block_count(max_num_blocks, "max_num_blocks")?,
        initial_num_blocks: block_count(
            initial_num_blocks.unwrap_or(Int::new(0)),
            "initial_num_blocks",
        )?,
        chunk_bytes: chunk_bytes.map(|b| ids::count(b, "chunk_bytes")).transpose()?,
    })
}

/// Creates the pool; run with the GIL released (allocating a large slab takes time).
type PoolMaker = Box<dyn FnOnce() -> Result<Pool, CoreError> + Send>;

/// Checks the constructor's arguments and says how to make the pool they describe.
fn pool_maker(
    geometry: PoolGeometry,
    fixed: (Option<Int>, Option<Int>, Option<Fraction>),
    growable: bool,
    grow_args: (Option<Int>, Option<Int>, Option<Int>),
    device: Device,
) -> Result<PoolMaker, CoreError> {
    let (num_blocks, memory_bytes, gpu_memory_utilization) = fixed;
    let (max_num_blocks, initial_num_blocks, chunk_bytes) = grow_args;
    if growable {
        let fixed_given =
            num_blocks.is_some() || memory_bytes.is_some() || gpu_memory_utilization.is_some();
        let size = growable_size(fixed_given, max_num_blocks, initial_num_blocks, chunk_bytes)?;
        return Ok(Box::new(move || Pool::new_growable(geometry, size, device)));
    }
    if max_num_blocks.is_some() || initial_num_blocks.is_some() || chunk_bytes.is_some() {
        return Err(CoreError::InvalidArgument(
            "max_num_blocks, initial_num_blocks and chunk_bytes need growable=True".into(),
        ));
    }
    let size = pool_size(num_blocks, memory_bytes, gpu_memory_utilization)?;
    Ok(Box::new(move || Pool::new(geometry, size, device)))
}

#[pymethods]
impl PyPool {
    #[new]
    #[pyo3(signature = (
        layout,
        num_blocks = None,
        *,
        memory_bytes = None,
        gpu_memory_utilization = None,
        growable = false,
        max_num_blocks = None,
        initial_num_blocks = None,
        chunk_bytes = None,
        device = "auto",
        enable_prefix_caching = false,
        prefix_cache_host_blocks = None,
    ))]
    #[allow(clippy::too_many_arguments)] // one per keyword of the Python signature
    fn new(
        py: Python<'_>,
        layout: PyRef<'_, PyKvLayout>,
        num_blocks: Option<Int>,
        memory_bytes: Option<Int>,
        gpu_memory_utilization: Option<Fraction>,
        growable: bool,
        max_num_blocks: Option<Int>,
        initial_num_blocks: Option<Int>,
        chunk_bytes: Option<Int>,
        device: &str,
        enable_prefix_caching: bool,
        prefix_cache_host_blocks: Option<Int>,
    ) -> KvResult<Self> {
        let device = Device::parse(device)?;
        let host_blocks = prefix_cache_host_blocks
            .map(|n| block_count(n, "prefix_cache_host_blocks"))
            .transpose()?;
        if host_blocks.is_some() && !enable_prefix_caching {
            return Err(CoreError::InvalidArgument(
                "prefix_cache_host_blocks needs enable_prefix_caching=True".into(),
            )
            .into());
        }
        let create = pool_maker(
            layout.inner.into(),
            (num_blocks, memory_bytes, gpu_memory_utilization),
            growable,
            (max_num_blocks, initial_num_blocks, chunk_bytes),
            device,
        )?;
        // Allocating and zeroing a large slab takes time: let other threads run.
        let mut pool = py.detach(create)?;
        if enable_prefix_caching {
            pool = pool.with_prefix_caching()?;
        }
        if let Some(n) = host_blocks {
            pool = py.detach(|| pool.with_prefix_host_tier(n))?;
        }
        Ok(PyPool { inner: Arc::new(pool) })
    }

    /// A pool of `spec`'s pages (`block_bytes == spec.page_bytes`) for `HybridTables`,
    /// sized and placed as the constructor's keywords say. It has no `KvLayout`: `layout`,
    /// `k_view` and `v_view` raise `LayoutError`; `spec` says where a group's bytes are.
    #[staticmethod]
    #[pyo3(signature = (
        spec,
        num_blocks = None,
        *,
        memory_bytes = None,
        gpu_memory_utilization = None,
        growable = false,
        max_num_blocks = None,
        initial_num_blocks = None,
        chunk_bytes = None,
        device = "auto",
    ))]
    #[allow(clippy::too_many_arguments)] // one per keyword of the Python signature
    fn for_spec(
        py: Python<'_>,
        spec: PyRef<'_, crate::hybrid_spec::PyModelKvSpec>,
        num_blocks: Option<Int>,
        memory_bytes: Option<Int>,
        gpu_memory_utilization: Option<Fraction>,
        growable: bool,
        max_num_blocks: Option<Int>,
        initial_num_blocks: Option<Int>,
        chunk_bytes: Option<Int>,
        device: &str,
    ) -> KvResult<Self> {
        let create = pool_maker(
            (&spec.inner).into(),
            (num_blocks, memory_bytes, gpu_memory_utilization),
            growable,
            (max_num_blocks, initial_num_blocks, chunk_bytes),
            Device::parse(device)?,
        )?;
        // Allocating and zeroing a large slab takes time: let other threads run.
        Ok(PyPool { inner: Arc::new(py.detach(create)?) })
    }

    /// Maps memory until at least `num_blocks` blocks exist (growable pools only); returns
    /// the bytes newly mapped. Past `max_num_blocks`, or when the driver refuses memory,
    /// raises `OutOfBlocksError` and changes nothing.
    fn grow(&self, py: Python<'_>, num_blocks: Int) -> KvResult<usize> {
        let num_blocks = ids::count(num_blocks, "num_blocks")?;
        Ok(py.detach(|| self.inner.grow(num_blocks))?)
    }

    /// Releases the chunks at the top of the range whose blocks are all free; returns the
    /// bytes released (0 for a fixed pool). Memory that a live view (`k_view`/`v_view`, or an
    /// array over one) covers is kept: the shrink releases less, and the return value says
    /// how much it did release. Raw pointers (`base_ptr`, `block_ptr`) get no such guarantee.
    fn shrink(&self, py: Python<'_>) -> KvResult<usize> {
        Ok(py.detach(|| self.inner.shrink())?)
    }

    /// Allocates one block (ref count 1) and returns its id.
    fn alloc(&self) -> KvResult<u32> {
        Ok(self.inner.alloc()?)
    }

    /// Allocates `n` blocks, all or none, as an int32 array.
    fn alloc_many<'py>(&self, py: Python<'py>, n: Int) -> PyResult<Bound<'py, PyArray1<i32>>> {
        if let Some(requested) = n.too_large() {
            // More than any count: out of blocks, naming the int the caller passed.
            let pool = &self.inner;
            let max = pool.is_growable().then(|| pool.max_num_blocks());
            return Err(crate::errors::out_of_blocks_beyond_any_count(
                py,
                requested,
                pool.num_free(),
                pool.num_blocks(),
                max,
            ));
        }
        let n = ids::count(n, "n").map_err(crate::errors::PyKvError)?;
        let pool = &self.inner;
        if n > pool.max_num_blocks() {
            // Never met: the core refuses it, naming the counts, before sizing any buffer.
            let ids = pool.alloc_many(n).map_err(crate::errors::PyKvError)?;
            return Ok(NewIdArray::new(py, ids.len())?.fill(&ids));
        }
        // The array first: if NumPy cannot make it, no block has been taken.
        let array = NewIdArray::new(py, n)?;
        if n < DETACH_MIN_BLOCKS {
            let mut ids = [0u32; DETACH_MIN_BLOCKS];
            pool.alloc_into(&mut ids[..n]).map_err(crate::errors::PyKvError)?;
            Ok(array.fill(&ids[..n]))
        } else {
            // A growable pool that must grow maps memory here.
            let ids = py.detach(|| pool.alloc_many(n)).map_err(crate::errors::PyKvError)?;
            Ok(array.fill(&ids))
        }
    }

    /// Drops one reference to a block; it is free again when no reference is left.
    fn free(&self, block_id: &Bound<'_, PyAny>) -> KvResult<()> {
        let id = ids::block_id(block_id, self.inner.num_blocks(), "argument 'block_id'")?;
        Ok(self.inner.free(id)?)
    }

    /// Frees many blocks. Every id is checked first (range, repeats, double free); if any is
    /// bad nothing is freed. An exception the caller's iterable raises propagates as it is.
    fn free_many(&self, py: Python<'_>, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = ids::BlockIds::new();
        ids::block_ids(block_ids, self.inner.num_blocks(), &mut ids)?;
        if ids.len() >= DETACH_MIN_BLOCKS {
            py.detach(|| self.inner.free_many(&ids))
        } else {
            self.inner.free_many(&ids)
        }
        .map_err(|e| crate::errors::PyKvError(e).into())
    }

    /// Current reference count of a block (0: free).
    fn ref_cnt(&self, block_id: &Bound<'_, PyAny>) -> KvResult<u32> {
        let id = ids::block_id(block_id, self.inner.num_blocks(), "argument 'block_id'")?;
        Ok(self.inner.ref_cnt(id)?)
    }

    /// Address of a block: `base_ptr + block_id * block_bytes`.
    fn block_ptr(&self, block_id: &Bound<'_, PyAny>) -> KvResult<u64> {
        let id = ids::block_id(block_id, self.inner.num_blocks(), "argument 'block_id'")?;
        Ok(self.inner.block_ptr(id)?)
    }

    /// Layer `layer`'s K cache, `[num_blocks, block_size, num_kv_heads, head_dim]`: a NumPy
    /// array on the host, an object with `__cuda_array_interface__` on CUDA. The view covers
    /// the blocks that exist now (it does not follow a later growth) and, while it lives,
    /// `shrink` keeps their memory mapped.
    fn k_view(slf: &Bound<'_, Self>, layer: Int) -> PyResult<Py<PyAny>> {
        Self::view(slf, ids::count(layer, "layer").map_err(crate::errors::PyKvError)?, KvPart::K)
    }

    /// Layer `layer`'s V cache; see `k_view`.
    fn v_view(slf: &Bound<'_, Self>, layer: Int) -> PyResult<Py<PyAny>> {
        Self::view(slf, ids::count(layer, "layer").map_err(crate::errors::PyKvError)?, KvPart::V)
    }

    #[getter]
    fn layout(&self) -> PyResult<PyKvLayout> {
        Ok(PyKvLayout { inner: *self.inner.layout().map_err(crate::errors::PyKvError)? })
    }
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    /// The most blocks the pool can hold (`num_blocks` unless growable).
    #[getter]
    fn max_num_blocks(&self) -> usize {
        self.inner.max_num_blocks()
    }
    #[getter]
    fn growable(&self) -> bool {
        self.inner.is_growable()
    }
    #[getter]
    fn num_free(&self) -> usize {
        self.inner.num_free()
    }
    #[getter]
    fn num_used(&self) -> usize {
        self.inner.num_used()
    }
    #[getter]
    fn high_water(&self) -> usize {
        self.inner.high_water()
    }
    #[getter]
    fn block_bytes(&self) -> usize {
        self.inner.block_bytes()
    }
    #[getter]
    fn base_ptr(&self) -> u64 {
        self.inner.base_ptr()
    }
    /// The pool's CUDA stream (`__cuda_stream__`), or None on the host. Table uploads are
    /// queued on it; launch kernels on it to need no other synchronisation.
    #[getter]
    fn stream(slf: &Bound<'_, Self>) -> PyResult<Option<Py<crate::stream::CudaStream>>> {
        match slf.get().inner.stream_handle() {
            None => Ok(None),
            Some(handle) => {
                let owner = slf.clone().into_any().unbind();
                Py::new(slf.py(), crate::stream::CudaStream::new(owner, handle)).map(Some)
            }
        }
    }

    /// `"host"` or `"cuda:N"`.
    #[getter]
    fn device(&self) -> String {
        self.inner.device().to_string()
    }

    /// A plain dict of counters; CUDA pools add the device's free and total bytes.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.inner.stats()).map_err(crate::errors::PyKvError)?;
        // Building the dict can fail only as Python fails (a MemoryError): raise that as it is.
        let d = PyDict::new(py);
        d.set_item("num_blocks", s.num_blocks)?;
        d.set_item("num_free", s.num_free)?;
        d.set_item("num_used", s.num_used)?;
        d.set_item("num_evictable", s.num_evictable)?;
        d.set_item("high_water", s.high_water)?;
        d.set_item("block_bytes", s.block_bytes)?;
        d.set_item("device", s.device.to_string())?;
        d.set_item("growable", s.growable)?;
        d.set_item("max_num_blocks", s.max_num_blocks)?;
        d.set_item("mapped_bytes", s.mapped_bytes)?;
        d.set_item("reserved_bytes", s.reserved_bytes)?;
        d.set_item("num_chunks", s.num_chunks)?;
        d.set_item("chunk_bytes", s.chunk_bytes)?;
        if let Some(m) = s.memory {
            d.set_item("device_free_bytes", m.free_bytes)?;
            d.set_item("device_total_bytes", m.total_bytes)?;
        }
        Ok(d)
    }

    /// Checks every invariant exactly; raises `KvError` naming the first broken
    /// one. Call it while no other thread is using the pool.
    /// With `exact_refs=True`, also that every block's ref count equals the references the
    /// pool's block tables hold (true when nothing but tables holds blocks).
    #[pyo3(signature = (exact_refs = false))]
    fn check_invariants(&self, py: Python<'_>, exact_refs: bool) -> PyResult<()> {
        py.detach(|| self.inner.check_invariants_with(exact_refs))
            .map_err(|m| crate::errors::KvError::new_err(format!("invariant violated: {m}")))
    }

    /// Whether the pool was made with `enable_prefix_caching=True`.
    #[getter]
    fn prefix_caching(&self) -> bool {
        self.inner.prefix_cache().is_some()
    }
    /// Cached blocks nobody references: reused by a hit or evicted when the free list runs
    /// short. `num_free + num_evictable + num_used == num_blocks`.
    #[getter]
    fn num_evictable(&self) -> usize {
        self.inner.num_evictable()
    }

    /// Prefix-cache counters (queries and hits in tokens, as vLLM counts them) and gauges.
    /// A failure to build the dict (a MemoryError) is raised as it is.
    fn prefix_cache_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.prefix_cache_stats().unwrap_or_default();
        crate::prefix::stats_dict(py, &s)
    }

    /// Drops every cached block nobody references back to the free list (after a weight
    /// update) and returns how many. Raises `CacheInUseError`, changing nothing, while any
    /// cached block is referenced.
    fn reset_prefix_cache(&self) -> KvResult<usize> {
        Ok(self.inner.reset_prefix_cache()?)
    }

    /// Starts (or, with False, stops and clears) queueing KV events for `take_kv_events`.
    #[pyo3(signature = (enabled = true))]
    fn enable_kv_cache_events(&self, enabled: bool) -> KvResult<()> {
        let cache = self.inner.prefix_cache().ok_or_else(|| {
            CoreError::InvalidArgument(
                "KV events need a pool made with enable_prefix_caching=True".into(),
            )
        })?;
        cache.set_events_enabled(enabled);
        Ok(())
    }

    /// Every queued KV event (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), oldest
    /// first; the queue is empty afterwards.
    fn take_kv_events(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        let Some(cache) = self.inner.prefix_cache() else { return Ok(Vec::new()) };
        let medium = if self.inner.device() == Device::Host { "CPU" } else { "GPU" };
        crate::prefix::events_to_py(py, cache.drain_events(), medium)
    }

    fn __repr__(&self) -> String {
        format!(
            "Pool(device='{}', num_blocks={}, num_free={}, block_bytes={})",
            self.inner.device(),
            self.inner.num_blocks(),
            self.inner.num_free(),
            self.inner.block_bytes()
        )
    }
}
