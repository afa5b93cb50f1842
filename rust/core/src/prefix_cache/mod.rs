//! The prefix cache: full blocks keyed by a hash of their content and of everything before
//! them, so a new request whose prompt starts like an earlier one reuses that KV instead
//! of computing it (design: `prefix_cache.md`).
//!
//! - [`hash`]: the keyed BLAKE3 chain (per-pool random key, per-request salt and extra keys).
//! - [`index`]: the hash -> block map and the evictable list (plain data, behind one mutex).
//! - [`lru`]: the evictable list itself, O(1) push, revive and evict.
//! - [`events`]: the opt-in queue of KV events for cache-aware routers.
//! - [`spill`]: what the cache asks of a second tier that evicted blocks spill to (the
//!   pool owns that tier, `pool/spill.rs`, and passes it to the calls that evict or hit).
//! - [`stats`]: the counters.
//!
//! A block is in exactly one of three states:
//!
//! ```text
//!            alloc (lock-free)              store (sole holder, block full)
//!   free  ----------------------->  used  ------------------------------>  used + cached
//!     ^                             |  ^                                      |   ^
//!     |  last ref dropped           |  |                    last ref dropped  |   | hit (revive)
//!     +-----------------------------+  |                                      v   |
//!     |                                +------ evict (hash dropped) ----  evictable
//!     +------------------------------- reset ------------------------------------+
//! ```
//!
//! `num_free + num_evictable + num_used == num_blocks`. The free list is never touched by
//! the cache except to push back blocks it drops on a reset or a failed call; allocation
//! tries the lock-free free list first and comes here only when it runs short.

pub mod events;
pub mod hash;
pub mod index;
pub mod lru;
pub mod spill;
pub mod stats;
mod tagged;

use std::sync::{Mutex, MutexGuard};

use crate::error::CoreError;
use crate::sync::{AtomicBool, AtomicUsize, Ordering};
use crate::zeroed::zeroed_atomic_bools;
pub use events::{EventBatch, KvEvent, Medium, SequencedEvent, DEFAULT_MAX_QUEUED_EVENTS};
pub use hash::{BlockHash, BlockHasher};
use index::CacheIndex;
pub use spill::SpillTarget;
pub use stats::PrefixCacheStats;

/// What the cache needs from the allocator: reference counts and the free list. Every
/// method but `pop_free` and `push_free` is called with the cache's lock held.
pub trait BlockRefs {
    /// Blocks that exist.
    fn num_blocks(&self) -> usize;
    /// Ids on the free list now.
    fn num_free(&self) -> usize;
    fn ref_cnt(&self, id: u32) -> u32;
    /// Gives a block nobody references (an evictable block the caller just took off the
    /// evictable list) its first reference.
    fn set_first_ref(&self, id: u32);
    /// Adds a reference to a block that has some, fewer than [`MAX_REF_CNT`](crate::MAX_REF_CNT),
    /// and cannot lose its last meanwhile.
    fn add_ref(&self, id: u32);
    /// Drops one reference unless there is none; returns the count left.
    fn drop_ref(&self, id: u32) -> Option<u32>;
    /// Pops exactly `out.len()` ids (each with ref count 1) or none; on failure, how many
    /// were free.
    fn pop_free(&self, out: &mut [u32]) -> Result<(), usize>;
    /// Returns blocks nobody references (ref count 0) to the free list.
    fn push_free(&self, ids: &[u32]);
}

/// What an add found in the cache and what it allocated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixAlloc {
    /// The cached blocks of the prompt's head, in order (now referenced by the caller).
    pub hits: Vec<u32>,
    /// How many of `fresh`, from the front, hold the blocks after `hits` copied back from the
    /// host tier (hits too: their KV need not be computed; the caller caches them again).
    pub swapped_in: usize,
    /// Fresh blocks for the rest.
    pub fresh: Vec<u32>,
}

/// What a side-effect-free [`PrefixCache::lookup`] found: a prompt's head cached in the
/// pool, then the blocks after it that the host tier holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixLookup {
    pub pool_blocks: usize,
    pub host_blocks: usize,
}

impl PrefixLookup {
    /// Blocks whose KV need not be computed.
    pub fn num_blocks(&self) -> usize {
        self.pool_blocks + self.host_blocks
    }
}

