//! `BlockTables` for Python: request ids as Python ints, results as NumPy arrays, the
//! device table through `__cuda_array_interface__`.

use std::sync::Arc;

use kvpool_core::tables::{AppendResult, BlockTables, PromptKey};
use kvpool_core::CoreError;
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyUntypedArray};
use pyo3::prelude::*;

use crate::errors::{KvResult, PyKvError};
use crate::ids::{self, Int};
use crate::int_array::IntArray;
use crate::pool::PyPool;

// Prompts at least this long are added with the GIL released.
use crate::prefix::DETACH_MIN_TOKENS;

/// A request id: any int in 0..2**64 (a NumPy integer, or anything with `__index__`). A bool
/// or any other type is a `TypeError`; an int outside the range is `InvalidArgumentError`.
pub fn request_id(value: &Bound<'_, PyAny>) -> PyResult<u64> {
    named_request_id(value, "argument 'request_id'")
}

/// [`request_id`] of the argument `what` names.
pub fn named_request_id(value: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    let int = ids::index(value, what)?;
    int.extract::<u64>().map_err(|_| {
        let shown = ids::shown(&int);
        let why = if int.lt(0).unwrap_or(false) { "is negative" } else { "is 2**64 or more" };
        PyKvError(CoreError::InvalidArgument(format!(
            "{what}: request id {shown} {why} (request ids are in 0..2**64)"
        )))
        .into()
    })
}

/// Request ids: a 1-D int64 NumPy array (read in place) or any iterable of ints. An
/// exception the caller's iterable raises propagates as it is.
pub fn request_ids(values: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    const WHAT: &str = "argument 'request_ids'";
    if let Ok(array) = values.cast::<PyUntypedArray>() {
        ids::check_int_array(array, WHAT)?;
        if let Some(ints) = IntArray::of(array) {
            return ints
                .values()
                .map(|v| {
                    u64::try_from(v).map_err(|_| {
                        PyKvError(CoreError::InvalidArgument(format!(
                            "{WHAT}: request id {v} is negative (request ids are in 0..2**64)"
                        )))
                        .into()
                    })
                })
                .collect();
        }
    }
    let iter = ids::int_iter(values, WHAT)?;
    iter.enumerate()
        .map(|(i, item)| named_request_id(&item?, &format!("{WHAT}: item {i}")))
        .collect()
}

/// `counts` is one int for every request, or one per request. An exception the caller's
/// iterable raises propagates as it is.
fn token_counts(values: &Bound<'_, PyAny>, n: usize) -> PyResult<Vec<usize>> {
    const WHAT: &str = "argument 'counts'";
    const EXPECTED: &str = "an int or an iterable of ints";
    // One count for all: an int, a NumPy integer or anything with `__index__` (but an array,
    // whose `__index__` only serves size-1 arrays: it is a sequence of counts).
    if let Ok(array) = values.cast::<PyUntypedArray>() {
        ids::check_int_array(array, WHAT)?;
    } else if !ids::is_bool(values) && values.hasattr("__index__").unwrap_or(false) {
        return Ok(vec![ids::tokens(Int::of(values, WHAT)?, "count")?; n]);
    }
    // A str is a sequence of characters, not of counts.
    if ids::is_bool(values) || ids::is_text(values) {
        return Err(ids::wrong_type(WHAT, EXPECTED, values));
    }
    let iter = values.try_iter().map_err(|e| {
        if e.is_instance_of::<pyo3::exceptions::PyTypeError>(values.py()) {
            ids::wrong_type(WHAT, EXPECTED, values)
        } else {
            e // raised by the caller's __iter__
        }
    })?;
    iter.enumerate()
        .map(|(i, item)| ids::tokens(Int::of(&item?, &format!("{WHAT}: item {i}"))?, "count"))
        .collect()
}

/// (slot_mapping int64 [n], copies int32 [k, 2]) as returned by the append methods.
type AppendArrays<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray2<i32>>);

fn append_result<'py>(py: Python<'py>, r: AppendResult) -> AppendArrays<'py> {
    let copies: Vec<i32> = r.copies.iter().flat_map(|c| [c.src as i32, c.dst as i32]).collect();
    let copies = PyArray1::from_vec(py, copies)
        .reshape([r.copies.len(), 2])
        .expect("k x 2 holds 2k entries");
    (PyArray1::from_vec(py, r.slot_mapping), copies)
}

