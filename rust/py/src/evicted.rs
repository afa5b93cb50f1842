//! `EvictionStage` for Python: the slots that a host pool's evictions hand blocks to on their
//! way out of memory, drained by a disk tier (`kvpool.tier`). Argument checking only; the
//! stage is the core's (`pool/evicted.rs`).

use std::sync::Arc;

use kvpool_core::pool::EvictionStage;
use kvpool_core::{CoreError, Pool};
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{KvResult, PyKvError};
use crate::ids::{self, Int};

/// A pool's eviction stage (`Pool.attach_eviction_stage`): `num_slots` host blocks of
/// `block_bytes` at `base_ptr` (aligned to 4096 bytes). Every cached block that leaves the
/// pool's last in-memory tier is copied into a slot with its hash before its memory is
/// reused; `take` hands staged blocks over with a take id (their bytes stay put until
/// `release` under that id: only the taker can give them back, so another thread cannot free
/// slots whose bytes a disk tier is still writing through NIXL). A full
/// stage overwrites its oldest staged block (counted in `stats()["dropped"]`).
#[pyclass(module = "kvpool._core", name = "EvictionStage", frozen)]
pub struct PyEvictionStage {
    pool: Arc<Pool>,
}

impl PyEvictionStage {
    pub fn new(pool: Arc<Pool>) -> Self {
        debug_assert!(pool.eviction_stage().is_some());
        PyEvictionStage { pool }
    }
    fn stage(&self) -> &EvictionStage {
        self.pool.eviction_stage().expect("made only for a pool with a stage")
    }
    /// Slot numbers from Python: ints in 0..2**32 (the stage itself refuses one that is not
    /// a taken slot, naming it as a slot).
    fn slots(values: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let mut out = ids::BlockIds::new();
        ids::block_ids(values, u32::MAX as usize, &mut out)?;
        Ok(out.to_vec())
    }
}

/// Staged blocks handed over by `EvictionStage.take`: `slots` (int32) and their
/// `block_hashes`, oldest eviction first, and the `take_id` that `release` needs.
#[pyclass(module = "kvpool._core", name = "EvictedBlocks", frozen)]
pub struct PyEvictedBlocks {
    #[pyo3(get)]
    take_id: u64,
    #[pyo3(get)]
    slots: Py<PyArray1<i32>>,
    #[pyo3(get)]
    block_hashes: Vec<Py<PyBytes>>,
}

#[pymethods]
impl PyEvictedBlocks {
    fn __len__(&self) -> usize {
        self.block_hashes.len()
    }
    fn __repr__(&self) -> String {
        format!("EvictedBlocks({} blocks)", self.block_hashes.len())
    }
}

#[pymethods]
impl PyEvictionStage {
    #[getter]
    fn base_ptr(&self) -> u64 {
        self.stage().base_ptr()
    }
    #[getter]
    fn num_slots(&self) -> usize {
        self.stage().num_slots()
    }
    #[getter]
    fn block_bytes(&self) -> usize {
        self.stage().block_bytes()
    }

    /// Hands over up to `max_blocks` (all, by default) staged blocks, oldest first, under a
    /// new take id. Their slots are the caller's until `release(take_id, slots)`: no
    /// eviction writes them meanwhile, and no other take id releases them.
    #[pyo3(signature = (max_blocks = None))]
    fn take(&self, py: Python<'_>, max_blocks: Option<Int>) -> PyResult<PyEvictedBlocks> {
        let max = match max_blocks {
            Some(n) => ids::count(n, "max_blocks").map_err(PyKvError)?,
            None => usize::MAX,
        };
        let (take_id, taken) = self.stage().take(max);
        let slots: Vec<i32> = taken.iter().map(|&(slot, _)| slot as i32).collect();
        let block_hashes = taken.iter().map(|(_, h)| PyBytes::new(py, &h.0).unbind()).collect();
        Ok(PyEvictedBlocks { take_id, slots: PyArray1::from_vec(py, slots).unbind(), block_hashes })
    }

    /// Gives slots taken under `take_id` (`EvictedBlocks.take_id`) back to the stage. A slot
    /// not taken, taken under another id, named twice, or being read by a `checksums` call on
    /// another thread is `InvalidArgumentError` and nothing is released.
    fn release(&self, take_id: Int, slots: &Bound<'_, PyAny>) -> PyResult<()> {
        let take_id = ids::count(take_id, "take_id").map_err(PyKvError)? as u64;
        let slots = Self::slots(slots)?;
        self.stage().release(take_id, &slots).map_err(|e| PyKvError(e).into())
    }

