//! `HybridHostTier`: a host tier for the requests of `HybridTables`. A swap moves every
//! group of a request (token pages and state slots) to a host pool with the same page bytes
//! and back, one copy per run of consecutive pages, all or nothing; on swap-in each group's
//! table is rebuilt with the `first_page` it had, so window-relative metadata is unchanged.
//!
//! It mirrors `tier/`'s `HostTier` and shares its steps (`tier/copy.rs`: the compute
//! stream, one direction's copy through `block_copy`, pending sources, dropping references).
//! Two differences: `HybridTables` are plain values changed through `&mut`, so the tier
//! takes them at each call instead of holding them; and the ids swapped out are a set the
//! tables share with their tiers (`SwappedIds`), so the tables refuse to reuse one and a
//! tier dropped with requests still swapped out gives their ids back.
//!
//! With prefix caching, the copies read every page, shared and cached ones included, and
//! the other holders and the cache keep theirs: the pages the request had cached stay in
//! the cache (evictable once the copies finish) and serve hits while it is away. Its hash
//! chain moves with it, chunks still to register included (the tokens of its last call,
//! which the tables do not know to have run), so after the swap-in those and its later
//! pages are cached from its new pages. A caller that knows the last step has run calls
//! `cache_computed` before the swap-out to keep that step's pages in the cache too.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use rustc_hash::{FxHashMap, FxHashSet};

#[cfg(feature = "cuda")]
use crate::block_copy::CopyMethod;
use crate::block_copy::Engine;
use crate::error::CoreError;
use crate::hybrid::spec::ModelKvSpec;
use crate::hybrid::tables::{HybridTables, RequestPages};
use crate::pool::{Owner, Pool, PoolSize};
use crate::tier::{
    check_distinct, compute_stream, copy_blocks, drop_refs, release_completed, Copied, Direction,
    Pending, SwapStats, Tier, TierEngine,
};

/// One page of a request, as a swap or a transfer moves it
/// ([`HybridTables::request_pages`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestPage {
    pub group: usize,
    /// The page's index in the group's page sequence: the token at position `p` of a token
    /// group is on page `p / block_size` (a window table starts past 0, at its
    /// `first_page`); a state slot's pages are 0, 1, ...
    pub page_index: usize,
    pub page_id: u32,
}

/// A request's tokens, first query still to run, and pages (in `request_pages` order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldPages {
    pub num_tokens: usize,
    pub next_query: usize,
    pub pages: Vec<RequestPage>,
}

/// The ids the host tiers of one `HybridTables` hold swapped out: one set, shared by the
/// tables (which refuse to add or fork into an id in it) and each of their tiers (which
/// put ids in and take them out, and take theirs out when dropped).
#[derive(Debug, Default, Clone)]
pub(super) struct SwappedIds(Arc<Mutex<FxHashSet<u64>>>);

impl SwappedIds {
    fn lock(&self) -> MutexGuard<'_, FxHashSet<u64>> {
        // Nothing panics while holding it (set operations only): a poisoned set is intact.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
    pub(super) fn contains(&self, request_id: u64) -> bool {
        self.lock().contains(&request_id)
    }
    fn insert(&self, request_id: u64) {
        self.lock().insert(request_id);
    }
    fn remove(&self, request_id: u64) {
        self.lock().remove(&request_id);
    }
    /// Whether both are the same tables' set.
    fn same(&self, other: &SwappedIds) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Every group of the swapped-out requests of one `HybridTables`, in host memory.
pub struct HybridHostTier {
    device_pool: Arc<Pool>,
    host_pool: Arc<Pool>,
    spec: ModelKvSpec,
    engine: Engine,
    /// Swapped-out requests as the tables held them, with host page ids.
    swapped: FxHashMap<u64, RequestPages>,
    /// The tables' set of swapped-out ids (`swapped`'s keys are in it).
    swapped_ids: SwappedIds,
    pending: Vec<Pending>,
}

impl HybridHostTier {
    /// A host tier of `size` pages for the requests of `tables`: pinned memory for a CUDA
    /// device pool (copies on a copy stream, queued with `method`), plain host memory for a
    /// host pool. Its pages have the device pool's geometry (the same page bytes).
    #[cfg(feature = "cuda")]
    pub fn new(
        tables: &HybridTables,
        size: PoolSize,
        method: CopyMethod,
    ) -> Result<Self, CoreError> {
        let TierEngine { pinned_for, engine } = TierEngine::new(tables.pool(), method)?;
        Self::with_engine(tables, size, pinned_for, engine)
    }