/// One cached block as a snapshot reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotBlock {
    pub hash: BlockHash,
    /// The block before it in the request that stored it (`None` for a first block, and for
    /// host-tier blocks, which events report without one too).
    pub parent: Option<BlockHash>,
    pub medium: Medium,
    /// The KV group, as in the events (0 for a uniform pool).
    pub group: u32,
}

/// Every cached block, consistent with the event numbered `seq`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheSnapshot {
    pub seq: u64,
    pub block_size: usize,
    pub blocks: Vec<SnapshotBlock>,
}

/// One block a request just filled. Its `block_size` tokens are `tokens[tokens_at..]` of
/// the slice passed to [`PrefixCache::store`] with it.
pub struct FilledBlock {
    pub block_id: u32,
    pub hash: BlockHash,
    /// The hash of the request's block before it (None for a request's first block).
    pub parent: Option<BlockHash>,
    pub tokens_at: usize,
    /// The request's LoRA adapter, reported in KV events.
    pub lora_id: Option<u64>,
}

pub struct PrefixCache {
    hasher: BlockHasher,
    block_size: usize,
    index: Mutex<CacheIndex>,
    /// `cached[b]`: block `b` has a hash. Set only by the block's sole holder and cleared
    /// only while nobody holds it (eviction, reset), so a holder dropping its reference can
    /// read it without the lock to pick the lock-free path or the cached one.
    cached: Box<[AtomicBool]>,
    /// The evictable list's length, readable without the lock (pool counts).
    num_evictable: AtomicUsize,
    /// The most blocks referenced at once (evictable blocks are not in use: vLLM's usage
    /// counts them as free). The pool samples it after every allocation and hit.
    used_high_water: AtomicUsize,
}

