//! `HostTier`: a second pool of KV blocks in host memory, with the device pool's layout, and
//! whole requests moved between the two (design: `tier.md`).
//!
//! A request is on exactly one tier: in the block tables (device) or in the tier's own table
//! (host). `swap_out` moves requests from the tables to the host tier, `swap_in` back. Each
//! call validates everything, takes all the destination blocks in one all-or-nothing
//! allocation, queues the copies, and only then moves the requests; a failed call moves
//! nothing.
//!
//! On CUDA the copies are asynchronous. The source blocks of a swap are not freed at once but
//! kept *pending* until the copy's event has fired: a device block swapped out is handed out
//! again only after its bytes have left it, a host block swapped in only after they have
//! arrived. Every tier call releases what has completed (`poll` does only that); `wait`
//! blocks until everything has.
//!
//! The copies themselves (the plan of runs, memcpy or the CUDA copy stream) are
//! `block_copy`'s; the steps a swap takes around them (`copy.rs`) are shared with the
//! hybrid host tier (`hybrid/swap.rs`).

mod copy;

use std::sync::{Arc, Mutex, MutexGuard};

use rustc_hash::FxHashMap;

#[cfg(feature = "cuda")]
pub use crate::block_copy::CopyMethod;
pub use crate::block_copy::Run;
pub(crate) use copy::{check_distinct, compute_stream, copy_blocks, drop_refs};
pub(crate) use copy::{release_completed, Copied, Direction, Pending, TierEngine};

use crate::block_copy::Engine;
use crate::error::CoreError;
use crate::pool::{Owner, Pool, PoolSize, RefHolder};
use crate::tables::BlockTables;

/// Where a request's KV is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Device,
    Host,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
        }
    }
}

/// What one swap moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwapStats {
    pub num_requests: usize,
    pub num_blocks: usize,
    /// Contiguous runs, each one copy (or one entry of a batched copy).
    pub num_copies: usize,
}

/// A swapped-out request: its tokens and its host blocks in logical order.
struct Swapped {
    num_tokens: usize,
    blocks: Vec<u32>,
}

#[derive(Default)]
struct TierState {
    swapped: FxHashMap<u64, Swapped>,
    pending: Vec<Pending>,
}

type SharedState = Arc<Mutex<TierState>>;

fn lock(state: &SharedState) -> MutexGuard<'_, TierState> {
    // Every update completes without panicking, so a poisoned state is still consistent.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

pub struct HostTier {
    tables: Arc<BlockTables>,
    host_pool: Arc<Pool>,
    engine: Engine,
    state: SharedState,
    /// The reference holders registered with the two pools (the pools keep weak references).
    _holders: [Arc<dyn RefHolder>; 2],
}

impl HostTier {
    /// A host tier of `size` for the requests of `tables`: pinned memory for a CUDA device
    /// pool (copies on a copy stream, queued with `method`), plain host memory for a host pool.
    #[cfg(feature = "cuda")]
    pub fn new(
        tables: Arc<BlockTables>,
        size: PoolSize,
        method: CopyMethod,
    ) -> Result<Self, CoreError> {
        tables.pool().require_memory("a host tier")?;
        let TierEngine { pinned_for, engine } = TierEngine::new(tables.pool(), method)?;
        Self::with_engine(tables, size, pinned_for, engine)
    }

    /// A host tier of `size` for the requests of `tables` (a host pool: no CUDA in this build).
    #[cfg(not(feature = "cuda"))]
    pub fn new(tables: Arc<BlockTables>, size: PoolSize) -> Result<Self, CoreError> {
        tables.pool().require_memory("a host tier")?;
        let TierEngine { pinned_for, engine } = TierEngine::new(tables.pool())?;
        Self::with_engine(tables, size, pinned_for, engine)
    }

    fn with_engine(
        tables: Arc<BlockTables>,
        size: PoolSize,
        pinned_for: Option<usize>,
        engine: Engine,
    ) -> Result<Self, CoreError> {
        let layout = *tables.pool().layout()?;
        let host_pool = Arc::new(Pool::new_host_tier(layout, size, pinned_for)?);
        Ok(Self::assemble(tables, host_pool, engine))
    }