    /// A host tier of `size` pages for the requests of `tables` (a host pool: no CUDA in
    /// this build).
    #[cfg(not(feature = "cuda"))]
    pub fn new(tables: &HybridTables, size: PoolSize) -> Result<Self, CoreError> {
        let TierEngine { pinned_for, engine } = TierEngine::new(tables.pool())?;
        Self::with_engine(tables, size, pinned_for, engine)
    }

    fn with_engine(
        tables: &HybridTables,
        size: PoolSize,
        pinned_for: Option<usize>,
        engine: Engine,
    ) -> Result<Self, CoreError> {
        let device_pool = tables.pool().clone();
        let host_pool = Arc::new(Pool::new_host_tier(*device_pool.geometry(), size, pinned_for)?);
        Ok(HybridHostTier {
            device_pool,
            host_pool,
            spec: tables.spec().clone(),
            engine,
            swapped: FxHashMap::default(),
            swapped_ids: tables.swapped_out.clone(),
            pending: Vec::new(),
        })
    }

    pub fn device_pool(&self) -> &Arc<Pool> {
        &self.device_pool
    }
    /// The tier's pages; taken only by swaps (the plain block API refuses, and its pages are
    /// tagged as the hybrid tables', so `Pool::free` refuses them).
    pub fn host_pool(&self) -> &Arc<Pool> {
        &self.host_pool
    }
    /// The copy stream (CUDA), on which every swap's copies run.
    pub fn copy_stream(&self) -> Option<u64> {
        match &self.engine {
            Engine::Host => None,
            #[cfg(feature = "cuda")]
            Engine::Cuda(engine) => Some(engine.stream()),
        }
    }

    /// Moves `request_ids` (all in `tables`) to the host tier with every group's pages, all
    /// or none: host tier full is `HostTierFull`, and nothing changes. Their device pages
    /// return to the pool once the copy has finished (see [`poll`](Self::poll)); a page
    /// shared with a request left in the tables keeps that request's reference, and a cached
    /// page stays in the cache (evictable once copied). With prefix caching, the tokens of a
    /// request's last call are cached only at its next call after the swap-in, from its new
    /// pages; call `cache_computed` first to cache them now, from the pages left behind.
    ///
    /// # Safety
    /// `stream`, if given, is a live CUDA stream (the pool's context is checked here): the
    /// copies run after the work queued on it so far.
    pub unsafe fn swap_out(
        &mut self,
        tables: &mut HybridTables,
        request_ids: &[u64],
        stream: Option<u64>,
    ) -> Result<SwapStats, CoreError> {
        self.check_tables(tables)?;
        // SAFETY: the caller's contract.
        let compute = unsafe { compute_stream(&self.engine, &self.device_pool, stream) }?;
        self.release_completed()?;
        check_distinct(request_ids)?;
        let mut sources = Vec::new();
        for &request_id in request_ids {
            if self.swapped.contains_key(&request_id) {
                return Err(CoreError::WrongTier {
                    request_id,
                    tier: Tier::Host.name(),
                    operation: "swap out",
                });
            }
            sources.extend(tables.request_pages(request_id)?.iter().map(|p| p.page_id));
        }
        // SAFETY: the sources are device pages the tables hold, kept allocated (pending
        // below) until `done` completes; `compute` came from `compute_stream`.
        let Copied { dests, num_copies, done } = unsafe {
            copy_blocks(
                &self.engine,
                &self.device_pool,
                &self.host_pool,
                &sources,
                Owner::HybridTables,
                compute,
                Direction::Out,
            )
        }?;
        // Commit: nothing below can fail.
        let mut next = 0;
        for &request_id in request_ids {
            let request = tables.detach(request_id).expect("validated above");
            let num_pages = HybridTables::page_list(&request).len();
            let host = HybridTables::with_page_ids(request, &dests[next..next + num_pages]);
            next += num_pages;
            self.swapped.insert(request_id, host);
            self.swapped_ids.insert(request_id);
        }
        let stats =
            SwapStats { num_requests: request_ids.len(), num_blocks: sources.len(), num_copies };
        self.pending.push(Pending { done, device_blocks: sources, host_blocks: Vec::new() });
        self.release_completed()?;
        Ok(stats)
    }

