//! Prefix caching for Python: token ids, salts and keys checked into core types, the
//! `add_request` result, KV event objects (vLLM's field names) and the stats dict.

use kvpool_core::prefix_cache::{
    BlockHash, CacheSnapshot, EventBatch, KvEvent, Medium, PrefixCacheStats, SequencedEvent,
};
use kvpool_core::CoreError;
use numpy::{PyArray1, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

use crate::errors::PyKvError;
use crate::ids::{self, Int};

/// Prompts at least this long are hashed with the GIL released (tens of microseconds).
pub const DETACH_MIN_TOKENS: usize = 1024;

fn invalid(message: String) -> CoreError {
    CoreError::InvalidArgument(message)
}

/// Integers checked into token ids in one pass the compiler vectorises (a 4096-token
/// prompt costs about a microsecond); the first bad one is named.
fn checked_token_ids<T: Copy + Into<i64>>(
    values: impl ExactSizeIterator<Item = T> + Clone,
) -> Result<Vec<u32>, CoreError> {
    let mut out = Vec::with_capacity(values.len());
    let mut all_fit = true;
    out.extend(values.clone().map(|v| {
        let v: i64 = v.into();
        all_fit &= (0..=u32::MAX as i64).contains(&v);
        v as u32
    }));
    if all_fit {
        return Ok(out);
    }
    let bad = values.map(Into::into).find(|v: &i64| u32::try_from(*v).is_err()).unwrap_or_default();
    Err(invalid(format!("token id {bad} is not in 0..2**32")))
}

/// Token ids: a 1-D int32/int64/uint32 NumPy array (fast path: read in place through
/// rust-numpy, checked and narrowed in one pass) or an iterable of ints, each in 0..2**32
/// (`InvalidArgumentError` otherwise). Strings, bytes, bools, floats and arrays of other
/// dtypes are a `TypeError`; an exception the caller's iterable raises propagates as it is.
pub fn token_ids(value: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    // int64 first: NumPy's default integer, and each failed extraction costs an exception.
    if let Ok(a) = value.extract::<PyReadonlyArray1<'_, i64>>() {
        return match a.as_slice() {
            Ok(s) => Ok(checked_token_ids(s.iter().copied()).map_err(PyKvError)?),
            Err(_) => Ok(checked_token_ids(a.as_array().iter().copied()).map_err(PyKvError)?),
        };
    }
    if let Ok(a) = value.extract::<PyReadonlyArray1<'_, i32>>() {
        return match a.as_slice() {
            Ok(s) => Ok(checked_token_ids(s.iter().copied()).map_err(PyKvError)?),
            Err(_) => Ok(checked_token_ids(a.as_array().iter().copied()).map_err(PyKvError)?),
        };
    }
    if let Ok(a) = value.extract::<PyReadonlyArray1<'_, u32>>() {
        return Ok(a.as_array().to_vec());
    }
    const WHAT: &str = "argument 'token_ids'";
    if let Ok(a) = value.cast::<PyUntypedArray>() {
        ids::check_int_array(a, WHAT)?;
        // Any other integer dtype (int8, uint64, big-endian): read element by element below.
    }
    let iter = ids::int_iter(value, WHAT)?;
    let mut out = Vec::new();
    let room = value.len().unwrap_or(0);
    out.try_reserve_exact(room).map_err(|_| {
        PyKvError(CoreError::OutOfMemory {
            requested_bytes: room.saturating_mul(4),
            device: "host".into(),
        })
    })?;
    for (i, item) in iter.enumerate() {
        let int = ids::index(&item?, &format!("{WHAT}: item {i}"))?;
        let v = int.extract::<u32>().map_err(|_| {
            PyKvError(invalid(format!("token id {} is not in 0..2**32", ids::shown(&int))))
        })?;
        out.push(v);
    }
    Ok(out)
}

