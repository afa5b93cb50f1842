//! Hybrid KV memory for Python: `HybridTables` and `HybridHostTier` over the core's `hybrid`
//! module (design in `rust/core/src/hybrid/hybrid.md`; `KvGroup` and `ModelKvSpec` are in
//! hybrid_spec.rs). Argument checking and NumPy conversion live here; the page bookkeeping
//! in the core.
//!
//! Errors follow the binding's convention: a wrong type is a `TypeError`; a group, page size
//! or spec that cannot be (a window of 0, layers not covered once, a token larger than a
//! page, a pool whose blocks are not the spec's pages) is a `LayoutError`; a group index,
//! position or count out of range is an `InvalidArgumentError`; unknown and duplicate
//! requests and running out of pages raise what `BlockTables` raises for them.
//!
//! The core's `HybridTables` changes through `&mut`, so the Python object holds it behind a
//! mutex (`frozen` class, calls serialised; long calls release the GIL first and then lock,
//! and nothing here takes the GIL while holding the lock). `append_tokens_many` is the core's
//! `append_many`: all or none, and when it succeeds the same as `append_tokens` of each
//! request in call order (each planned on the reference counts the earlier ones leave, so
//! of a forked parent and child in one step only the first copies their shared pages).
//!
//! Prefix caching (on a pool made with `enable_prefix_caching=True`) binds the core's
//! `add_request`, `cache_computed`, `checkpoint`, `cache_stats` and `cached_page_group`
//! with the conventions of `BlockTables.add_request` (token ids, `cache_salt`, `lora_id`,
//! `extra_keys` checked by prefix.rs); the per-group KV events come out of the pool's queue
//! (`Pool.take_kv_events`, each event's `group`). A caching-only call on a pool without
//! prefix caching (`checkpoint`, `cache_computed`) is an `InvalidArgumentError`.

use std::sync::{Mutex, MutexGuard};

use kvpool_core::hybrid::{HybridHostTier, HybridTables, PageCopy, RequestPage};
use kvpool_core::pool::PoolSize;
use kvpool_core::tables::PromptKey;
use kvpool_core::tier::{CopyMethod, SwapStats, Tier};
use kvpool_core::CoreError;
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{KvResult, PyKvError};
use crate::hybrid_spec::{index_list, PyModelKvSpec};
use crate::ids::{self, Int};
use crate::pool::PyPool;
use crate::tables::{named_request_id, request_id, request_ids};

/// Calls growing a request by at least this many tokens run with the GIL released.
const DETACH_MIN_TOKENS: usize = 1024;

/// `(group, src, dst)` rows, int32 `[k, 3]`: the page copies a call's caller runs before
/// writing its new tokens.
fn copies_array<'py>(py: Python<'py>, copies: &[PageCopy]) -> Bound<'py, PyArray2<i32>> {
    let flat: Vec<i32> =
        copies.iter().flat_map(|c| [c.group as i32, c.src as i32, c.dst as i32]).collect();
    PyArray1::from_vec(py, flat).reshape([copies.len(), 3]).expect("k x 3 holds 3k entries")
}

/// Per request and per group, the pages a request of a hybrid model holds in one pool
/// (`pool.block_bytes` must be `spec.page_bytes`). Window and chunk groups drop the pages no
/// later query can see as requests grow; state groups hold one slot per request.
///
/// Calls are serialised by a lock (the core tables are single-writer); every mutating call
/// is all or nothing. The tables should be the pool's only user: `check_invariants` counts
/// on it, and blocks taken from the pool directly are not theirs.
#[pyclass(module = "kvpool._core", name = "HybridTables", frozen)]
pub struct PyHybridTables {
    inner: Mutex<HybridTables>,
    pool: Py<PyPool>,
    spec: Py<PyModelKvSpec>,
}