    /// Moves `request_ids` (all swapped out) back into `tables`, all or none: device pool
    /// full is `OutOfBlocks` (a growable pool grows first; a prefix-caching pool evicts
    /// through the tables first), and nothing changes. Each group's table gets fresh pages
    /// at the page indices it had. Kernels queued on the compute stream (`stream` or the
    /// pool's) after this call see the pages.
    ///
    /// With prefix caching, a request keeps its hash chain through the swap: the pages it
    /// had cached stay cached under their old ids, evictable once the swap-out's copies
    /// finish, and its pages from there on are cached from its new ones at its next call.
    ///
    /// # Safety
    /// As [`swap_out`](Self::swap_out).
    pub unsafe fn swap_in(
        &mut self,
        tables: &mut HybridTables,
        request_ids: &[u64],
        stream: Option<u64>,
    ) -> Result<SwapStats, CoreError> {
        self.check_tables(tables)?;
        // SAFETY: the caller's contract.
        let compute = unsafe { compute_stream(&self.engine, &self.device_pool, stream) }?;
        self.release_completed()?;
        check_distinct(request_ids)?;
        let mut sources = Vec::new();
        for &request_id in request_ids {
            let on_device = tables.contains(request_id);
            match self.swapped.get(&request_id) {
                // Cannot happen through the tables (they refuse a swapped-out id); kept as a check.
                Some(_) if on_device => return Err(CoreError::DuplicateRequest { request_id }),
                Some(request) => {
                    sources.extend(HybridTables::page_list(request).iter().map(|p| p.page_id))
                }
                None if on_device => {
                    return Err(CoreError::WrongTier {
                        request_id,
                        tier: Tier::Device.name(),
                        operation: "swap in",
                    })
                }
                None => return Err(CoreError::UnknownRequest { request_id }),
            }
        }
        // With prefix caching the tables evict what the free list lacks themselves (the
        // pool's own eviction would leave their keys and per-group events behind); a pool
        // short even counting its evictable pages is refused here, changing nothing.
        tables.make_room(sources.len())?;
        // SAFETY: the sources are host pages the swapped requests hold, kept allocated
        // (pending below) until `done` completes; `compute` came from `compute_stream`.
        let Copied { dests, num_copies, done } = unsafe {
            copy_blocks(
                &self.engine,
                &self.host_pool,
                &self.device_pool,
                &sources,
                Owner::HybridTables,
                compute,
                Direction::In,
            )
        }?;
        // Commit: nothing below can fail.
        let mut next = 0;
        for &request_id in request_ids {
            let host = self.swapped.remove(&request_id).expect("validated above");
            self.swapped_ids.remove(request_id);
            let num_pages = HybridTables::page_list(&host).len();
            let request = HybridTables::with_page_ids(host, &dests[next..next + num_pages]);
            next += num_pages;
            tables.attach(request_id, request);
        }
        let stats =
            SwapStats { num_requests: request_ids.len(), num_blocks: sources.len(), num_copies };
        self.pending.push(Pending { done, device_blocks: Vec::new(), host_blocks: sources });
        self.release_completed()?;
        Ok(stats)
    }