    /// The CRC-32C of each taken slot's bytes (uint32), computed with the GIL released; the
    /// stage refuses to release those slots until it returns.
    fn checksums<'py>(
        &self,
        py: Python<'py>,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let slots = Self::slots(slots)?;
        let sums = py.detach(|| self.stage().checksums(&slots)).map_err(PyKvError)?;
        Ok(PyArray1::from_vec(py, sums))
    }

    /// Counters: `num_slots`, `num_filled` (staged, not taken), `num_taken`, `captured`,
    /// `dropped` (overwritten before taken, or no slot), `taken`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.stage().stats();
        let d = PyDict::new(py);
        d.set_item("num_slots", s.num_slots)?;
        d.set_item("num_filled", s.num_filled)?;
        d.set_item("num_taken", s.num_taken)?;
        d.set_item("captured", s.captured)?;
        d.set_item("dropped", s.dropped)?;
        d.set_item("taken", s.taken)?;
        Ok(d)
    }

    /// Raises `KvError` unless `free + filled + taken == num_slots`, each slot listed once.
    fn check_invariants(&self) -> PyResult<()> {
        self.stage()
            .check_invariants()
            .map_err(|m| crate::errors::KvError::new_err(format!("invariant violated: {m}")))
    }

    fn __repr__(&self) -> String {
        let s = self.stage().stats();
        format!(
            "EvictionStage(num_slots={}, filled={}, taken={}, dropped={})",
            s.num_slots, s.num_filled, s.num_taken, s.dropped
        )
    }
}

/// `Pool.attach_eviction_stage`: attaches and returns the stage.
pub fn attach(pool: &Arc<Pool>, num_slots: Int) -> KvResult<PyEvictionStage> {
    let num_slots = ids::count(num_slots, "num_slots")?;
    pool.attach_eviction_stage(num_slots)?;
    Ok(PyEvictionStage::new(pool.clone()))
}

/// `Pool.eviction_stage`: the stage, if attached.
pub fn get(pool: &Arc<Pool>) -> Option<PyEvictionStage> {
    pool.eviction_stage().map(|_| PyEvictionStage::new(pool.clone()))
}

/// `Pool.block_checksums`: CRC-32C per block, with the GIL released.
pub fn block_checksums<'py>(
    py: Python<'py>,
    pool: &Pool,
    block_ids: &Bound<'_, PyAny>,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let mut ids = ids::BlockIds::new();
    ids::block_ids(block_ids, pool.num_blocks(), &mut ids)?;
    // SAFETY: the Python method's documented contract (`Pool.block_checksums`): the caller
    // keeps the blocks unchanged until it returns, as for every call that reads block bytes
    // (`DiskTier.put`, the copies); the core cannot check who writes a block's bytes.
    let sums = py.detach(|| unsafe { pool.block_checksums(&ids) }).map_err(PyKvError)?;
    Ok(PyArray1::from_vec(py, sums))
}

/// `Pool.append_kv_event`: appends a disk-tier event to the pool's queue; its seq.
pub fn append_event(pool: &Pool, event: &Bound<'_, PyAny>) -> PyResult<u64> {
    let event = crate::prefix::external_event(event)?;
    let cache = pool.prefix_cache().ok_or_else(|| {
        PyKvError(CoreError::InvalidArgument(
            "KV events need a pool made with enable_prefix_caching=True".into(),
        ))
    })?;
    if pool.layout().is_err() {
        // A hybrid pool's cache holds one internal tag a page, and its events name chunks
        // per group (HybridTables): a disk block of group 0 would be a block no router can
        // place, and the snapshot that lists disk blocks is refused for such a pool.
        return Err(PyKvError(CoreError::InvalidArgument(
            "a pool of hybrid pages takes no disk-tier events: the disk tier holds uniform \
             pools' blocks, and its cache names pages by internal tags (HybridTables' events)"
                .into(),
        ))
        .into());
    }
    cache.record_external_event(event).map_err(|e| PyKvError(e).into())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEvictionStage>()?;
    m.add_class::<PyEvictedBlocks>()?;
    Ok(())
}