impl PyHybridTables {
    fn lock(&self) -> MutexGuard<'_, HybridTables> {
        // A panic inside a call is a bug that PyO3 already surfaced as a PanicException; the
        // core commits only after everything that can fail, so the tables are still whole.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// One request's append: with its token ids (hashed for prefix caching) or without.
fn append_one(
    tables: &mut HybridTables,
    rid: u64,
    count: usize,
    token_ids: Option<&[u32]>,
) -> Result<Vec<PageCopy>, CoreError> {
    match token_ids {
        Some(ids) => tables.append_tokens(rid, ids),
        None => tables.append(rid, count),
    }
}

/// What `HybridTables.add_request` found and must have copied.
#[pyclass(module = "kvpool._core", name = "HybridAddResult", frozen)]
pub struct PyHybridAddResult {
    num_cached_tokens: usize,
    copies: Py<PyArray2<i32>>,
    swapped_in_pages: usize,
}

#[pymethods]
impl PyHybridAddResult {
    /// Prompt tokens whose KV (and states) are cached: a multiple of 16 below
    /// `len(token_ids)`; the request computes from there.
    #[getter]
    fn num_cached_tokens(&self) -> usize {
        self.num_cached_tokens
    }
    /// int32 `[k, 3]` rows (group, src, dst) to copy, whole pages, before the request's
    /// tokens are computed: each group's cached page the hit ends inside and each resumed
    /// state slot.
    #[getter]
    fn copies(&self, py: Python<'_>) -> Py<PyArray2<i32>> {
        self.copies.clone_ref(py)
    }
    /// Pages of the hit the call brought back from the prefix cache's host tier
    /// (`prefix_cache_host_blocks`) into fresh pages: copied by the call itself (before any
    /// later work on the pool's stream), counted in `num_cached_tokens`, and cached in the
    /// pool again. 0 without a host tier.
    #[getter]
    fn swapped_in_pages(&self) -> usize {
        self.swapped_in_pages
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "HybridAddResult(num_cached_tokens={}, len(copies)={}, swapped_in_pages={})",
            self.num_cached_tokens,
            self.copies.bind(py).shape()[0],
            self.swapped_in_pages
        )
    }
}

/// Refuses a caching-only call (`what`) on tables whose pool does not cache prefixes.
fn require_caching(tables: &HybridTables, what: &str) -> Result<(), CoreError> {
    if tables.caches_prefixes() {
        return Ok(());
    }
    Err(CoreError::InvalidArgument(format!(
        "{what} needs a pool made with enable_prefix_caching=True"
    )))
}

/// `token_ids` given with a count `n`: one id per token.
fn check_ids_match(n: usize, token_ids: Option<&[u32]>) -> Result<(), CoreError> {
    match token_ids {
        Some(ids) if ids.len() != n => Err(CoreError::InvalidArgument(format!(
            "n is {n} but {} token ids were given: give one id per appended token",
            ids.len()
        ))),
        _ => Ok(()),
    }
}

/// `counts`: one int for every request, or one per request (an int array or any iterable
/// of ints), each read as `append_tokens` reads its `n`.
fn batch_counts(values: &Bound<'_, PyAny>, n: usize) -> PyResult<Vec<usize>> {
    const WHAT: &str = "argument 'counts'";
    if let Ok(array) = values.cast::<PyUntypedArray>() {
        ids::check_int_array(array, WHAT)?;
    } else if !ids::is_bool(values) && values.hasattr("__index__").unwrap_or(false) {
        return Ok(vec![ids::tokens(Int::of(values, WHAT)?, "count")?; n]);
    }
    let iter = ids::int_iter(values, WHAT)?;
    iter.enumerate()
        .map(|(i, item)| {
            let what = format!("{WHAT}: item {i}");
            ids::tokens(Int::of(&item?, &what)?, &format!("{what}: count"))
        })
        .collect()
}