    fn assemble(tables: Arc<BlockTables>, host_pool: Arc<Pool>, engine: Engine) -> Self {
        let state = SharedState::default();
        let device_refs: Arc<dyn RefHolder> = Arc::new(PendingDeviceRefs(state.clone()));
        let host_refs: Arc<dyn RefHolder> = Arc::new(HostRefs(state.clone()));
        tables.pool().register_ref_holder(Arc::downgrade(&device_refs));
        host_pool.register_ref_holder(Arc::downgrade(&host_refs));
        HostTier { tables, host_pool, engine, state, _holders: [device_refs, host_refs] }
    }

    pub fn tables(&self) -> &Arc<BlockTables> {
        &self.tables
    }
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

    /// The compute stream copies are ordered after (and a swap-in is ordered before):
    /// `stream`, or the device pool's own.
    ///
    /// # Safety
    /// `stream`, if given, is a live CUDA stream.
    unsafe fn compute_stream(&self, stream: Option<u64>) -> Result<u64, CoreError> {
        // SAFETY: forwarded from the caller.
        unsafe { compute_stream(&self.engine, self.tables.pool(), stream) }
    }

    /// Moves `request_ids` (all in the block tables) to the host tier, all or none. Their
    /// device blocks return to the device pool once the copy has finished (see `poll`).
    ///
    /// # Safety
    /// `stream`, if given, is a live CUDA stream (the pool's context is checked here): the
    /// copies run after the work queued on it so far.
    pub unsafe fn swap_out(
        &self,
        request_ids: &[u64],
        stream: Option<u64>,
    ) -> Result<SwapStats, CoreError> {
        // SAFETY: the caller's contract.
        let compute = unsafe { self.compute_stream(stream) }?;
        let mut ts = lock(&self.state);
        self.release_completed(&mut ts)?;
        let mut st = self.tables.lock();
        check_distinct(request_ids)?;
        let mut moving = Vec::with_capacity(request_ids.len());
        for &request_id in request_ids {
            if ts.swapped.contains_key(&request_id) {
                return Err(CoreError::WrongTier {
                    request_id,
                    tier: Tier::Host.name(),
                    operation: "swap out",
                });
            }
            let (num_tokens, blocks) = self
                .tables
                .row_of_request(&st, request_id)
                .ok_or(CoreError::UnknownRequest { request_id })?;
            moving.push((request_id, num_tokens, blocks));
        }
        let sources: Vec<u32> = moving.iter().flat_map(|(_, _, b)| b.iter().copied()).collect();
        // SAFETY: the sources are device blocks the rows hold, kept allocated (pending below)
        // until `done` completes; `compute` came from `compute_stream`.
        let Copied { dests, num_copies, done } = unsafe {
            copy_blocks(
                &self.engine,
                self.tables.pool(),
                &self.host_pool,
                &sources,
                Owner::Tables,
                compute,
                Direction::Out,
            )
        }?;
        // Commit: nothing below can fail.
        let mut dests = dests.into_iter();
        for (request_id, num_tokens, blocks) in &moving {
            self.tables.take_row(&mut st, *request_id);
            let host_blocks: Vec<u32> = dests.by_ref().take(blocks.len()).collect();
            ts.swapped
                .insert(*request_id, Swapped { num_tokens: *num_tokens, blocks: host_blocks });
        }
        drop(st);
        let stats = SwapStats { num_requests: moving.len(), num_blocks: sources.len(), num_copies };
        ts.pending.push(Pending { done, device_blocks: sources, host_blocks: Vec::new() });
        self.release_completed(&mut ts)?;
        Ok(stats)
    }