/// `cache_salt`: None, a str (UTF-8) or bytes.
pub fn cache_salt(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<u8>>> {
    let Some(value) = value.filter(|v| !v.is_none()) else { return Ok(None) };
    if let Ok(s) = value.cast::<PyString>() {
        return Ok(Some(
            s.to_str()
                .map_err(|e| PyKvError(invalid(format!("cache_salt: {e}"))))?
                .as_bytes()
                .to_vec(),
        ));
    }
    if let Ok(b) = value.cast::<PyBytes>() {
        return Ok(Some(b.as_bytes().to_vec()));
    }
    Err(ids::wrong_type("argument 'cache_salt'", "a str, bytes or None", value))
}

/// `extra_keys`: None or bytes.
pub fn extra_keys(value: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<u8>> {
    let Some(value) = value.filter(|v| !v.is_none()) else { return Ok(Vec::new()) };
    match value.cast::<PyBytes>() {
        Ok(b) => Ok(b.as_bytes().to_vec()),
        Err(_) => Err(ids::wrong_type("argument 'extra_keys'", "bytes or None", value)),
    }
}

/// `lora_id`: None or an int in 0..2**64.
pub fn lora_id(value: Option<Int>) -> PyResult<Option<u64>> {
    Ok(value
        .map(|id| ids::count(id, "lora_id").map(|id| id as u64))
        .transpose()
        .map_err(PyKvError)?)
}

/// `prefix_hash_key`: None or exactly 32 bytes.
pub fn hash_key(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<[u8; 32]>> {
    let Some(value) = value.filter(|v| !v.is_none()) else { return Ok(None) };
    let bytes = value
        .cast::<PyBytes>()
        .map_err(|_| ids::wrong_type("argument 'prefix_hash_key'", "bytes or None", value))?;
    let key: [u8; 32] = bytes.as_bytes().try_into().map_err(|_| {
        PyKvError(invalid(format!(
            "prefix_hash_key must be 32 bytes, got {}",
            bytes.as_bytes().len()
        )))
    })?;
    Ok(Some(key))
}

/// What `BlockTables.add_request` found and allocated.
#[pyclass(module = "kvpool._core", name = "AddResult", frozen)]
pub struct AddResult {
    num_cached_tokens: usize,
    slot_mapping: Py<PyArray1<i64>>,
}

impl AddResult {
    pub fn new(py: Python<'_>, r: kvpool_core::tables::AddResult) -> Self {
        AddResult {
            num_cached_tokens: r.num_cached_tokens,
            slot_mapping: PyArray1::from_vec(py, r.slot_mapping).unbind(),
        }
    }
}

#[pymethods]
impl AddResult {
    /// Prompt tokens whose KV is cached already (a multiple of block_size, < len(token_ids)).
    #[getter]
    fn num_cached_tokens(&self) -> usize {
        self.num_cached_tokens
    }
    /// int64 slots of the tokens still to compute: positions num_cached_tokens.. of the prompt.
    #[getter]
    fn slot_mapping(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.slot_mapping.clone_ref(py)
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "AddResult(num_cached_tokens={}, len(slot_mapping)={})",
            self.num_cached_tokens,
            self.slot_mapping.bind(py).len()
        )
    }
}

fn hash_bytes<'py>(py: Python<'py>, hashes: &[BlockHash]) -> Vec<Bound<'py, PyBytes>> {
    hashes.iter().map(|h| PyBytes::new(py, &h.0)).collect()
}

/// A 32-byte hash from Python (`what` names the argument).
fn hash_from_py(value: &[u8], what: &str) -> PyResult<BlockHash> {
    let bytes: [u8; 32] = value.try_into().map_err(|_| {
        PyKvError(invalid(format!("{what}: a block hash is 32 bytes, got {}", value.len())))
    })?;
    Ok(BlockHash(bytes))
}

fn hashes_from_py(values: Vec<Vec<u8>>) -> PyResult<Vec<BlockHash>> {
    values.iter().map(|v| hash_from_py(v, "block_hashes")).collect()
}

/// Consecutive blocks of one request entered the cache (vLLM's `BlockStored`). Constructible
/// and picklable, so events can cross a process boundary as they are.
#[pyclass(module = "kvpool._core", name = "BlockStored", frozen, eq)]
#[derive(PartialEq)]
pub struct BlockStored {
    block_hashes: Vec<BlockHash>,
    parent_block_hash: Option<BlockHash>,
    token_ids: Vec<u32>,
    block_size: usize,
    lora_id: Option<u64>,
    medium: String,
    group: u32,
    seq: u64,
}