#[pymethods]
impl PyHybridTables {
    /// Tables for `spec` over `pool`. Raises `LayoutError` when the pool's blocks are not
    /// `spec.page_bytes` bytes or the pool cannot hold one request of one token with all its
    /// state slots. On a pool with prefix caching the tables cache prefixes (`add_request`);
    /// with a host tier (`prefix_cache_host_blocks`) the cached pages they evict spill there
    /// and a hit brings them back.
    #[new]
    fn new(pool: Bound<'_, PyPool>, spec: Bound<'_, PyModelKvSpec>) -> KvResult<Self> {
        let inner = HybridTables::new(pool.get().inner.clone(), spec.get().inner.clone())?;
        Ok(PyHybridTables { inner: Mutex::new(inner), pool: pool.unbind(), spec: spec.unbind() })
    }

    /// Adds a request of `num_tokens` tokens: every group's pages for them (window and
    /// chunk groups keep all, since all their queries are still to run) and every state slot.
    /// With `next_query`, the queries below it have run already: window and chunk groups
    /// hold only what the queries from there on see, as a request in that position does (the
    /// receiving end of a transfer, which then copies `request_pages` in). Its pages are not
    /// cached. `InvalidArgumentError` if `next_query` is past `num_tokens`.
    #[pyo3(signature = (request_id, num_tokens, *, next_query = None))]
    fn add(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        num_tokens: Int,
        next_query: Option<Int>,
    ) -> KvResult<()> {
        let rid = self::request_id(request_id)?;
        let n = ids::tokens(num_tokens, "num_tokens")?;
        let q = next_query.map(|q| ids::tokens(q, "next_query")).transpose()?.unwrap_or(0);
        if n >= DETACH_MIN_TOKENS {
            py.detach(|| self.lock().add_at(rid, n, q))?;
        } else {
            self.lock().add_at(rid, n, q)?;
        }
        Ok(())
    }

    /// Adds a request with its prompt's token ids. On a pool with prefix caching it starts
    /// from the longest cached prefix every group can serve (a multiple of 16 tokens, never
    /// the last token): full and MLA groups share the prefix's pages, window and chunk
    /// groups the pages the first new token's query sees, state groups resume from a
    /// checkpoint at exactly the hit. Returns a `HybridAddResult`: `num_cached_tokens`, and
    /// `copies` (int32 `[k, 3]`: group, src, dst) to run before the request's tokens are
    /// computed. Pages are cached once their tokens have run (the request's next call, or
    /// `cache_computed`). `cache_salt` (str or bytes) isolates tenants; `lora_id` and
    /// `extra_keys` (bytes) are part of every key. Without prefix caching this is `add`.
    #[pyo3(signature = (request_id, token_ids, *, cache_salt = None, lora_id = None, extra_keys = None))]
    fn add_request(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_id: Option<Int>,
        extra_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyHybridAddResult> {
        let rid = self::request_id(request_id)?;
        let tokens = crate::prefix::token_ids(token_ids)?;
        let salt = crate::prefix::cache_salt(cache_salt)?;
        let extra = crate::prefix::extra_keys(extra_keys)?;
        let lora_id = crate::prefix::lora_id(lora_id)?;
        let key = PromptKey { cache_salt: salt.as_deref(), lora_id, extra_keys: &extra };
        // Hashing a long prompt takes tens of microseconds: let other threads run.
        let added = if tokens.len() >= DETACH_MIN_TOKENS {
            py.detach(|| self.lock().add_request(rid, &tokens, &key))
        } else {
            self.lock().add_request(rid, &tokens, &key)
        }
        .map_err(PyKvError)?;
        Ok(PyHybridAddResult {
            num_cached_tokens: added.num_cached_tokens,
            copies: copies_array(py, &added.copies).unbind(),
            swapped_in_pages: added.swapped_in_pages,
        })
    }

    /// Appends `n` tokens to a request whose earlier queries have all run; window and chunk
    /// groups release the pages no query from the first new token on sees. Returns the page
    /// copies (int32 `[k, 3]`: group, src, dst) to run before the new tokens are written.
    /// With `token_ids` (n ids) on a pool with prefix caching, the pages they fill are
    /// cached once they have run; without, the request's later pages are not cached.
    #[pyo3(signature = (request_id, n, token_ids = None))]
    fn append_tokens<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
        n: Int,
        token_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let rid = self::request_id(request_id)?;
        let n = ids::tokens(n, "n")?;
        let tokens = token_ids.map(crate::prefix::token_ids).transpose()?;
        check_ids_match(n, tokens.as_deref()).map_err(PyKvError)?;
        let copies = if n >= DETACH_MIN_TOKENS {
            py.detach(|| append_one(&mut self.lock(), rid, n, tokens.as_deref()))
        } else {
            append_one(&mut self.lock(), rid, n, tokens.as_deref())
        }
        .map_err(PyKvError)?;
        Ok(copies_array(py, &copies))
    }