/// Per-request block tables over one pool: up to `max_seqs` requests of up to
/// `max_blocks_per_seq` blocks each.
///
/// Memory, reserved by the constructor at once: the host table, `max_seqs *
/// max_blocks_per_seq * 4` bytes (written when made, so resident: `BlockTables(pool, 2**20,
/// 2047)` takes 8 GiB), some tens of bytes per request slot, and on a pool with prefix caching
/// `max_seqs * block_size * 4` bytes more. On a CUDA pool the first `sync` to each device adds
/// a device copy and a pinned host staging buffer of `4 * max_seqs * (max_blocks_per_seq + 1)`
/// bytes each. Memory that cannot be had raises `OutOfMemoryError`.
#[pyclass(module = "kvpool._core", name = "BlockTables", frozen)]
pub struct PyBlockTables {
    pub inner: Arc<BlockTables>,
    pool: Py<PyPool>,
}

#[pymethods]
impl PyBlockTables {
    #[new]
    fn new(pool: Bound<'_, PyPool>, max_seqs: Int, max_blocks_per_seq: Int) -> KvResult<Self> {
        let inner = BlockTables::new(
            pool.get().inner.clone(),
            ids::count(max_seqs, "max_seqs")?,
            ids::count(max_blocks_per_seq, "max_blocks_per_seq")?,
        )?;
        Ok(PyBlockTables { inner, pool: pool.unbind() })
    }