    /// Moves `request_ids` (all swapped out) back into the block tables, all or none. Kernels
    /// queued on the compute stream (`stream` or the pool's) after this call see their blocks.
    ///
    /// # Safety
    /// As [`swap_out`](Self::swap_out).
    pub unsafe fn swap_in(
        &self,
        request_ids: &[u64],
        stream: Option<u64>,
    ) -> Result<SwapStats, CoreError> {
        // SAFETY: the caller's contract.
        let compute = unsafe { self.compute_stream(stream) }?;
        let mut ts = lock(&self.state);
        self.release_completed(&mut ts)?;
        let mut st = self.tables.lock();
        check_distinct(request_ids)?;
        for &request_id in request_ids {
            let swapped = match ts.swapped.get(&request_id) {
                Some(s) => s,
                None if self.tables.row_of_request(&st, request_id).is_some() => {
                    return Err(CoreError::WrongTier {
                        request_id,
                        tier: Tier::Device.name(),
                        operation: "swap in",
                    })
                }
                None => return Err(CoreError::UnknownRequest { request_id }),
            };
            self.tables.check_blocks_fit(request_id, swapped.num_tokens)?;
        }
        let rows = st.num_rows() + request_ids.len();
        if rows > self.tables.max_seqs() {
            return Err(CoreError::CapacityExceeded {
                what: "sequences (max_seqs) when swapping in".into(),
                requested: rows,
                limit: self.tables.max_seqs(),
            });
        }
        let sources: Vec<u32> =
            request_ids.iter().flat_map(|r| ts.swapped[r].blocks.iter().copied()).collect();
        // SAFETY: the sources are host blocks the swapped entries hold, kept allocated
        // (pending below) until `done` completes; `compute` came from `compute_stream`.
        let Copied { dests, num_copies, done } = unsafe {
            copy_blocks(
                &self.engine,
                &self.host_pool,
                self.tables.pool(),
                &sources,
                Owner::Tables,
                compute,
                Direction::In,
            )
        }?;
        // Commit: nothing below can fail.
        let mut dests = dests.into_iter();
        for &request_id in request_ids {
            let swapped = ts.swapped.remove(&request_id).expect("validated above");
            let blocks: Vec<u32> = dests.by_ref().take(swapped.blocks.len()).collect();
            self.tables.insert_row(&mut st, request_id, swapped.num_tokens, &blocks);
        }
        drop(st);
        let stats =
            SwapStats { num_requests: request_ids.len(), num_blocks: sources.len(), num_copies };
        ts.pending.push(Pending { done, device_blocks: Vec::new(), host_blocks: sources });
        self.release_completed(&mut ts)?;
        Ok(stats)
    }

    /// Drops a swapped-out request: its host blocks return to the tier once no copy uses them.
    pub fn free(&self, request_id: u64) -> Result<(), CoreError> {
        let mut ts = lock(&self.state);
        if !ts.swapped.contains_key(&request_id) {
            return Err(if self.tables.contains(request_id) {
                CoreError::WrongTier {
                    request_id,
                    tier: Tier::Device.name(),
                    operation: "free from the host tier",
                }
            } else {
                CoreError::UnknownRequest { request_id }
            });
        }
        // The swap-out that filled these blocks may still be writing them.
        let done = self.engine.mark()?;
        let swapped = ts.swapped.remove(&request_id).expect("checked above");
        self.tables.forget_swapped(request_id);
        ts.pending.push(Pending { done, device_blocks: Vec::new(), host_blocks: swapped.blocks });
        self.release_completed(&mut ts)?;
        Ok(())
    }

    /// Returns the source blocks of finished copies to their pools; the number released
    /// (device, host). Never blocks.
    pub fn poll(&self) -> Result<(usize, usize), CoreError> {
        self.release_completed(&mut lock(&self.state))
    }

    /// Waits for every queued copy, then releases every pending block.
    pub fn wait(&self) -> Result<(usize, usize), CoreError> {
        let mut ts = lock(&self.state);
        for pending in &ts.pending {
            pending.done.wait()?;
        }
        self.release_completed(&mut ts)
    }

    fn release_completed(&self, ts: &mut TierState) -> Result<(usize, usize), CoreError> {
        release_completed(&mut ts.pending, self.tables.pool(), &self.host_pool, Owner::Tables)
    }

    /// Which tier holds `request_id`, `None` if neither does.
    pub fn location(&self, request_id: u64) -> Option<Tier> {
        let ts = lock(&self.state);
        if ts.swapped.contains_key(&request_id) {
            Some(Tier::Host)
        } else if self.tables.contains(request_id) {
            Some(Tier::Device)
        } else {
            None
        }
    }