#[pymethods]
impl BlockStored {
    #[new]
    #[pyo3(signature = (block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, group = 0, seq = 0))]
    #[allow(clippy::too_many_arguments)] // one per field
    fn new(
        block_hashes: Vec<Vec<u8>>,
        parent_block_hash: Option<Vec<u8>>,
        token_ids: Vec<u32>,
        block_size: usize,
        lora_id: Option<u64>,
        medium: String,
        group: u32,
        seq: u64,
    ) -> PyResult<Self> {
        Ok(BlockStored {
            block_hashes: hashes_from_py(block_hashes)?,
            parent_block_hash: parent_block_hash
                .map(|h| hash_from_py(&h, "parent_block_hash"))
                .transpose()?,
            token_ids,
            block_size,
            lora_id,
            medium,
            group,
            seq,
        })
    }
    /// 32-byte hashes, in the request's order.
    #[getter]
    fn block_hashes<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        hash_bytes(py, &self.block_hashes)
    }
    /// The hash of the block before the first; None at the start of a request.
    #[getter]
    fn parent_block_hash<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.parent_block_hash.map(|h| PyBytes::new(py, &h.0))
    }
    /// The tokens of all the blocks, block_size per block.
    #[getter]
    fn token_ids(&self) -> Vec<u32> {
        self.token_ids.clone()
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }
    #[getter]
    fn lora_id(&self) -> Option<u64> {
        self.lora_id
    }
    /// "GPU" or "CPU": where the blocks live.
    #[getter]
    fn medium(&self) -> &str {
        &self.medium
    }
    /// The KV group of the blocks (0 for a uniform pool).
    #[getter]
    fn group(&self) -> u32 {
        self.group
    }
    /// The event's sequence number in its pool's history (from 1; 0 for one made by hand).
    #[getter]
    fn seq(&self) -> u64 {
        self.seq
    }
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, pyo3::types::PyTuple>)> {
        let py = slf.py();
        let e = slf.get();
        let args = (
            hash_bytes(py, &e.block_hashes),
            e.parent_block_hash.map(|h| PyBytes::new(py, &h.0)),
            e.token_ids.clone(),
            e.block_size,
            e.lora_id,
            e.medium.clone(),
            e.group,
            e.seq,
        )
            .into_pyobject(py)?;
        Ok((slf.get_type().into_any(), args))
    }
    fn __repr__(&self) -> String {
        format!(
            "BlockStored(seq={}, {} blocks, parent={:?}, medium={}, group={})",
            self.seq,
            self.block_hashes.len(),
            self.parent_block_hash,
            self.medium,
            self.group
        )
    }
}

/// Blocks left one tier of the cache: evicted for reuse, or moved to the other tier (vLLM's
/// `BlockRemoved`). Constructible and picklable.
#[pyclass(module = "kvpool._core", name = "BlockRemoved", frozen, eq)]
#[derive(PartialEq)]
pub struct BlockRemoved {
    block_hashes: Vec<BlockHash>,
    medium: String,
    group: u32,
    seq: u64,
}

#[pymethods]
impl BlockRemoved {
    #[new]
    #[pyo3(signature = (block_hashes, medium, group = 0, seq = 0))]
    fn new(block_hashes: Vec<Vec<u8>>, medium: String, group: u32, seq: u64) -> PyResult<Self> {
        Ok(BlockRemoved { block_hashes: hashes_from_py(block_hashes)?, medium, group, seq })
    }
    #[getter]
    fn block_hashes<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        hash_bytes(py, &self.block_hashes)
    }
    #[getter]
    fn medium(&self) -> &str {
        &self.medium
    }
    #[getter]
    fn group(&self) -> u32 {
        self.group
    }
    #[getter]
    fn seq(&self) -> u64 {
        self.seq
    }
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, pyo3::types::PyTuple>)> {
        let py = slf.py();
        let e = slf.get();
        let args = (hash_bytes(py, &e.block_hashes), e.medium.clone(), e.group, e.seq)
            .into_pyobject(py)?;
        Ok((slf.get_type().into_any(), args))
    }
    fn __repr__(&self) -> String {
        format!(
            "BlockRemoved(seq={}, {} blocks, medium={}, group={})",
            self.seq,
            self.block_hashes.len(),
            self.medium,
            self.group
        )
    }
}

/// Every cached block was dropped by a reset (vLLM's `AllBlocksCleared`). Picklable.
#[pyclass(module = "kvpool._core", name = "AllBlocksCleared", frozen, eq)]
#[derive(PartialEq)]
pub struct AllBlocksCleared {
    seq: u64,
}