    /// Adds a request of `num_tokens` tokens; returns their slot mapping (int64).
    fn add<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
        num_tokens: Int,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let rid = self::request_id(request_id)?;
        let slots =
            self.inner.add(rid, ids::tokens(num_tokens, "num_tokens")?).map_err(PyKvError)?;
        Ok(PyArray1::from_vec(py, slots))
    }

    /// Adds a request with its prompt's token ids. On a pool with prefix caching it starts
    /// from the cached blocks of its longest cached prefix (never covering the last token)
    /// and its other full blocks are cached. `cache_salt` (str or bytes) isolates tenants;
    /// `lora_id` and `extra_keys` (bytes) are part of every block's key.
    #[pyo3(signature = (request_id, token_ids, *, cache_salt = None, lora_id = None, extra_keys = None))]
    fn add_request(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_id: Option<Int>,
        extra_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<crate::prefix::AddResult> {
        let rid = self::request_id(request_id)?;
        let tokens = crate::prefix::token_ids(token_ids)?;
        let salt = crate::prefix::cache_salt(cache_salt)?;
        let extra = crate::prefix::extra_keys(extra_keys)?;
        let lora_id = lora_id
            .map(|id| ids::count(id, "lora_id").map(|id| id as u64))
            .transpose()
            .map_err(PyKvError)?;
        let key = PromptKey { cache_salt: salt.as_deref(), lora_id, extra_keys: &extra };
        // Hashing a long prompt takes tens of microseconds: let other threads run.
        let result = if tokens.len() >= DETACH_MIN_TOKENS {
            py.detach(|| self.inner.add_request(rid, &tokens, &key))
        } else {
            self.inner.add_request(rid, &tokens, &key)
        }
        .map_err(PyKvError)?;
        Ok(crate::prefix::AddResult::new(py, result))
    }

    /// Appends `n` tokens; returns (slot_mapping int64 [n], copies int32 [k, 2]). With
    /// `token_ids` (n ids), the blocks they fill are cached.
    #[pyo3(signature = (request_id, n, token_ids = None))]
    fn append_tokens<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
        n: Int,
        token_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<AppendArrays<'py>> {
        let rid = self::request_id(request_id)?;
        let n = ids::tokens(n, "n")?;
        let tokens = token_ids.map(crate::prefix::token_ids).transpose()?;
        let result = self
            .inner
            .append_tokens_many_with_ids(&[rid], &[n], tokens.as_deref())
            .map_err(PyKvError)?;
        Ok(append_result(py, result))
    }

    /// One decode step: appends counts (an int for all, or one per request), all or none.
    /// With `token_ids` (all requests' new ids concatenated in call order, sum(counts) of
    /// them), the blocks they fill are cached.
    #[pyo3(signature = (request_ids, counts, token_ids = None))]
    fn append_tokens_many<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        counts: &Bound<'py, PyAny>,
        token_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<AppendArrays<'py>> {
        let rids = self::request_ids(request_ids)?;
        let counts = token_counts(counts, rids.len())?;
        let tokens = token_ids.map(crate::prefix::token_ids).transpose()?;
        let result = self
            .inner
            .append_tokens_many_with_ids(&rids, &counts, tokens.as_deref())
            .map_err(PyKvError)?;
        Ok(append_result(py, result))
    }

    /// Adds `child_id` sharing all of `parent_id`'s blocks (copy-on-write on the next append).
    fn fork(&self, parent_id: &Bound<'_, PyAny>, child_id: &Bound<'_, PyAny>) -> KvResult<()> {
        let parent = named_request_id(parent_id, "argument 'parent_id'")?;
        let child = named_request_id(child_id, "argument 'child_id'")?;
        Ok(self.inner.fork(parent, child)?)
    }

    /// Removes a request; blocks nobody else references return to the pool.
    fn free(&self, request_id: &Bound<'_, PyAny>) -> KvResult<()> {
        Ok(self.inner.free(self::request_id(request_id)?)?)
    }

    fn num_tokens(&self, request_id: &Bound<'_, PyAny>) -> KvResult<usize> {
        Ok(self.inner.num_tokens(self::request_id(request_id)?)?)
    }

    fn blocks<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
    ) -> KvResult<Bound<'py, PyArray1<i32>>> {
        Ok(PyArray1::from_vec(py, self.inner.blocks(self::request_id(request_id)?)?))
    }

    /// Request ids in row order (the order of `sync`'s arrays).
    fn request_ids(&self) -> Vec<u64> {
        self.inner.request_ids()
    }

    /// seq_lens (int32) of a batch of requests.
    fn seq_lens<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        Ok(PyArray1::from_vec(
            py,
            self.inner.seq_lens(&self::request_ids(request_ids)?).map_err(PyKvError)?,
        ))
    }

    /// Dense int32 table `[len(request_ids), max_blocks_per_seq]`, unused entries -1.
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let rids = self::request_ids(request_ids)?;
        let (_, table) = self.inner.gather(&rids).map_err(PyKvError)?;
        Ok(PyArray1::from_vec(py, table)
            .reshape([rids.len(), self.inner.max_blocks_per_seq()])
            .expect("n rows of max_blocks_per_seq"))
    }

    /// CSR form of a batch: (indptr, indices, last_page_len), all int32 (FlashInfer's).
    #[allow(clippy::type_complexity)]
    fn csr<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<i32>>)>
    {
        let csr = self.inner.csr(&self::request_ids(request_ids)?).map_err(PyKvError)?;
        Ok((
            PyArray1::from_vec(py, csr.indptr),
            PyArray1::from_vec(py, csr.indices),
            PyArray1::from_vec(py, csr.last_page_len),
        ))
    }

    /// Makes the table of all rows (in `request_ids()` order) visible to kernels and returns
    /// `(block_table, seq_lens)`. CUDA pools: uploads only what changed, asynchronously on
    /// the pool's stream (or `stream`, anything with `__cuda_stream__`), and returns device
    /// arrays with `__cuda_array_interface__`. Host pools: NumPy copies.
    ///
    /// `pool`: a mirror pool (tensor parallelism: another rank's shard, on its own device,
    /// holding as many blocks) to upload the same table to instead, on its stream (or
    /// `stream`, which must then be on the mirror's device); the arrays name the mirror as
    /// their pool, so its kernels accept them.
    #[pyo3(signature = (stream = None, *, pool = None))]
    fn sync<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<&Bound<'py, PyAny>>,
        pool: Option<&Bound<'py, PyPool>>,
    ) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
        let py = slf.py();
        let this = slf.get();
        if let Some(mirror) = pool {
            if !mirror.is(this.pool.bind(py)) {
                return sync_mirror(slf, stream, mirror);
            }
        }
        if this.inner.pool().device() == kvpool_core::Device::Host {
            if stream.is_some() {
                return Err(crate::errors::PyKvError(CoreError::InvalidArgument(
                    "a stream was given, but the pool is on the host".into(),
                ))
                .into());
            }
            // One core call, one lock: no other thread's change falls between table and seq_lens.
            let batch = this.inner.host_batch().map_err(crate::errors::PyKvError)?;
            let table = PyArray1::from_vec(py, batch.block_table)
                .reshape([batch.num_seqs, batch.max_blocks_per_seq])?;
            return Ok((
                table.into_any().unbind(),
                PyArray1::from_vec(py, batch.seq_lens).into_any().unbind(),
            ));
        }
        sync_cuda(slf, stream)
    }

    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyPool> {
        self.pool.clone_ref(py)
    }
    #[getter]
    fn max_seqs(&self) -> usize {
        self.inner.max_seqs()
    }
    #[getter]
    fn max_blocks_per_seq(&self) -> usize {
        self.inner.max_blocks_per_seq()
    }

    /// Checks the tables' own invariants and their blocks' (references held <= ref counts,
    /// tagged as the tables'), with the tables locked for the whole check: exact while other
    /// threads use the pool. The pool's counts are `Pool.check_invariants()`'s, which needs
    /// the pool quiet.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.check_invariants())
            .map_err(|m| crate::errors::KvError::new_err(format!("invariant violated: {m}")))
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
    fn __contains__(&self, request_id: &Bound<'_, PyAny>) -> bool {
        self::request_id(request_id).map(|r| self.inner.contains(r)).unwrap_or(false)
    }
    fn __repr__(&self) -> String {
        format!(
            "BlockTables(len={}, max_seqs={}, max_blocks_per_seq={})",
            self.inner.len(),
            self.inner.max_seqs(),
            self.inner.max_blocks_per_seq()
        )
    }
}