impl PrefixCache {
    /// A cache for a pool of `num_blocks` blocks that may grow to `max_num_blocks`. The
    /// per-block flags are sized for `max_num_blocks` but lazily committed (`zeroed.rs`);
    /// the index covers `num_blocks` and grows with the pool ([`grow_to`](Self::grow_to)).
    /// Every array is allocated fallibly: `OutOfMemory`, never an abort.
    pub fn new(
        max_num_blocks: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, CoreError> {
        Self::with_hasher(max_num_blocks, num_blocks, block_size, BlockHasher::new_random()?)
    }

    pub fn with_hasher(
        max_num_blocks: usize,
        num_blocks: usize,
        block_size: usize,
        hasher: BlockHasher,
    ) -> Result<Self, CoreError> {
        Ok(PrefixCache {
            hasher,
            block_size,
            index: Mutex::new(CacheIndex::new(num_blocks.min(max_num_blocks))?),
            cached: zeroed_atomic_bools(max_num_blocks)?,
            num_evictable: AtomicUsize::new(0),
            used_high_water: AtomicUsize::new(0),
        })
    }

    /// Makes room in the index for ids below `num_blocks` (a growable pool calls it before
    /// the new ids can be allocated). `OutOfMemory` changes nothing.
    pub fn grow_to(&self, num_blocks: usize) -> Result<(), CoreError> {
        self.lock().grow_to(num_blocks.min(self.cached.len()))
    }

    /// Ids the index covers now (its metadata grows with the pool's mapped blocks).
    pub fn num_ids(&self) -> usize {
        self.lock().num_ids()
    }

    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    fn lock(&self) -> MutexGuard<'_, CacheIndex> {
        // Every critical section leaves the index consistent before anything can panic.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `id` is cached. Exact for a block the caller holds a reference to.
    pub fn is_cached(&self, id: u32) -> bool {
        self.cached[id as usize].load(Ordering::Acquire)
    }
    /// Evictable blocks now (a snapshot under concurrency).
    pub fn num_evictable(&self) -> usize {
        self.num_evictable.load(Ordering::Acquire)
    }

    /// Raises the high-water mark of referenced blocks to `num_used` if that is higher;
    /// returns the mark.
    pub fn raise_used_high_water(&self, num_used: usize) -> usize {
        // A load first: the shared line is written only when the mark actually rises.
        let mark = self.used_high_water.load(Ordering::Relaxed);
        if num_used > mark {
            self.used_high_water.fetch_max(num_used, Ordering::Relaxed).max(num_used)
        } else {
            mark
        }
    }

    /// The add path: references the longest cached prefix of `hashes` and allocates
    /// `total_blocks - hits` fresh blocks (free list first, then evicting the least
    /// recently used blocks that are not among the hits), all or nothing. `query_tokens`
    /// is the prompt length, counted in the stats on success. With a second tier `spill`,
    /// the blocks after the hits that it holds are copied back, and evicted blocks spill.
    pub fn alloc_with_prefix(
        &self,
        refs: &dyn BlockRefs,
        spill: Option<&dyn SpillTarget>,
        hashes: &[BlockHash],
        total_blocks: usize,
        query_tokens: usize,
    ) -> Result<PrefixAlloc, CoreError> {
        let mut idx = self.lock();
        let hits = Self::pool_hits(&idx, refs, hashes, total_blocks);
        let host_hits = match spill {
            Some(tier) => tier.lookup_run(&hashes[hits.len()..total_blocks.min(hashes.len())]),
            None => Vec::new(),
        };
        let hits_evictable = hits.iter().filter(|&&id| idx.is_evictable(id)).count();
        let mut fresh = vec![0u32; total_blocks - hits.len()];
        let from_free = self.pop_some_free(refs, &mut fresh);
        let to_evict = fresh.len() - from_free;
        let evictable = idx.num_evictable() - hits_evictable;
        if to_evict > evictable {
            refs.push_free(&fresh[..from_free]);
            return Err(CoreError::OutOfBlocks {
                requested: fresh.len(),
                free: from_free + evictable,
                num_blocks: refs.num_blocks(),
            });
        }
        // Commit: nothing below can fail. Hits first, so that no eviction takes one (and
        // host hits off the host tier, so that no spill drops one).
        for &id in &hits {
            if idx.revive(id) {
                refs.set_first_ref(id);
            } else {
                refs.add_ref(id);
            }
        }
        let tier = spill.filter(|_| !host_hits.is_empty());
        if let Some(tier) = tier {
            tier.take(&host_hits, &mut idx.events);
        }
        self.evict_into(refs, spill, &mut idx, &mut fresh[from_free..]);
        let swapped_in = match tier {
            Some(tier) if tier.swap_in(&host_hits, &fresh[..host_hits.len()]) => host_hits.len(),
            _ => 0,
        };
        idx.record_query(query_tokens, (hits.len() + swapped_in) * self.block_size);
        self.num_evictable.store(idx.num_evictable(), Ordering::Release);
        Ok(PrefixAlloc { hits, swapped_in, fresh })
    }

    /// The cached blocks of the longest prefix of `hashes` that a hit would reference, at
    /// most `total_blocks`. A block already at the most references a block can hold ends the
    /// hits: the rest is allocated fresh (shares stop one below it, so the check holds until
    /// the commit).
    fn pool_hits(
        idx: &CacheIndex,
        refs: &dyn BlockRefs,
        hashes: &[BlockHash],
        total_blocks: usize,
    ) -> Vec<u32> {
        hashes
            .iter()
            .map_while(|h| idx.lookup(h))
            .take(total_blocks)
            .take_while(|&id| refs.ref_cnt(id) < crate::MAX_REF_CNT)
            .collect()
    }

    /// What [`alloc_with_prefix`](Self::alloc_with_prefix) over `hashes` would find now, and
    /// nothing else: no reference is taken, no block moves on the evictable list, no event
    /// is queued and no counter changes (vLLM's `get_computed_blocks`, without its side
    /// effects). Host-tier hits are those a swap-in would copy back if it succeeds.
    pub fn lookup(
        &self,
        refs: &dyn BlockRefs,
        spill: Option<&dyn SpillTarget>,
        hashes: &[BlockHash],
    ) -> PrefixLookup {
        let idx = self.lock();
        let pool_blocks = Self::pool_hits(&idx, refs, hashes, hashes.len()).len();
        let host_blocks = spill.map_or(0, |tier| tier.lookup_run(&hashes[pool_blocks..]).len());
        PrefixLookup { pool_blocks, host_blocks }
    }

    /// The allocation slow path: fills `out` from the free list and, for what it lacks, by
    /// evicting (spilling to `spill`, if given), all or nothing.
    pub fn alloc_evicting(
        &self,
        refs: &dyn BlockRefs,
        spill: Option<&dyn SpillTarget>,
        out: &mut [u32],
    ) -> Result<(), CoreError> {
        let mut idx = self.lock();
        let from_free = self.pop_some_free(refs, out);
        if out.len() - from_free > idx.num_evictable() {
            refs.push_free(&out[..from_free]);
            return Err(CoreError::OutOfBlocks {
                requested: out.len(),
                free: from_free + idx.num_evictable(),
                num_blocks: refs.num_blocks(),
            });
        }
        self.evict_into(refs, spill, &mut idx, &mut out[from_free..]);
        self.num_evictable.store(idx.num_evictable(), Ordering::Release);
        Ok(())
    }

    /// Pops as many of `out.len()` ids as the free list holds into the front of `out`;
    /// returns how many. Other threads may pop meanwhile, so it retries with what is there.
    fn pop_some_free(&self, refs: &dyn BlockRefs, out: &mut [u32]) -> usize {
        loop {
            let n = refs.num_free().min(out.len());
            if refs.pop_free(&mut out[..n]).is_ok() {
                return n;
            }
        }
    }

    /// Evicts one block per entry of `out` (the caller checked there are enough) and hands
    /// each out with one reference; queues one `BlockRemoved` for them. With a host tier,
    /// their content spills there first.
    fn evict_into(
        &self,
        refs: &dyn BlockRefs,
        spill: Option<&dyn SpillTarget>,
        idx: &mut CacheIndex,
        out: &mut [u32],
    ) {
        if out.is_empty() {
            return;
        }
        let mut evicted = Vec::with_capacity(out.len());
        for slot in out.iter_mut() {
            let (id, hash) = idx.evict().expect("the caller counted the evictable blocks");
            self.cached[id as usize].store(false, Ordering::Release);
            refs.set_first_ref(id);
            evicted.push((id, hash));
            *slot = id;
        }
        idx.events.push(KvEvent::BlockRemoved {
            group: 0,
            block_hashes: evicted.iter().map(|&(_, h)| h).collect(),
            medium: Medium::Pool,
        });
        if let Some(tier) = spill {
            tier.spill(&evicted, &mut idx.events);
        }
    }

    /// Evicts every evictable block above both the highest referenced block and `keep_below`
    /// (a shrink then releases their chunks); with a host tier they spill there. Returns how
    /// many went back to the free list.
    pub fn evict_above(
        &self,
        refs: &dyn BlockRefs,
        spill: Option<&dyn SpillTarget>,
        keep_below: usize,
    ) -> usize {
        let mut idx = self.lock();
        let num_blocks = refs.num_blocks();
        let live_end = (0..num_blocks as u32)
            .rev()
            .find(|&id| refs.ref_cnt(id) > 0)
            .map_or(0, |id| id as usize + 1);
        let above = live_end.max(keep_below);
        let ids: Vec<u32> = idx.evictable().filter(|&id| id as usize >= above).collect();
        if ids.is_empty() {
            return 0;
        }
        let evicted: Vec<(u32, BlockHash)> =
            ids.iter().map(|&id| (id, idx.evict_block(id))).collect();
        for &id in &ids {
            self.cached[id as usize].store(false, Ordering::Release);
        }
        idx.events.push(KvEvent::BlockRemoved {
            group: 0,
            block_hashes: evicted.iter().map(|&(_, h)| h).collect(),
            medium: Medium::Pool,
        });
        if let Some(tier) = spill {
            tier.spill(&evicted, &mut idx.events);
        }
        refs.push_free(&ids);
        self.num_evictable.store(idx.num_evictable(), Ordering::Release);
        ids.len()
    }

    /// Caches blocks that requests just filled, each the sole reference of its holder, under
    /// one acquisition of the lock (a decode step fills blocks of many requests at once). A
    /// block whose content another block holds already stays uncached. Queues one
    /// `BlockStored` per run of stored blocks that chain (each the parent of the next, one
    /// LoRA). Returns how many were stored.
    pub fn store(&self, blocks: &[FilledBlock], tokens: &[u32]) -> usize {
        let bs = self.block_size;
        let mut idx = self.lock();
        let mut stored = 0;
        let mut run: Option<KvEvent> = None;
        for block in blocks {
            let inserted = idx.insert_with_parent(block.block_id, block.hash, block.parent);
            if inserted {
                self.cached[block.block_id as usize].store(true, Ordering::Release);
                stored += 1;
            }
            if !idx.events.enabled() {
                continue;
            }
            let chains = matches!(&run, Some(KvEvent::BlockStored { block_hashes, lora_id, .. })
                if block_hashes.last().copied() == block.parent && *lora_id == block.lora_id);
            if !(inserted && chains) {
                if let Some(event) = run.take() {
                    idx.events.push(event);
                }
            }
            if !inserted {
                continue;
            }
            let block_tokens = &tokens[block.tokens_at..block.tokens_at + bs];
            match run.as_mut() {
                Some(KvEvent::BlockStored { block_hashes, token_ids, .. }) => {
                    block_hashes.push(block.hash);
                    token_ids.extend_from_slice(block_tokens);
                }
                _ => {
                    run = Some(KvEvent::BlockStored {
                        group: 0,
                        block_hashes: vec![block.hash],
                        parent_block_hash: block.parent,
                        token_ids: block_tokens.to_vec(),
                        block_size: bs,
                        lora_id: block.lora_id,
                        medium: Medium::Pool,
                    })
                }
            }
        }
        if let Some(event) = run {
            idx.events.push(event);
        }
        stored
    }

    /// Drops one reference to each of `ids` (all cached, each referenced by the caller),
    /// given in the request's order. Blocks left unreferenced become evictable, the last
    /// block first: among one request's blocks, its tail is evicted before its head.
    pub fn release(&self, refs: &dyn BlockRefs, ids: &[u32]) {
        let mut idx = self.lock();
        for &id in ids.iter().rev() {
            debug_assert!(self.is_cached(id));
            if refs.drop_ref(id) == Some(0) {
                idx.push_evictable(id);
            }
        }
        self.num_evictable.store(idx.num_evictable(), Ordering::Release);
    }

    /// Drops every cached block (after a weight update, say) and returns how many went
    /// back to the free list. Refuses, changing nothing, while any cached block is
    /// referenced: its KV would be stale too. A second tier `spill` is cleared with it.
    pub fn reset(
        &self,
        refs: &dyn BlockRefs,
        spill: Option<&dyn SpillTarget>,
    ) -> Result<usize, CoreError> {
        let mut idx = self.lock();
        let in_use = idx.num_cached() - idx.num_evictable();
        if in_use > 0 {
            return Err(CoreError::CacheInUse { in_use });
        }
        let ids = idx.clear();
        // `AllBlocksCleared` covers every tier, the external one too: its blocks are as
        // stale, and its owner drops them (the disk tier's `PrefixDiskCache.reset`).
        idx.external.clear();
        for &id in &ids {
            self.cached[id as usize].store(false, Ordering::Release);
        }
        refs.push_free(&ids);
        if let Some(tier) = spill {
            tier.clear();
        }
        self.num_evictable.store(0, Ordering::Release);
        Ok(ids.len())
    }

    pub fn set_events_enabled(&self, enabled: bool) {
        self.lock().events.set_enabled(enabled);
    }
    pub fn events_enabled(&self) -> bool {
        self.lock().events.enabled()
    }
    /// Every queued event, oldest first.
    pub fn drain_events(&self) -> Vec<KvEvent> {
        self.lock().events.drain()
    }
    /// Every queued event with its sequence number, and what was dropped since the last
    /// drain (see [`EventBatch`]).
    pub fn drain_event_batch(&self) -> EventBatch {
        self.lock().events.drain_batch()
    }
    /// Sets how many events the queue keeps before it drops its oldest (at least 1).
    pub fn set_max_queued_events(&self, capacity: usize) {
        self.lock().events.set_capacity(capacity);
    }
    pub fn max_queued_events(&self) -> usize {
        self.lock().events.capacity()
    }
    /// Events queued now.
    pub fn num_queued_events(&self) -> usize {
        self.lock().events.len()
    }

    /// Appends an event of a tier outside the core (`BlockStored` or `BlockRemoved` of
    /// medium `Disk`, group 0) to the queue, numbered as the core numbers its own, so a
    /// router reads one ordered stream; and keeps the set of blocks that tier holds, which
    /// [`snapshot`](Self::snapshot) lists. Returns the event's `seq` (0 while events are
    /// off: the set is kept all the same). Any other event is `InvalidArgument`, and nothing
    /// changes.
    pub fn record_external_event(&self, event: KvEvent) -> Result<u64, CoreError> {
        let (stored, hashes) = match &event {
            KvEvent::BlockStored { medium: Medium::Disk, group: 0, block_hashes, .. } => {
                (true, block_hashes)
            }
            KvEvent::BlockRemoved { medium: Medium::Disk, group: 0, block_hashes } => {
                (false, block_hashes)
            }
            _ => {
                return Err(CoreError::InvalidArgument(
                    "only BlockStored / BlockRemoved of medium \"disk\", group 0, can be \
                     appended: the core makes its own tiers' events"
                        .into(),
                ))
            }
        };
        let mut idx = self.lock();
        for &hash in hashes {
            if stored {
                idx.external.insert(hash);
            } else {
                idx.external.remove(&hash);
            }
        }
        let enabled = idx.events.enabled();
        idx.events.push(event);
        Ok(if enabled { idx.events.last_seq() } else { 0 })
    }

    /// Blocks the external tier holds, as its appended events say.
    pub fn num_external_blocks(&self) -> usize {
        self.lock().external.len()
    }

    /// Every block cached now, on both tiers, with the sequence number of the newest event
    /// it reflects: a router that loads it and then applies the events with a greater
    /// `seq` holds what the cache holds. Taken under the cache's lock (and the host tier's,
    /// nested as every call nests them), so no event falls between the two.
    pub fn snapshot(&self, spill: Option<&dyn SpillTarget>) -> CacheSnapshot {
        let idx = self.lock();
        let mut blocks: Vec<SnapshotBlock> = idx
            .cached_blocks()
            .into_iter()
            .map(|(hash, parent)| SnapshotBlock { hash, parent, medium: Medium::Pool, group: 0 })
            .collect();
        if let Some(tier) = spill {
            blocks.extend(tier.cached_hashes().into_iter().map(|hash| SnapshotBlock {
                hash,
                parent: None,
                medium: Medium::HostTier,
                group: 0,
            }));
        }
        blocks.extend(idx.external.iter().map(|&hash| SnapshotBlock {
            hash,
            parent: None,
            medium: Medium::Disk,
            group: 0,
        }));
        CacheSnapshot { seq: idx.events.last_seq(), block_size: self.block_size, blocks }
    }

    /// The pool tier's counters (the host fields are the pool's to fill in: it owns the
    /// second tier, see `Pool::prefix_cache_stats`).
    pub fn stats(&self) -> PrefixCacheStats {
        self.lock().stats()
    }

    /// Evictable ids, least recently used first (tests and invariant checks).
    pub fn evictable_ids(&self) -> Vec<u32> {
        self.lock().evictable().collect()
    }

    /// The index's own checks, plus: the lock-free flags and counter agree with it, and the
    /// index covers every block that exists (ids past it are never cached: their flags are
    /// not read, so a huge capacity costs nothing here).
    pub fn check_invariants(&self, refs: &dyn BlockRefs) -> Result<(), String> {
        let idx = self.lock();
        idx.check(|id| refs.ref_cnt(id))?;
        if idx.num_ids() < refs.num_blocks() {
            return Err(format!(
                "the index covers {} ids, {} blocks exist",
                idx.num_ids(),
                refs.num_blocks()
            ));
        }
        for (id, flag) in self.cached[..idx.num_ids()].iter().enumerate() {
            if flag.load(Ordering::Acquire) != idx.hash_of(id as u32).is_some() {
                return Err(format!("block {id}: the cached flag disagrees with the map"));
            }
        }
        if self.num_evictable() != idx.num_evictable() {
            return Err(format!(
                "num_evictable {} != {} on the list",
                self.num_evictable(),
                idx.num_evictable()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