    /// One decode step: appends `counts` (an int for all, or one per request) to each of
    /// `request_ids`, all or none (ids must be distinct). `token_ids`, when given, are all
    /// requests' new ids concatenated in call order (`sum(counts)` of them), as
    /// `append_tokens` takes them. Returns every request's page copies, in call order, as
    /// `append_tokens` does. When it succeeds it is `append_tokens` of each request in call
    /// order: of a forked parent and child in one step only the first listed copies the
    /// pages they share. It is refused (`OutOfBlocksError`, nothing changed) when the new
    /// pages of all of them exceed the free and evictable pages before the call.
    #[pyo3(signature = (request_ids, counts, token_ids = None))]
    fn append_tokens_many<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        counts: &Bound<'py, PyAny>,
        token_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let rids = self::request_ids(request_ids)?;
        let counts = batch_counts(counts, rids.len())?;
        let tokens = token_ids.map(crate::prefix::token_ids).transpose()?;
        let total = counts.iter().fold(0usize, |a, &c| a.saturating_add(c));
        let copies = if total >= DETACH_MIN_TOKENS {
            py.detach(|| self.lock().append_many(&rids, &counts, tokens.as_deref()))
        } else {
            self.lock().append_many(&rids, &counts, tokens.as_deref())
        }
        .map_err(PyKvError)?;
        Ok(copies_array(py, &copies))
    }

    /// Declares that every token of a request has run (its step finished): caches the pages
    /// of its whole 16-token chunks now rather than at its next call. Call it before `free`
    /// to keep the pages of a request that ends without another call. Raises
    /// `InvalidArgumentError` on a pool without prefix caching.
    fn cache_computed(&self, request_id: &Bound<'_, PyAny>) -> KvResult<()> {
        let rid = self::request_id(request_id)?;
        let mut tables = self.lock();
        tables.num_tokens(rid)?;
        require_caching(&tables, "cache_computed")?;
        Ok(tables.cache_computed(rid)?)
    }

    /// Checkpoints every state group of a request after its `num_tokens` tokens, which have
    /// all run (its pages are cached too, as `cache_computed`): a later `add_request` whose
    /// prompt matches up to here resumes from it. `num_tokens` must be a positive multiple of
    /// 16 and all its tokens known (added with `add_request`, appended with `token_ids`):
    /// `InvalidArgumentError` otherwise, or on a pool without prefix caching. Returns the
    /// copies (int32 `[k, 3]`: group, src, dst) from the live slots into the checkpoint's
    /// pages: run them before the request's next step, and before the kernels of any later
    /// call (the checkpoint's pages are evictable at once). A checkpoint already cached there
    /// is kept (no copies).
    fn checkpoint<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
    ) -> KvResult<Bound<'py, PyArray2<i32>>> {
        let rid = self::request_id(request_id)?;
        let copies = self.lock().checkpoint(rid)?;
        Ok(copies_array(py, &copies))
    }

    /// Per group (in the spec's order), the cached pages: `{"cached_pages",
    /// "evictable_pages", "host_pages"}`: cached in the pool, of those the ones no table
    /// holds, and the group's pages on the prefix cache's host tier. Zeros on a pool without
    /// prefix caching.
    fn cache_stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let (stats, num_groups) = {
            let tables = self.lock();
            (tables.cache_stats(), tables.spec().num_groups())
        };
        (0..num_groups)
            .map(|g| {
                let s = stats.get(g).copied().unwrap_or_default();
                let d = PyDict::new(py);
                d.set_item("cached_pages", s.cached_pages)?;
                d.set_item("evictable_pages", s.evictable_pages)?;
                d.set_item("host_pages", s.host_pages)?;
                Ok(d)
            })
            .collect()
    }

    /// Every chunk these tables cached, per group and on both tiers (`KvCacheSnapshot`,
    /// block size 16: each chunk hash a `BlockStored` of that group and medium named and no
    /// `BlockRemoved` took back, with that event's parent), and the `seq` of the newest event
    /// it reflects: load it, then apply the pool's events with a greater `seq`. Raises
    /// `InvalidArgumentError` on a pool without prefix caching.
    fn kv_cache_snapshot(&self, py: Python<'_>) -> PyResult<crate::prefix::KvCacheSnapshot> {
        let snapshot = self.lock().kv_cache_snapshot().ok_or_else(|| {
            PyKvError(CoreError::InvalidArgument(
                "a KV cache snapshot needs a pool made with enable_prefix_caching=True".into(),
            ))
        })?;
        crate::prefix::snapshot_to_py(py, snapshot, self.pool.get().medium())
    }

    /// The group a cached page is cached for, or None if it is not cached (a page id
    /// outside the pool is an `InvalidBlockError`).
    fn cached_page_group(&self, page: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        // Read before locking: `__index__` of the caller's object may call back into Python.
        let page = ids::block_id(page, self.pool.get().inner.num_blocks(), "argument 'page'")?;
        Ok(self.lock().cached_page_group(page))
    }

    /// The first position of a request whose query has not run yet: what its last call
    /// started from (a prefix hit's `num_cached_tokens` after `add_request`).
    fn next_query(&self, request_id: &Bound<'_, PyAny>) -> KvResult<usize> {
        let rid = self::request_id(request_id)?;
        Ok(self.lock().next_query(rid)?)
    }

    /// Whether the tables cache prefixes (their pool was made with
    /// `enable_prefix_caching=True`).
    #[getter]
    fn prefix_caching(&self) -> bool {
        self.lock().caches_prefixes()
    }

    /// Adds `child_id` sharing every page of every group of `parent_id` (copy on write:
    /// the next append to either copies what it writes).
    fn fork(&self, parent_id: &Bound<'_, PyAny>, child_id: &Bound<'_, PyAny>) -> KvResult<()> {
        let parent = named_request_id(parent_id, "argument 'parent_id'")?;
        let child = named_request_id(child_id, "argument 'child_id'")?;
        Ok(self.lock().fork(parent, child)?)
    }

    /// Removes a request; pages nobody else references return to the pool.
    fn free(&self, request_id: &Bound<'_, PyAny>) -> KvResult<()> {
        let rid = self::request_id(request_id)?;
        Ok(self.lock().free(rid)?)
    }

    fn num_tokens(&self, request_id: &Bound<'_, PyAny>) -> KvResult<usize> {
        let rid = self::request_id(request_id)?;
        Ok(self.lock().num_tokens(rid)?)
    }

    /// `(first_page, page_ids, num_tokens)` of a request's table of group `group`: the
    /// token at position `p` is at offset `p % block_size` of page
    /// `page_ids[p // block_size - first_page]` (int32 ids). A state group's `page_ids` are
    /// its slot, `first_page` 0.
    fn table<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
        group: Int,
    ) -> KvResult<(usize, Bound<'py, PyArray1<i32>>, usize)> {
        let rid = self::request_id(request_id)?;
        let group = ids::count(group, "group")?;
        let (first_page, page_ids, num_tokens) = {
            let tables = self.lock();
            let table = tables.table(rid, group)?;
            let ids: Vec<i32> = table.page_ids.iter().map(|&p| p as i32).collect();
            (table.first_page, ids, table.num_tokens)
        };
        Ok((first_page, PyArray1::from_vec(py, page_ids), num_tokens))
    }

    /// The slots (`page_id * block_size + offset`, int64) of the tokens at `positions` in
    /// token group `group`. A position whose page the table does not hold (past the end, or
    /// dropped from a window) is an `InvalidArgumentError` naming it.
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
        group: Int,
        positions: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let rid = self::request_id(request_id)?;
        let group = ids::count(group, "group").map_err(PyKvError)?;
        let positions =
            index_list(positions, "argument 'positions'", "position", CoreError::InvalidArgument)?;
        let slots = {
            let tables = self.lock();
            let table = tables.table(rid, group).map_err(PyKvError)?;
            if table.block_size.is_none() {
                return Err(PyKvError(CoreError::InvalidArgument(format!(
                    "group {group} holds a state, not tokens: use state_slot"
                )))
                .into());
            }
            positions
                .iter()
                .map(|&p| {
                    table.slot(p).filter(|_| p < table.num_tokens).ok_or_else(|| {
                        let bs = table.block_size.unwrap_or(1);
                        let first = table.first_page * bs;
                        let end = table.num_tokens;
                        PyKvError(CoreError::InvalidArgument(format!(
                            "request {rid} group {group}: position {p} is not held (the table \
                             holds the pages of positions {first}..{end})"
                        )))
                    })
                })
                .collect::<Result<Vec<i64>, _>>()?
        };
        Ok(PyArray1::from_vec(py, slots))
    }

    /// The page ids (int32, `spec.pages_per_slot(group)` of them) of a request's state slot
    /// in state group `group`; `spec.state_location` says where a layer's bytes lie in them.
    fn state_slot<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
        group: Int,
    ) -> KvResult<Bound<'py, PyArray1<i32>>> {
        let rid = self::request_id(request_id)?;
        let group = ids::count(group, "group")?;
        let ids = {
            let tables = self.lock();
            let table = tables.table(rid, group)?;
            if table.block_size.is_some() {
                return Err(CoreError::InvalidArgument(format!(
                    "group {group} holds tokens, not a state: use table or slot_mapping"
                ))
                .into());
            }
            table.page_ids.iter().map(|&p| p as i32).collect::<Vec<i32>>()
        };
        Ok(PyArray1::from_vec(py, ids))
    }

    /// Every page a request holds, as int64 rows (group, page_index, page_id): group by group
    /// in the spec's order, each group's pages in page order (a window table from its first
    /// live page, a state slot's pages from 0). Copying these pages and adding the request
    /// elsewhere with the same `num_tokens` and `next_query` moves every group of it.
    fn request_pages<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
    ) -> KvResult<Bound<'py, PyArray2<i64>>> {
        let rid = self::request_id(request_id)?;
        let pages = self.lock().request_pages(rid)?;
        Ok(request_pages_array(py, &pages))
    }

    /// Shrinks a growable pool (`Pool.shrink`) and returns the bytes released; with prefix
    /// caching the tables first evict the cached pages a shrink can release, dropping their
    /// keys and reporting their removal per group (`Pool.shrink` alone leaves these tables'
    /// cached pages where they are). 0 on a fixed pool.
    fn shrink(&self, py: Python<'_>) -> KvResult<usize> {
        Ok(py.detach(|| self.lock().shrink())?)
    }

    /// Pages a request holds over all its groups (each shared page counted once per holder).
    fn num_pages(&self, request_id: &Bound<'_, PyAny>) -> KvResult<usize> {
        let rid = self::request_id(request_id)?;
        let tables = self.lock();
        let mut n = 0;
        for group in 0..tables.spec().num_groups() {
            n += tables.table(rid, group)?.page_ids.len();
        }
        Ok(n)
    }

    /// Checks the tables against the spec and the pool (every table holds exactly its live
    /// pages, reference counts equal the tables' references, a page in one group only, the
    /// pool's counts add up); raises `KvError` naming the first broken one. Exact while the
    /// tables are the pool's only user.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.lock().check_invariants())
            .map_err(|m| crate::errors::KvError::new_err(format!("invariant violated: {m}")))
    }

    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyPool> {
        self.pool.clone_ref(py)
    }
    #[getter]
    fn spec(&self, py: Python<'_>) -> Py<PyModelKvSpec> {
        self.spec.clone_ref(py)
    }

    fn __len__(&self) -> usize {
        self.lock().len()
    }
    fn __contains__(&self, request_id: &Bound<'_, PyAny>) -> bool {
        self::request_id(request_id).map(|r| self.lock().contains(r)).unwrap_or(false)
    }
    fn __repr__(&self) -> String {
        let tables = self.lock();
        format!(
            "HybridTables(len={}, num_groups={}, page_bytes={})",
            tables.len(),
            tables.spec().num_groups(),
            tables.spec().page_bytes()
        )
    }
}

