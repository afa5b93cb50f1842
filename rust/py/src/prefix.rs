//! Prefix caching for Python: token ids, salts and keys checked into core types, the
//! `add_request` result, KV event objects (vLLM's field names) and the stats dict.

use kvpool_core::prefix_cache::{BlockHash, KvEvent, Medium, PrefixCacheStats};
use kvpool_core::CoreError;
use numpy::{PyArray1, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

use crate::errors::PyKvError;
use crate::ids;

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

/// Consecutive blocks of one request entered the cache (vLLM's `BlockStored`).
#[pyclass(module = "kvpool._core", name = "BlockStored", frozen)]
pub struct BlockStored {
    block_hashes: Vec<BlockHash>,
    parent_block_hash: Option<BlockHash>,
    token_ids: Vec<u32>,
    block_size: usize,
    lora_id: Option<u64>,
    medium: &'static str,
}

#[pymethods]
impl BlockStored {
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
    fn medium(&self) -> &'static str {
        self.medium
    }
    fn __repr__(&self) -> String {
        format!(
            "BlockStored({} blocks, parent={:?}, medium={})",
            self.block_hashes.len(),
            self.parent_block_hash,
            self.medium
        )
    }
}

/// Blocks left one tier of the cache: evicted for reuse, or moved to the other tier (vLLM's
/// `BlockRemoved`).
#[pyclass(module = "kvpool._core", name = "BlockRemoved", frozen)]
pub struct BlockRemoved {
    block_hashes: Vec<BlockHash>,
    medium: &'static str,
}

#[pymethods]
impl BlockRemoved {
    #[getter]
    fn block_hashes<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        hash_bytes(py, &self.block_hashes)
    }
    #[getter]
    fn medium(&self) -> &'static str {
        self.medium
    }
    fn __repr__(&self) -> String {
        format!("BlockRemoved({} blocks, medium={})", self.block_hashes.len(), self.medium)
    }
}

/// Every cached block was dropped by a reset (vLLM's `AllBlocksCleared`).
#[pyclass(module = "kvpool._core", name = "AllBlocksCleared", frozen)]
pub struct AllBlocksCleared {}

#[pymethods]
impl AllBlocksCleared {
    fn __repr__(&self) -> &'static str {
        "AllBlocksCleared()"
    }
}

/// Python objects for drained events, in order. `pool_medium` names the pool's own memory
/// ("GPU" or "CPU"); the host tier is "CPU".
pub fn events_to_py(
    py: Python<'_>,
    events: Vec<KvEvent>,
    pool_medium: &'static str,
) -> PyResult<Vec<Py<PyAny>>> {
    let name = |medium: Medium| match medium {
        Medium::Pool => pool_medium,
        Medium::HostTier => "CPU",
    };
    events
        .into_iter()
        .map(|event| {
            Ok(match event {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    ..
                } => {
                    let medium = name(medium);
                    Py::new(
                        py,
                        BlockStored {
                            block_hashes,
                            parent_block_hash,
                            token_ids,
                            block_size,
                            lora_id,
                            medium,
                        },
                    )?
                    .into_any()
                }
                KvEvent::BlockRemoved { block_hashes, medium, .. } => {
                    Py::new(py, BlockRemoved { block_hashes, medium: name(medium) })?.into_any()
                }
                KvEvent::AllBlocksCleared => Py::new(py, AllBlocksCleared {})?.into_any(),
            })
        })
        .collect()
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
    Ok(())
}
