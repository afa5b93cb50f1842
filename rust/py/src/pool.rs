//! `Pool` for Python: argument checking, GIL release and NumPy conversion around the core
//! pool. No allocator logic lives here.

use std::sync::Arc;

use kvpool_core::layout::{KvLayout, KvPart};
use kvpool_core::pool::{PoolGeometry, PoolSize};
use kvpool_core::{CoreError, Device, GrowableSize, Pool};
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{KvResult, PyKvError};
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

impl PyPool {
    /// The `medium` KV events give the pool's own memory. A metadata-only pool stands for
    /// an engine's GPU cache: "GPU".
    pub(crate) fn medium(&self) -> &'static str {
        if self.inner.device() == Device::Host && self.inner.has_memory() {
            "CPU"
        } else {
            "GPU"
        }
    }
}

/// `device="none"`: a metadata-only pool, sized by `num_blocks` alone.
fn metadata_only_pool(
    layout: KvLayout,
    num_blocks: Option<Int>,
    other_size_given: bool,
) -> Result<Pool, CoreError> {
    match num_blocks {
        Some(n) if !other_size_given => {
            Pool::new_metadata_only(layout, block_count(n, "num_blocks")?)
        }
        _ => Err(CoreError::InvalidArgument(
            "a metadata-only pool (device=\"none\") is sized by num_blocks alone: no memory_bytes, gpu_memory_utilization or growable".into(),
        )),
    }
}

/// The constructor's prefix-caching keywords, checked.
pub struct PrefixOptions {
    pub enabled: bool,
    pub host_blocks: Option<usize>,
    pub hash_key: Option<[u8; 32]>,
}

impl PrefixOptions {
    pub fn new(
        enabled: bool,
        host_blocks: Option<Int>,
        hash_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let hash_key = crate::prefix::hash_key(hash_key)?;
        let host_blocks = host_blocks
            .map(|n| block_count(n, "prefix_cache_host_blocks"))
            .transpose()
            .map_err(PyKvError)?;
        for (given, name) in [
            (host_blocks.is_some(), "prefix_cache_host_blocks"),
            (hash_key.is_some(), "prefix_hash_key"),
        ] {
            if given && !enabled {
                return Err(PyKvError(CoreError::InvalidArgument(format!(
                    "{name} needs enable_prefix_caching=True"
                )))
                .into());
            }
        }
        Ok(PrefixOptions { enabled, host_blocks, hash_key })
    }