/// `(group, page_index, page_id)` rows, int64 `[k, 3]`: a request's pages as swaps list them.
fn request_pages_array<'py>(py: Python<'py>, pages: &[RequestPage]) -> Bound<'py, PyArray2<i64>> {
    let flat: Vec<i64> = pages
        .iter()
        .flat_map(|p| [p.group as i64, p.page_index as i64, p.page_id as i64])
        .collect();
    PyArray1::from_vec(py, flat).reshape([pages.len(), 3]).expect("k x 3 holds 3k entries")
}

fn swap_stats<'py>(py: Python<'py>, s: SwapStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("num_requests", s.num_requests)?;
    d.set_item("num_blocks", s.num_blocks)?;
    d.set_item("num_copies", s.num_copies)?;
    Ok(d)
}

/// A host tier for the requests of a `HybridTables`: a host pool of the same page bytes
/// (pinned for a CUDA pool), and swaps of whole requests, every group's pages, between the
/// tiers. A swapped-in request gets fresh pages at the page indices it had, so its tables
/// (`first_page` included) read as before.
///
/// Calls lock the tables, then the tier. The tier's `pool` is for reading: its pages are
/// taken only by swaps.
#[pyclass(module = "kvpool._core", name = "HybridHostTier", frozen)]
pub struct PyHybridHostTier {
    inner: Mutex<HybridHostTier>,
    tables: Py<PyHybridTables>,
    pool: Py<PyPool>,
}