    /// Drops a swapped-out request: its host pages return to the tier once no copy uses
    /// them. `tables` only name the refusal of a request that is on the device.
    pub fn free(&mut self, tables: &mut HybridTables, request_id: u64) -> Result<(), CoreError> {
        if !self.swapped.contains_key(&request_id) {
            return Err(if tables.contains(request_id) {
                CoreError::WrongTier {
                    request_id,
                    tier: Tier::Device.name(),
                    operation: "free from the host tier",
                }
            } else {
                CoreError::UnknownRequest { request_id }
            });
        }
        // The swap-out that filled these pages may still be writing them.
        let done = self.engine.mark()?;
        let host = self.swapped.remove(&request_id).expect("checked above");
        self.swapped_ids.remove(request_id);
        let host_blocks = HybridTables::page_list(&host).iter().map(|p| p.page_id).collect();
        self.pending.push(Pending { done, device_blocks: Vec::new(), host_blocks });
        self.release_completed()?;
        Ok(())
    }

    /// Returns the source pages of finished copies to their pools; the number released
    /// (device, host). Never blocks.
    pub fn poll(&mut self) -> Result<(usize, usize), CoreError> {
        self.release_completed()
    }

    /// Waits for every queued copy, then releases every pending page.
    pub fn wait(&mut self) -> Result<(usize, usize), CoreError> {
        for pending in &self.pending {
            pending.done.wait()?;
        }
        self.release_completed()
    }

    fn release_completed(&mut self) -> Result<(usize, usize), CoreError> {
        let (device, host) = (&self.device_pool, &self.host_pool);
        release_completed(&mut self.pending, device, host, Owner::HybridTables)
    }

    /// Which tier holds `request_id`, `None` if neither does.
    pub fn location(&self, tables: &HybridTables, request_id: u64) -> Option<Tier> {
        if self.swapped.contains_key(&request_id) {
            Some(Tier::Host)
        } else if tables.contains(request_id) {
            Some(Tier::Device)
        } else {
            None
        }
    }

    /// The swapped-out requests, sorted.
    pub fn request_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.swapped.keys().copied().collect();
        ids.sort_unstable();
        ids
    }
    pub fn len(&self) -> usize {
        self.swapped.len()
    }
    pub fn is_empty(&self) -> bool {
        self.swapped.is_empty()
    }
    /// A swapped-out request's tokens, first query still to run and host pages (in
    /// `request_pages` order).
    pub fn swapped(&self, request_id: u64) -> Result<HeldPages, CoreError> {
        let host = self.swapped.get(&request_id).ok_or(CoreError::UnknownRequest { request_id })?;
        Ok(HybridTables::held_pages(host))
    }
    /// Pages held back until their copy finishes: (device, host).
    pub fn num_pending(&self) -> (usize, usize) {
        self.pending
            .iter()
            .fold((0, 0), |(d, h), p| (d + p.device_blocks.len(), h + p.host_blocks.len()))
    }