#[pymethods]
impl AllBlocksCleared {
    #[new]
    #[pyo3(signature = (seq = 0))]
    fn new(seq: u64) -> Self {
        AllBlocksCleared { seq }
    }
    #[getter]
    fn seq(&self) -> u64 {
        self.seq
    }
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> (Bound<'py, PyAny>, (u64,)) {
        (slf.get_type().into_any(), (slf.get().seq,))
    }
    fn __repr__(&self) -> String {
        format!("AllBlocksCleared(seq={})", self.seq)
    }
}

/// The name of a medium: the pool's own memory is `pool_medium` ("GPU" or "CPU"); the host
/// tier is "CPU".
fn medium_name(medium: Medium, pool_medium: &'static str) -> &'static str {
    match medium {
        Medium::Pool => pool_medium,
        Medium::HostTier => "CPU",
        Medium::Disk => DISK_MEDIUM,
    }
}

/// The `medium` of the disk tier's events, the one medium a caller may append
/// (`Pool.append_kv_event`).
pub const DISK_MEDIUM: &str = "disk";

/// A `BlockStored` or `BlockRemoved` of medium "disk" as the core's event; `TypeError` for
/// another type, `InvalidArgumentError` for another medium (the core makes its own tiers'
/// events).
pub fn external_event(value: &Bound<'_, PyAny>) -> PyResult<KvEvent> {
    let medium = |name: &str| -> PyResult<Medium> {
        if name == DISK_MEDIUM {
            Ok(Medium::Disk)
        } else {
            Err(PyKvError(invalid(format!(
                "only events of medium \"{DISK_MEDIUM}\" can be appended, not {name:?}: the \
                 core makes its own tiers' events"
            )))
            .into())
        }
    };
    if let Ok(e) = value.cast::<BlockStored>() {
        let e = e.get();
        return Ok(KvEvent::BlockStored {
            group: e.group,
            block_hashes: e.block_hashes.clone(),
            parent_block_hash: e.parent_block_hash,
            token_ids: e.token_ids.clone(),
            block_size: e.block_size,
            lora_id: e.lora_id,
            medium: medium(&e.medium)?,
        });
    }
    if let Ok(e) = value.cast::<BlockRemoved>() {
        let e = e.get();
        return Ok(KvEvent::BlockRemoved {
            group: e.group,
            block_hashes: e.block_hashes.clone(),
            medium: medium(&e.medium)?,
        });
    }
    Err(crate::ids::wrong_type("argument 'event'", "a BlockStored or BlockRemoved", value))
}

/// Python objects for drained events, in order.
pub fn events_to_py(
    py: Python<'_>,
    events: Vec<SequencedEvent>,
    pool_medium: &'static str,
) -> PyResult<Vec<Py<PyAny>>> {
    let name = |medium| medium_name(medium, pool_medium).to_string();
    events
        .into_iter()
        .map(|SequencedEvent { seq, event }| {
            Ok(match event {
                KvEvent::BlockStored {
                    group,
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                } => Py::new(
                    py,
                    BlockStored {
                        block_hashes,
                        parent_block_hash,
                        token_ids,
                        block_size,
                        lora_id,
                        medium: name(medium),
                        group,
                        seq,
                    },
                )?
                .into_any(),
                KvEvent::BlockRemoved { group, block_hashes, medium } => {
                    Py::new(py, BlockRemoved { block_hashes, medium: name(medium), group, seq })?
                        .into_any()
                }
                KvEvent::AllBlocksCleared => Py::new(py, AllBlocksCleared { seq })?.into_any(),
            })
        })
        .collect()
}

/// What one `Pool.take_kv_event_batch` handed over.
#[pyclass(module = "kvpool._core", name = "KvEventBatch", frozen)]
pub struct KvEventBatch {
    #[pyo3(get)]
    batch_seq: u64,
    #[pyo3(get)]
    events: Py<PyList>,
    /// Events dropped since the last drain because the queue was full.
    #[pyo3(get)]
    dropped: u64,
    /// The seq of the newest event numbered so far (0 before the first).
    #[pyo3(get)]
    last_seq: u64,
}

#[pymethods]
impl KvEventBatch {
    /// True when events were dropped: re-read `Pool.kv_cache_snapshot()` and apply only the
    /// events whose `seq` is greater than the snapshot's.
    #[getter]
    fn resync_needed(&self) -> bool {
        self.dropped > 0
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "KvEventBatch(batch_seq={}, {} events, dropped={}, last_seq={})",
            self.batch_seq,
            self.events.bind(py).len(),
            self.dropped,
            self.last_seq
        )
    }
}