    /// The swapped-out requests, sorted.
    pub fn request_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = lock(&self.state).swapped.keys().copied().collect();
        ids.sort_unstable();
        ids
    }
    pub fn len(&self) -> usize {
        lock(&self.state).swapped.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Tokens and host blocks (logical order) of a swapped-out request.
    pub fn swapped(&self, request_id: u64) -> Result<(usize, Vec<u32>), CoreError> {
        let ts = lock(&self.state);
        let s = ts.swapped.get(&request_id).ok_or(CoreError::UnknownRequest { request_id })?;
        Ok((s.num_tokens, s.blocks.clone()))
    }
    /// Blocks held back until their copy finishes: (device, host).
    pub fn num_pending(&self) -> (usize, usize) {
        let ts = lock(&self.state);
        ts.pending
            .iter()
            .fold((0, 0), |(d, h), p| (d + p.device_blocks.len(), h + p.host_blocks.len()))
    }

    /// The tier's invariants, then the host pool's with exact references:
    ///
    /// - no request is both in the tables and swapped out;
    /// - a swapped request holds `ceil(num_tokens / block_size)` distinct host blocks;
    /// - every host block's ref_cnt equals the references the tier holds (swapped + pending).
    ///
    /// Exact only while no other thread uses the tier or its tables.
    pub fn check_invariants(&self) -> Result<(), String> {
        {
            let ts = lock(&self.state);
            let block_size = self.tables.pool().layout().expect("block tables' pool").block_size();
            for (&request_id, s) in &ts.swapped {
                if self.tables.contains(request_id) {
                    return Err(format!(
                        "request {request_id} is both in the tables and swapped out"
                    ));
                }
                if s.blocks.len() != s.num_tokens.div_ceil(block_size) {
                    return Err(format!(
                        "swapped request {request_id} holds {} blocks for {} tokens",
                        s.blocks.len(),
                        s.num_tokens
                    ));
                }
                let mut sorted = s.blocks.clone();
                sorted.sort_unstable();
                if sorted.windows(2).any(|w| w[0] == w[1]) {
                    return Err(format!("swapped request {request_id} holds a host block twice"));
                }
            }
        }
        // Outside our lock: the pool asks our holders, which take it.
        self.host_pool.check_invariants_with(true)
    }
}

impl Drop for HostTier {
    /// In-flight copies read or write both pools: wait for them, then give back every block
    /// (a pending device block to the device pool, which outlives the tier). The requests
    /// still swapped out are dropped as [`free`](HostTier::free) drops one: their KV goes
    /// with the tier's memory and their ids are free in the block tables again, so a new
    /// request may take them (a drop cannot be refused, and no other tier could take them
    /// back).
    fn drop(&mut self) {
        let _ = self.wait();
        let mut ts = lock(&self.state);
        for (request_id, swapped) in ts.swapped.drain() {
            self.tables.forget_swapped(request_id);
            drop_refs(&self.host_pool, &swapped.blocks, Owner::Tables);
        }
    }
}

/// The device-pool references a tier holds: source blocks of swap-outs in flight.
struct PendingDeviceRefs(SharedState);

impl RefHolder for PendingDeviceRefs {
    fn count_refs(&self, counts: &mut [u32]) {
        for p in &lock(&self.0).pending {
            for &b in &p.device_blocks {
                if let Some(c) = counts.get_mut(b as usize) {
                    *c += 1;
                }
            }
        }
    }
}

/// The host-pool references a tier holds: swapped requests' blocks, and swap-in sources in flight.
struct HostRefs(SharedState);

impl RefHolder for HostRefs {
    fn count_refs(&self, counts: &mut [u32]) {
        let ts = lock(&self.0);
        let held = ts
            .swapped
            .values()
            .flat_map(|s| &s.blocks)
            .chain(ts.pending.iter().flat_map(|p| &p.host_blocks));
        for &b in held {
            if let Some(c) = counts.get_mut(b as usize) {
                *c += 1;
            }
        }
    }
}