    /// Turns on what they ask for on a new pool (the host tier's slab is allocated with the
    /// GIL released).
    pub fn apply(&self, py: Python<'_>, mut pool: Pool) -> Result<Pool, CoreError> {
        if self.enabled {
            pool = pool.with_prefix_caching_key(self.hash_key)?;
        }
        if let Some(n) = self.host_blocks {
            pool = py.detach(|| pool.with_prefix_host_tier(n))?;
        }
        Ok(pool)
    }
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
        prefix_hash_key = None,
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
        prefix_hash_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let prefix =
            PrefixOptions::new(enable_prefix_caching, prefix_cache_host_blocks, prefix_hash_key)?;
        if device.trim().eq_ignore_ascii_case("none") {
            let pool = metadata_only_pool(
                layout.inner,
                num_blocks,
                memory_bytes.is_some() || gpu_memory_utilization.is_some() || growable,
            )
            .map_err(PyKvError)?;
            let pool = prefix.apply(py, pool).map_err(PyKvError)?;
            return Ok(PyPool { inner: Arc::new(pool) });
        }
        let device = Device::parse(device).map_err(PyKvError)?;
        let create = pool_maker(
            layout.inner.into(),
            (num_blocks, memory_bytes, gpu_memory_utilization),
            growable,
            (max_num_blocks, initial_num_blocks, chunk_bytes),
            device,
        )
        .map_err(PyKvError)?;
        // Allocating and zeroing a large slab takes time: let other threads run.
        let pool = py.detach(create).map_err(PyKvError)?;
        let pool = prefix.apply(py, pool).map_err(PyKvError)?;
        Ok(PyPool { inner: Arc::new(pool) })
    }

    /// A pool of `spec`'s pages (`block_bytes == spec.page_bytes`) for `HybridTables`,
    /// sized and placed as the constructor's keywords say. It has no `KvLayout`: `layout`,
    /// `k_view` and `v_view` raise `LayoutError`; `spec` says where a group's bytes are.
    /// `enable_prefix_caching`, `prefix_cache_host_blocks` and `prefix_hash_key` as for the
    /// constructor: the tables over it then cache prefixes in 16-token chunks
    /// (`HybridTables.add_request`), and with a host tier of that many pages the cached pages
    /// they evict spill there, per group, and a hit brings them back.
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
        enable_prefix_caching = false,
        prefix_cache_host_blocks = None,
        prefix_hash_key = None,
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
        enable_prefix_caching: bool,
        prefix_cache_host_blocks: Option<Int>,
        prefix_hash_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let prefix =
            PrefixOptions::new(enable_prefix_caching, prefix_cache_host_blocks, prefix_hash_key)?;
        let create = pool_maker(
            (&spec.inner).into(),
            (num_blocks, memory_bytes, gpu_memory_utilization),
            growable,
            (max_num_blocks, initial_num_blocks, chunk_bytes),
            Device::parse(device).map_err(PyKvError)?,
        )
        .map_err(PyKvError)?;
        // Allocating and zeroing a large slab takes time: let other threads run.
        let pool = py.detach(create).map_err(PyKvError)?;
        let pool = prefix.apply(py, pool).map_err(PyKvError)?;
        Ok(PyPool { inner: Arc::new(pool) })
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
    /// The slab's address; a metadata-only pool has none and raises.
    #[getter]
    fn base_ptr(&self) -> KvResult<u64> {
        self.inner.require_memory("base_ptr")?;
        Ok(self.inner.base_ptr())
    }
    /// The address of the prefix cache's host tier slab (`prefix_cache_host_blocks` blocks of
    /// `block_bytes`, host block `i` at `i * block_bytes`, in host memory), or None without
    /// one. For reading what the tier holds; the tier alone writes it.
    #[getter]
    fn prefix_cache_host_base_ptr(&self) -> Option<u64> {
        self.inner.prefix_host_tier_base_ptr()
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

    /// `"host"`, `"cuda:N"`, or `"none"` for a metadata-only pool.
    #[getter]
    fn device(&self) -> String {
        if self.inner.has_memory() {
            self.inner.device().to_string()
        } else {
            "none".into()
        }
    }

    /// A pool over memory the caller owns: `buffer` is any object with
    /// `__cuda_array_interface__` (a CuPy array, a CUDA torch tensor; give `device="cuda:N"`)
    /// or `__array_interface__` / the buffer protocol (a NumPy array; host memory). It must be
    /// C-contiguous, writable and start at a 256-byte boundary; it holds `num_blocks` blocks
    /// of the layout (default: as many as fit). kvpool never frees the memory and keeps
    /// `buffer` alive as long as the pool. Too small, misaligned or read-only buffers raise
    /// `InvalidArgumentError`; an object with none of the interfaces, `TypeError`.
    #[staticmethod]
    #[pyo3(signature = (layout, buffer, *, num_blocks = None, device = None, enable_prefix_caching = false, prefix_hash_key = None))]
    fn from_external(
        py: Python<'_>,
        layout: PyRef<'_, PyKvLayout>,
        buffer: &Bound<'_, PyAny>,
        num_blocks: Option<Int>,
        device: Option<&str>,
        enable_prefix_caching: bool,
        prefix_hash_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let prefix = PrefixOptions::new(enable_prefix_caching, None, prefix_hash_key)?;
        let region = crate::external::region(buffer, device)?;
        let num_blocks =
            num_blocks.map(|n| block_count(n, "num_blocks")).transpose().map_err(PyKvError)?;
        let owner: Box<dyn Send + Sync> = Box::new(region.owner);
        let slab = kvpool_core::slab::ExternalSlab::new(
            region.ptr,
            region.len_bytes,
            region.device,
            owner,
        )
        .map_err(PyKvError)?;
        let pool = Pool::new_external(layout.inner, slab, num_blocks).map_err(PyKvError)?;
        let pool = prefix.apply(py, pool).map_err(PyKvError)?;
        Ok(PyPool { inner: Arc::new(pool) })
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

    /// How many tokens of this prompt `BlockTables.add_request` would find cached now (a
    /// multiple of block_size, never covering the last token; host-tier blocks count), under
    /// the same `cache_salt`, `lora_id` and `extra_keys`. A pure query: it takes no
    /// reference, leaves the eviction order, the stats and the event queue as they were.
    /// 0 on a pool without prefix caching.
    #[pyo3(signature = (token_ids, *, cache_salt = None, lora_id = None, extra_keys = None))]
    fn lookup_prefix(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_id: Option<Int>,
        extra_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let tokens = crate::prefix::token_ids(token_ids)?;
        let salt = crate::prefix::cache_salt(cache_salt)?;
        let extra = crate::prefix::extra_keys(extra_keys)?;
        let lora_id = crate::prefix::lora_id(lora_id)?;
        let key = kvpool_core::tables::PromptKey {
            cache_salt: salt.as_deref(),
            lora_id,
            extra_keys: &extra,
        };
        let found = if tokens.len() >= crate::prefix::DETACH_MIN_TOKENS {
            py.detach(|| self.inner.lookup_prefix(&tokens, &key))
        } else {
            self.inner.lookup_prefix(&tokens, &key)
        };
        // A pool of hybrid pages finds nothing here (0 blocks), whatever its page holds.
        Ok(found.num_blocks() * self.inner.layout().map_or(0, |layout| layout.block_size()))
    }

    /// Starts (or, with False, stops and clears) queueing KV events for `take_kv_events`.
    /// The queue keeps at most `max_queued_events` (default 10000, at least 1): past it the
    /// oldest event is dropped and the next `take_kv_event_batch` reports how many.
    #[pyo3(signature = (enabled = true, *, max_queued_events = None))]
    fn enable_kv_cache_events(
        &self,
        enabled: bool,
        max_queued_events: Option<Int>,
    ) -> KvResult<()> {
        let cache = self.inner.prefix_cache().ok_or_else(|| {
            CoreError::InvalidArgument(
                "KV events need a pool made with enable_prefix_caching=True".into(),
            )
        })?;
        let capacity = max_queued_events.map(|n| ids::count(n, "max_queued_events")).transpose()?;
        if capacity == Some(0) {
            return Err(
                CoreError::InvalidArgument("max_queued_events must be at least 1".into()).into()
            );
        }
        if let Some(capacity) = capacity {
            cache.set_max_queued_events(capacity);
        }
        cache.set_events_enabled(enabled);
        Ok(())
    }

    /// Every queued KV event (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), oldest
    /// first; the queue is empty afterwards. Each carries its `seq`: a gap in them is where
    /// the bounded queue dropped events (`take_kv_event_batch` counts them).
    fn take_kv_events(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        let Some(cache) = self.inner.prefix_cache() else { return Ok(Vec::new()) };
        crate::prefix::events_to_py(py, cache.drain_event_batch().events, self.medium())
    }

    /// The queued events as one `KvEventBatch`: its number, the events, how many were
    /// dropped since the last drain (`resync_needed`) and the newest seq numbered.
    fn take_kv_event_batch(&self, py: Python<'_>) -> PyResult<crate::prefix::KvEventBatch> {
        let batch = match self.inner.prefix_cache() {
            Some(cache) => cache.drain_event_batch(),
            None => Default::default(),
        };
        crate::prefix::batch_to_py(py, batch, self.medium())
    }

    /// Every block the prefix cache holds, on both tiers (`KvCacheSnapshot`: hashes with
    /// their parents, medium and group), and the `seq` of the newest event it reflects.
    /// Raises `InvalidArgumentError` on a pool without prefix caching, and on a pool of a
    /// hybrid model's pages: its cache holds one internal tag a page, and only its
    /// `HybridTables` know the chunks and groups (`HybridTables.kv_cache_snapshot()`).
    fn kv_cache_snapshot(&self, py: Python<'_>) -> PyResult<crate::prefix::KvCacheSnapshot> {
        if self.inner.prefix_cache().is_some() && self.inner.layout().is_err() {
            return Err(PyKvError(CoreError::InvalidArgument(
                "a pool of hybrid pages caches one tag a page: \
                 HybridTables.kv_cache_snapshot() lists its chunks per group"
                    .into(),
            ))
            .into());
        }
        let snap = self.inner.prefix_cache_snapshot().ok_or_else(|| {
            PyKvError(CoreError::InvalidArgument(
                "a KV cache snapshot needs a pool made with enable_prefix_caching=True".into(),
            ))
        })?;
        crate::prefix::snapshot_to_py(py, snap, self.medium())
    }

    /// Attaches the pool's eviction stage of `num_slots` host blocks and returns it
    /// (`EvictionStage`): from now on every cached block leaving the pool's last in-memory
    /// tier (its host tier, if it has one, else the pool) is copied there with its hash
    /// before its memory is reused, for a disk tier to take. Once per pool; host pools with
    /// prefix caching only (`InvalidArgumentError`, changing nothing, otherwise).
    fn attach_eviction_stage(&self, num_slots: Int) -> KvResult<crate::evicted::PyEvictionStage> {
        crate::evicted::attach(&self.inner, num_slots)
    }

    /// The eviction stage, or None before `attach_eviction_stage`.
    #[getter]
    fn eviction_stage(&self) -> Option<crate::evicted::PyEvictionStage> {
        crate::evicted::get(&self.inner)
    }

    /// The CRC-32C of each block (uint32 array), computed in Rust with the GIL released.
    /// Host pools only. The blocks are read as they are, allocated or not; the caller keeps
    /// them unchanged until the call returns (no view, kernel, copy or transfer writes them
    /// meanwhile).
    fn block_checksums<'py>(
        &self,
        py: Python<'py>,
        block_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        crate::evicted::block_checksums(py, &self.inner, block_ids)
    }

    /// Appends a disk tier's event (`BlockStored` / `BlockRemoved` of medium "disk") to the
    /// pool's KV event queue, numbered as the pool's own, so a router reads one ordered
    /// stream; the pool also keeps the set of disk-resident blocks these events describe,
    /// which `kv_cache_snapshot` lists (medium "disk"). Returns the event's seq (0 while
    /// events are off). Another type is a TypeError; another medium, a pool without prefix
    /// caching or a pool of hybrid pages, `InvalidArgumentError` (nothing changes).
    fn append_kv_event(&self, event: &Bound<'_, PyAny>) -> PyResult<u64> {
        crate::evicted::append_event(&self.inner, event)
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