pub fn batch_to_py(
    py: Python<'_>,
    batch: EventBatch,
    pool_medium: &'static str,
) -> PyResult<KvEventBatch> {
    let events = PyList::new(py, events_to_py(py, batch.events, pool_medium)?)?.unbind();
    Ok(KvEventBatch {
        batch_seq: batch.batch_seq,
        events,
        dropped: batch.dropped,
        last_seq: batch.last_seq,
    })
}

/// One cached block in a snapshot.
#[pyclass(module = "kvpool._core", name = "CachedBlock", frozen, eq)]
#[derive(PartialEq)]
pub struct CachedBlock {
    hash: BlockHash,
    parent: Option<BlockHash>,
    medium: &'static str,
    group: u32,
}

#[pymethods]
impl CachedBlock {
    #[getter]
    fn block_hash<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.hash.0)
    }
    /// The block before it in the request that stored it; None for a first block and for
    /// host-tier blocks.
    #[getter]
    fn parent_block_hash<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.parent.map(|h| PyBytes::new(py, &h.0))
    }
    #[getter]
    fn medium(&self) -> &'static str {
        self.medium
    }
    #[getter]
    fn group(&self) -> u32 {
        self.group
    }
    fn __repr__(&self) -> String {
        format!("CachedBlock({:?}, medium={}, group={})", self.hash, self.medium, self.group)
    }
}

/// Every block a pool's prefix cache holds, consistent with the event numbered `seq`.
#[pyclass(module = "kvpool._core", name = "KvCacheSnapshot", frozen)]
pub struct KvCacheSnapshot {
    #[pyo3(get)]
    seq: u64,
    #[pyo3(get)]
    block_size: usize,
    #[pyo3(get)]
    blocks: Py<PyList>,
}

#[pymethods]
impl KvCacheSnapshot {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!("KvCacheSnapshot(seq={}, {} blocks)", self.seq, self.blocks.bind(py).len())
    }
}

pub fn snapshot_to_py(
    py: Python<'_>,
    snap: CacheSnapshot,
    pool_medium: &'static str,
) -> PyResult<KvCacheSnapshot> {
    let blocks: Vec<Py<CachedBlock>> = snap
        .blocks
        .into_iter()
        .map(|b| {
            Py::new(
                py,
                CachedBlock {
                    hash: b.hash,
                    parent: b.parent,
                    medium: medium_name(b.medium, pool_medium),
                    group: b.group,
                },
            )
        })
        .collect::<PyResult<_>>()?;
    Ok(KvCacheSnapshot {
        seq: snap.seq,
        block_size: snap.block_size,
        blocks: PyList::new(py, blocks)?.unbind(),
    })
}

pub fn stats_dict<'py>(py: Python<'py>, s: &PrefixCacheStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("num_cached_blocks", s.num_cached_blocks)?;
    d.set_item("num_evictable_blocks", s.num_evictable_blocks)?;
    d.set_item("requests", s.requests)?;
    d.set_item("queries", s.queries)?;
    d.set_item("hits", s.hits)?;
    d.set_item("hit_rate", s.hit_rate())?;
    d.set_item("stored_blocks", s.stored_blocks)?;
    d.set_item("evictions", s.evictions)?;
    d.set_item("resets", s.resets)?;
    d.set_item("host_num_blocks", s.host_num_blocks)?;
    d.set_item("host_num_cached_blocks", s.host_num_cached_blocks)?;
    d.set_item("host_stored_blocks", s.host_stored_blocks)?;
    d.set_item("host_evictions", s.host_evictions)?;
    d.set_item("swapped_in_blocks", s.swapped_in_blocks)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<AddResult>()?;
    m.add_class::<BlockStored>()?;
    m.add_class::<BlockRemoved>()?;
    m.add_class::<AllBlocksCleared>()?;
    m.add_class::<KvEventBatch>()?;
    m.add_class::<CachedBlock>()?;
    m.add_class::<KvCacheSnapshot>()?;
    Ok(())
}