fn sync_cuda<'py>(
    slf: &Bound<'py, PyBlockTables>,
    stream: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
    let py = slf.py();
    let this = slf.get();
    let batch = match stream {
        None => this.inner.sync(),
        Some(obj) => {
            let handle = crate::stream::handle_of(obj)?;
            // SAFETY: the handle comes from `__cuda_stream__` of a stream object the caller
            // passed and we hold for the duration of the call (bare ints are refused); the
            // protocol promises a live stream, and `sync_on` checks its context is the pool's.
            unsafe { this.inner.sync_on(handle) }
        }
    }
    .map_err(crate::errors::PyKvError)?;
    device_arrays(slf, this.pool.bind(py), batch)
}

/// The pair of device arrays over a sync's upload, read by `pool`'s kernels.
fn device_arrays(
    slf: &Bound<'_, PyBlockTables>,
    pool: &Bound<'_, PyPool>,
    batch: kvpool_core::tables::DeviceBatch,
) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
    let py = slf.py();
    let owner = slf.clone().into_any().unbind();
    let pool = crate::stream::ArrayPool {
        object: pool.clone().into_any().unbind(),
        inner: pool.get().inner.clone(),
    };
    let table = crate::stream::DeviceArray::new(
        owner.clone_ref(py),
        pool.clone_ref(py),
        batch.block_table_ptr,
        vec![batch.num_seqs, batch.max_blocks_per_seq],
        batch.stream,
    );
    let seq_lens = crate::stream::DeviceArray::new(
        owner,
        pool,
        batch.seq_lens_ptr,
        vec![batch.num_seqs],
        batch.stream,
    );
    Ok((Py::new(py, table)?.into_any(), Py::new(py, seq_lens)?.into_any()))
}

fn sync_mirror<'py>(
    slf: &Bound<'py, PyBlockTables>,
    stream: Option<&Bound<'py, PyAny>>,
    mirror: &Bound<'py, PyPool>,
) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
    let handle = stream.map(crate::stream::handle_of).transpose()?;
    // SAFETY: a given handle comes from `__cuda_stream__` of a stream object the caller passed
    // and we hold for the call (bare ints are refused); the core checks its context is the
    // mirror's. Without one, the mirror's own stream is used, and `mirror` is held.
    let batch = unsafe { slf.get().inner.sync_mirror_on(&mirror.get().inner, handle) }
        .map_err(crate::errors::PyKvError)?;
    device_arrays(slf, mirror, batch)
}