impl PyHybridHostTier {
    fn lock(&self) -> MutexGuard<'_, HybridHostTier> {
        // As `PyHybridTables::lock`: the core changes nothing before what can fail.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn lock_tables(&self) -> MutexGuard<'_, HybridTables> {
        self.tables.get().lock()
    }
}

#[pymethods]
impl PyHybridHostTier {
    #[new]
    #[pyo3(signature = (tables, num_blocks = None, *, memory_bytes = None, copy_method = "auto"))]
    fn new(
        py: Python<'_>,
        tables: Bound<'_, PyHybridTables>,
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
        let this = tables.get();
        // Pinning host memory takes time: let other threads run.
        let inner = py.detach(|| HybridHostTier::new(&this.lock(), size, method))?;
        let pool = Py::new(py, PyPool { inner: inner.host_pool().clone() })?;
        Ok(PyHybridHostTier { inner: Mutex::new(inner), tables: tables.unbind(), pool })
    }

    /// Moves the requests (all in the tables) to the host tier with every group's pages, all
    /// or none (`HostTierFullError` when the tier is short); returns {"num_requests",
    /// "num_blocks", "num_copies"}. On CUDA the copies run on the copy stream after the work
    /// queued on `stream` (default: the pool's); the device pages are reused only after.
    #[pyo3(signature = (request_ids, stream = None))]
    fn swap_out<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ids = self::request_ids(request_ids)?;
        let stream = stream.map(crate::stream::handle_of).transpose()?;
        let stats = py
            .detach(|| {
                let mut tables = self.lock_tables();
                // SAFETY: a caller's stream comes from `__cuda_stream__` of an object held for
                // the call (bare ints are refused), and its context is checked by the core.
                unsafe { self.lock().swap_out(&mut tables, &ids, stream) }
            })
            .map_err(PyKvError)?;
        swap_stats(py, stats)
    }

    /// Moves the requests (all swapped out) back into the tables, all or none
    /// (`OutOfBlocksError` when the device pool is short). Kernels queued on `stream`
    /// (default: the pool's) after this call see their pages.
    #[pyo3(signature = (request_ids, stream = None))]
    fn swap_in<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ids = self::request_ids(request_ids)?;
        let stream = stream.map(crate::stream::handle_of).transpose()?;
        let stats = py
            .detach(|| {
                let mut tables = self.lock_tables();
                // SAFETY: as in `swap_out`.
                unsafe { self.lock().swap_in(&mut tables, &ids, stream) }
            })
            .map_err(PyKvError)?;
        swap_stats(py, stats)
    }

    /// Drops a swapped-out request (its host pages return once no copy uses them).
    fn free(&self, request_id: &Bound<'_, PyAny>) -> KvResult<()> {
        let rid = self::request_id(request_id)?;
        let mut tables = self.lock_tables();
        Ok(self.lock().free(&mut tables, rid)?)
    }

    /// Releases the pages of finished copies; returns (device, host) pages released.
    fn poll(&self) -> KvResult<(usize, usize)> {
        Ok(self.lock().poll()?)
    }

    /// Waits for every queued copy and releases every pending page; (device, host) released.
    fn wait(&self, py: Python<'_>) -> KvResult<(usize, usize)> {
        Ok(py.detach(|| self.lock().wait())?)
    }

    /// "device", "host", or None if neither tier holds the request.
    fn location(&self, request_id: &Bound<'_, PyAny>) -> KvResult<Option<&'static str>> {
        let rid = self::request_id(request_id)?;
        let tables = self.lock_tables();
        Ok(self.lock().location(&tables, rid).map(Tier::name))
    }

    /// `(num_tokens, next_query, pages)` of a swapped-out request: `pages` its host pages as
    /// int64 rows (group, page_index, page_id), group by group in page order.
    fn swapped<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
    ) -> KvResult<(usize, usize, Bound<'py, PyArray2<i64>>)> {
        let held = self.lock().swapped(self::request_id(request_id)?)?;
        Ok((held.num_tokens, held.next_query, request_pages_array(py, &held.pages)))
    }

    /// Swapped-out request ids, sorted.
    fn request_ids(&self) -> Vec<u64> {
        self.lock().request_ids()
    }

    /// Pages held back until their copy finishes: (device, host).
    #[getter]
    fn num_pending(&self) -> (usize, usize) {
        self.lock().num_pending()
    }
    /// The host pool, for reading (counts): its pages are the tier's.
    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyPool> {
        self.pool.clone_ref(py)
    }
    #[getter]
    fn tables(&self, py: Python<'_>) -> Py<PyHybridTables> {
        self.tables.clone_ref(py)
    }
    /// The copy stream (`__cuda_stream__`) of a CUDA pool's tier, None on the host.
    #[getter]
    fn copy_stream(slf: &Bound<'_, Self>) -> PyResult<Option<Py<crate::stream::CudaStream>>> {
        match slf.get().lock().copy_stream() {
            None => Ok(None),
            Some(handle) => {
                let owner = slf.clone().into_any().unbind();
                Py::new(slf.py(), crate::stream::CudaStream::new(owner, handle)).map(Some)
            }
        }
    }

    /// The tier's invariants with its tables (and the tables' own while no swap-out source
    /// is pending); raises `KvError` naming the first broken one.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            let tables = self.lock_tables();
            self.lock().check_invariants(&tables)
        })
        .map_err(|m| crate::errors::KvError::new_err(format!("invariant violated: {m}")))
    }

    fn __len__(&self) -> usize {
        self.lock().len()
    }
    fn __contains__(&self, request_id: &Bound<'_, PyAny>) -> bool {
        self::request_id(request_id).map(|r| self.lock().swapped(r).is_ok()).unwrap_or(false)
    }
    fn __repr__(&self) -> String {
        let tier = self.lock();
        let pool = tier.host_pool();
        format!(
            "HybridHostTier(len={}, num_blocks={}, num_free={})",
            tier.len(),
            pool.num_blocks(),
            pool.num_free()
        )
    }
}