    /// Refuses tables other than the ones the tier was made for (another pool, another
    /// model, or other tables over the same pool).
    fn check_tables(&self, tables: &HybridTables) -> Result<(), CoreError> {
        if !Arc::ptr_eq(tables.pool(), &self.device_pool)
            || tables.spec() != &self.spec
            || !tables.swapped_out.same(&self.swapped_ids)
        {
            return Err(CoreError::InvalidArgument(
                "these hybrid tables are not the ones this host tier was made for (another \
                 pool, another model, or other tables)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The tier's invariants with `tables`, with `live(r, g)` the pages request `r` keeps
    /// for group `g` ([`ModelKvSpec::live_pages`]):
    ///
    /// ```text
    /// no request is both in the tables and swapped out
    /// swapped r: its pages of group g have page indices live(r, g), in order; distinct
    /// host: refs(b) == ref_cnt(b)            refs: swapped requests' + pending swap-in sources
    /// host: refs(b) > 0  =>  owner(b) == HybridTables;  num_used == #{b : refs(b) > 0}
    /// device: ref_cnt(b) == table refs(b) + pending swap-out sources(b)
    /// ```
    ///
    /// and the tables' own ([`HybridTables::check_invariants`]) when no swap-out source is
    /// pending (they count exact references). Exact while nothing else uses either pool.
    pub fn check_invariants(&self, tables: &HybridTables) -> Result<(), String> {
        self.check_tables(tables).map_err(|e| e.to_string())?;
        let mut host_refs = vec![0u32; self.host_pool.num_blocks()];
        for (&request_id, host) in &self.swapped {
            if tables.contains(request_id) {
                return Err(format!("request {request_id} is both in the tables and swapped out"));
            }
            let held = HybridTables::held_pages(host);
            self.check_swapped_shape(request_id, &held)?;
            count(&mut host_refs, held.pages.iter().map(|p| p.page_id))?;
        }
        count(&mut host_refs, self.pending.iter().flat_map(|p| p.host_blocks.iter().copied()))?;
        check_refs(&self.host_pool, &host_refs, "host")?;
        let mut device_refs = vec![0u32; self.device_pool.num_blocks()];
        for (request_id, _, _) in tables.positions() {
            let pages = tables.request_pages(request_id).map_err(|e| e.to_string())?;
            count(&mut device_refs, pages.iter().map(|p| p.page_id))?;
        }
        let pending_out = self.pending.iter().flat_map(|p| p.device_blocks.iter().copied());
        count(&mut device_refs, pending_out)?;
        check_refs(&self.device_pool, &device_refs, "device")?;
        if self.num_pending().0 == 0 {
            tables.check_invariants()?;
        }
        Ok(())
    }

    /// A swapped request's pages cover exactly each group's live pages, in order, once.
    fn check_swapped_shape(&self, request_id: u64, held: &HeldPages) -> Result<(), String> {
        for group in 0..self.spec.num_groups() {
            let live = self
                .spec
                .live_pages(group, held.num_tokens, held.next_query)
                .map_err(|e| e.to_string())?;
            let indices: Vec<usize> =
                held.pages.iter().filter(|p| p.group == group).map(|p| p.page_index).collect();
            if !indices.iter().copied().eq(live.clone()) {
                return Err(format!(
                    "swapped request {request_id} group {group}: page indices {indices:?}, its \
                     live tokens need {live:?}"
                ));
            }
        }
        let mut ids: Vec<u32> = held.pages.iter().map(|p| p.page_id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err(format!("swapped request {request_id} holds a host page twice"));
        }
        Ok(())
    }
}

impl Drop for HybridHostTier {
    /// In-flight copies read or write both pools: wait for them, then give back every page
    /// (a pending device page to the device pool, which the tier keeps alive). The requests
    /// still swapped out are dropped: their KV goes with the tier's memory, and their ids
    /// are free for the tables again.
    fn drop(&mut self) {
        let _ = self.wait();
        for (request_id, host) in std::mem::take(&mut self.swapped) {
            self.swapped_ids.remove(request_id);
            let pages: Vec<u32> =
                HybridTables::page_list(&host).iter().map(|p| p.page_id).collect();
            drop_refs(&self.host_pool, &pages, Owner::HybridTables);
        }
    }
}

/// Adds one to `counts[id]` per id; an id past the pool is an error.
fn count(counts: &mut [u32], ids: impl Iterator<Item = u32>) -> Result<(), String> {
    for id in ids {
        *counts.get_mut(id as usize).ok_or_else(|| format!("page {id} is out of range"))? += 1;
    }
    Ok(())
}

/// `pool`'s own invariants, then: every page's ref count equals `refs`, a referenced page
/// is the hybrid tables', and the used count is the referenced pages'.
fn check_refs(pool: &Pool, refs: &[u32], name: &str) -> Result<(), String> {
    pool.check_invariants()?;
    let mut held = 0;
    for (page, &expected) in refs.iter().enumerate() {
        let ref_cnt = pool.ref_cnt(page as u32).map_err(|e| e.to_string())?;
        if ref_cnt != expected {
            return Err(format!(
                "{name} page {page}: {expected} references held, ref_cnt {ref_cnt}"
            ));
        }
        if expected > 0 && pool.owner(page as u32) != Owner::HybridTables {
            return Err(format!(
                "{name} page {page} is held by hybrid requests but tagged {:?}",
                pool.owner(page as u32)
            ));
        }
        held += (expected > 0) as usize;
    }
    if held != pool.num_used() {
        return Err(format!("{name}: {held} pages held, the pool has {} used", pool.num_used()));
    }
    Ok(())
}
