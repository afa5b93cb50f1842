//! The prefix cache's second tier, owned by the pool beside its cache: cached blocks the pool
//! evicts spill into host blocks (LRU there too) instead of being dropped, and a prefix hit
//! on a host-resident block is copied back into a fresh pool block (design:
//! `prefix_cache/prefix_cache.md`, "Second tier").
//!
//! Its blocks are a slab and an allocator of its own, not a `Pool`: nothing but this tier
//! uses them, and nothing references a host block: each one is free or cached (and then on
//! the host LRU), except for the moment a swap-in holds it between taking it off the LRU and
//! copying it. Every method is called with the pool cache's lock held, so the two tiers
//! change together.

use std::sync::{Mutex, MutexGuard};

use crate::allocator::BlockAllocator;
use crate::block_copy::{Endpoints, Engine, Run};
use crate::error::CoreError;
use crate::prefix_cache::events::{EventQueue, KvEvent, Medium};
use crate::prefix_cache::index::CacheIndex;
use crate::prefix_cache::{BlockHash, PrefixCacheStats};

use super::evicted::AttachedStage;
use crate::slab::{self, Slab};

pub(crate) struct SpillTier {
    slab: Box<dyn Slab>,
    blocks: BlockAllocator,
    engine: Engine,
    /// The pool's slab base and compute stream (0 on the host); neither moves (a growable
    /// pool maps its chunks in place).
    device_base: u64,
    compute_stream: u64,
    block_bytes: usize,
    block_size: usize,
    index: Mutex<CacheIndex>,
}

impl SpillTier {
    /// `num_blocks` host blocks of `block_bytes` (a pool's blocks, of `block_size` tokens as
    /// its prefix cache counts them), pinned for CUDA device `pinned_for`, copied to and from
    /// the pool slab at `device_base` by `engine`, ordered on `compute_stream`.
    pub(crate) fn new(
        block_bytes: usize,
        block_size: usize,
        num_blocks: usize,
        pinned_for: Option<usize>,
        engine: Engine,
        device_base: u64,
        compute_stream: u64,
    ) -> Result<Self, CoreError> {
        if num_blocks == 0 || num_blocks > crate::MAX_NUM_BLOCKS {
            return Err(CoreError::InvalidArgument(format!(
                "prefix_cache_host_blocks must be in 1..={} (MAX_NUM_BLOCKS), got {num_blocks}",
                crate::MAX_NUM_BLOCKS
            )));
        }
        let slab_bytes = num_blocks.checked_mul(block_bytes).ok_or_else(|| {
            CoreError::InvalidArgument(format!(
                "prefix_cache_host_blocks={num_blocks} overflows the address space"
            ))
        })?;
        let slab = slab::allocate_host_tier(slab_bytes, pinned_for)?;
        let blocks = BlockAllocator::new(num_blocks)?;
        let index = Mutex::new(CacheIndex::new(num_blocks)?);
        Ok(SpillTier {
            slab,
            blocks,
            engine,
            device_base,
            compute_stream,
            block_bytes,
            block_size,
            index,
        })
    }

    fn lock(&self) -> MutexGuard<'_, CacheIndex> {
        // Every critical section leaves the index consistent before anything can panic.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn num_blocks(&self) -> usize {
        self.blocks.num_blocks()
    }

    /// Fills in the host fields of the cache's `stats`.
    pub(crate) fn fill_stats(&self, stats: &mut PrefixCacheStats) {
        let host = self.lock().stats();
        stats.host_num_blocks = self.num_blocks();
        stats.host_num_cached_blocks = host.num_cached_blocks;
        stats.host_stored_blocks = host.stored_blocks;
        stats.host_evictions = host.evictions;
        stats.swapped_in_blocks = host.swapped_in_blocks;
    }

    /// One batch of copies, ordered after the pool stream's work and before what it queues
    /// next (CUDA), complete on return (host).
    fn copy(&self, runs: &[Run], ends: Endpoints) -> Result<(), CoreError> {
        // SAFETY: every run names blocks inside the two slabs (ids below their block counts,
        // so mapped); the source blocks stay as they are until the copy is done because every
        // later use of them is queued on the same pool stream after `order_before`, and the
        // destination blocks belong to this call (freshly allocated or just evicted).
        let done = unsafe { self.engine.copy(runs, ends, self.compute_stream) }?;
        // The copy stream runs every spill and swap-in in order, so a host block is rewritten
        // only after an earlier copy read it; the pool's stream waits here, so a pool block
        // is rewritten (or read by a kernel) only after its copy. No CPU wait.
        // SAFETY: the compute stream is the pool's own stream, live as long as the pool.
        unsafe { self.engine.order_before(&done, self.compute_stream) }
    }

    /// Every host block is free or cached (and on the host LRU), once; the index is sound.
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let idx = self.lock();
        idx.check(|_| 0)?;
        self.blocks.check_invariants()?;
        if self.slab.len_bytes() < self.blocks.num_blocks() * self.block_bytes {
            return Err("host tier: its slab is smaller than its blocks".into());
        }
        let (free, cached) = (self.blocks.num_free(), idx.num_cached());
        if free + cached != self.blocks.num_blocks() {
            return Err(format!(
                "host tier: {free} free + {cached} cached != {} blocks",
                self.blocks.num_blocks()
            ));
        }
        Ok(())
    }
}

/// What one spill did: the hashes it stored on the host (in the order given) and the ones
/// it dropped from the host to make room.
pub(crate) struct SpillOutcome {
    pub(crate) stored: Vec<BlockHash>,
    pub(crate) dropped: Vec<BlockHash>,
}

/// The tier's steps, without events: the uniform cache's calls (below, through `LowerTiers`)
/// report them as group 0 under the blocks' hashes; hybrid tables (`hybrid/spill.rs`), which cache each
/// page under a tag of its own, report them per group under their chunk hashes.
impl SpillTier {
    /// [`spill`](Self::spill) without events: what was stored and what dropped. With an
    /// eviction `stage` (uniform host pools only: hybrid tables pass `None`, so what their
    /// spills drop leaves memory uncaptured), the pool blocks the host cannot take and the
    /// host blocks dropped to make room are copied into it, under this tier's lock, before
    /// the spill's copy reuses those host blocks.
    pub(crate) fn spill_blocks(
        &self,
        evicted: &[(u32, BlockHash)],
        stage: Option<&AttachedStage>,
    ) -> SpillOutcome {
        let mut idx = self.lock();
        let room = self.blocks.num_free() + idx.num_evictable();
        let (left_out, evicted) = evicted.split_at(evicted.len() - evicted.len().min(room));
        if let Some(stage) = stage {
            stage.capture_pool_blocks(left_out);
        }
        let mut outcome = SpillOutcome { stored: Vec::new(), dropped: Vec::new() };
        if evicted.is_empty() {
            return outcome;
        }
        let mut host_ids = vec![0u32; evicted.len()];
        let from_free = self.blocks.num_free().min(evicted.len());
        self.blocks
            .alloc_into(&mut host_ids[..from_free])
            .expect("only the cache allocates host blocks");
        let mut dropped = Vec::new();
        for slot in &mut host_ids[from_free..] {
            let (id, hash) = idx.evict().expect("room counted the host LRU");
            dropped.push((id, hash));
            *slot = id;
        }
        if let Some(stage) = stage.filter(|_| !dropped.is_empty()) {
            // SAFETY: the dropped host blocks are in this tier's host slab, off its LRU under
            // its lock, and rewritten only by the copy below, after this returns. A stage is
            // attached to host pools only, whose host tier copies with memcpy (Engine::Host):
            // every earlier copy into these blocks finished before its call returned.
            unsafe { stage.stage.capture(self.slab.base_ptr(), &dropped) };
        }
        outcome.dropped = dropped.into_iter().map(|(_, hash)| hash).collect();
        let runs: Vec<Run> = evicted
            .iter()
            .zip(&host_ids)
            .map(|(&(src, _), &dst)| Run { src, dst, num_blocks: 1 })
            .collect();
        let ends = Endpoints {
            src_base: self.device_base,
            dst_base: self.slab.base_ptr(),
            block_bytes: self.block_bytes,
        };
        if self.copy(&runs, ends).is_err() {
            self.blocks.free_many(&host_ids).expect("host blocks just allocated");
            return outcome;
        }
        for (&(_, hash), &host_id) in evicted.iter().zip(&host_ids) {
            if idx.insert(host_id, hash) {
                idx.push_evictable(host_id);
                outcome.stored.push(hash);
            } else {
                // The host holds this content already (the pool cached it again meanwhile).
                self.blocks.free(host_id).expect("a host block just allocated");
            }
        }
        outcome
    }

    /// [`take`](Self::take) without events: the taken blocks' hashes, in order. Counted as
    /// swapped in.
    pub(crate) fn take_blocks(&self, host_ids: &[u32]) -> Vec<BlockHash> {
        let mut idx = self.lock();
        let hashes = host_ids.iter().map(|&id| idx.remove(id)).collect();
        idx.record_swap_in(host_ids.len());
        hashes
    }

    /// Puts blocks taken by [`take_blocks`](Self::take_blocks) back into the host cache
    /// (most recently used) under the same hashes: the call that took them failed before
    /// copying them. Undoes the swap-in count (and the store count the re-insert adds).
    pub(crate) fn restore(&self, host_ids: &[u32], hashes: &[BlockHash]) {
        let mut idx = self.lock();
        for (&id, &hash) in host_ids.iter().zip(hashes) {
            let inserted = idx.insert(id, hash);
            debug_assert!(inserted, "a restored hash is cached again");
            idx.push_evictable(id);
        }
        idx.unrecord_swap_in(host_ids.len());
    }

    /// The host block holding `hash`, if any (nothing moves).
    pub(crate) fn host_block(&self, hash: &BlockHash) -> Option<u32> {
        self.lock().lookup(hash)
    }

    /// Drops the host blocks holding `hashes` (those it holds), counted as evictions; returns
    /// how many.
    pub(crate) fn discard(&self, hashes: &[BlockHash]) -> usize {
        let mut idx = self.lock();
        let ids: Vec<u32> = hashes.iter().filter_map(|h| idx.lookup(h)).collect();
        for &id in &ids {
            idx.evict_block(id);
        }
        self.blocks.free_many(&ids).expect("cached host blocks are allocated");
        ids.len()
    }

    /// Copies host blocks `host_ids` into pool blocks `device_ids` (one run each), ordered
    /// before the pool stream's later work; false if the copy failed (a CUDA error).
    pub(crate) fn copy_in(&self, host_ids: &[u32], device_ids: &[u32]) -> bool {
        let runs: Vec<Run> = host_ids
            .iter()
            .zip(device_ids)
            .map(|(&src, &dst)| Run { src, dst, num_blocks: 1 })
            .collect();
        let ends = Endpoints {
            src_base: self.slab.base_ptr(),
            dst_base: self.device_base,
            block_bytes: self.block_bytes,
        };
        self.copy(&runs, ends).is_ok()
    }

    /// Frees host blocks taken by [`take_blocks`](Self::take_blocks) once copied (all copies
    /// run in order on one stream, so a later spill into them follows the copy that read them).
    pub(crate) fn free_taken(&self, host_ids: &[u32]) {
        self.blocks.free_many(host_ids).expect("taken host blocks are allocated");
    }

    /// Host blocks on the free list now.
    pub(crate) fn num_free(&self) -> usize {
        self.blocks.num_free()
    }

    /// Host blocks cached now.
    pub(crate) fn num_cached(&self) -> usize {
        self.lock().num_cached()
    }

    /// The slab's address (host memory, readable by the process).
    pub(crate) fn base_ptr(&self) -> u64 {
        self.slab.base_ptr()
    }
}

/// What the cache asks of the host tier, through `LowerTiers` (`lower.rs`), which joins it
/// to the eviction stage and reports the steps above as group 0 events under the blocks'
/// hashes.
impl SpillTier {
    /// Host-resident hashes, least recently spilled first.
    pub(crate) fn cached_hashes(&self) -> Vec<BlockHash> {
        let idx = self.lock();
        idx.evictable().map(|id| idx.hash_of(id).expect("a host LRU block is cached")).collect()
    }

    /// The host blocks of the longest prefix of `hashes` the host holds.
    pub(crate) fn lookup_run(&self, hashes: &[BlockHash]) -> Vec<u32> {
        let idx = self.lock();
        hashes.iter().map_while(|h| idx.lookup(h)).collect()
    }

    /// Copies pool blocks the cache just evicted (`(id, hash)`, least recently used first)
    /// into host blocks, making room by dropping the host's least recently used blocks. When
    /// the host cannot take them all, the most recently used are kept. Best effort: a failed
    /// copy (a CUDA error) drops the blocks, as a pool without a second tier does. With an
    /// eviction `stage`, what leaves memory here (the host blocks dropped, the pool blocks
    /// the host cannot take) is captured there first ([`spill_blocks`](Self::spill_blocks)).
    pub(crate) fn spill(
        &self,
        evicted: &[(u32, BlockHash)],
        events: &mut EventQueue,
        stage: Option<&AttachedStage>,
    ) {
        let SpillOutcome { stored, dropped } = self.spill_blocks(evicted, stage);
        if !dropped.is_empty() {
            events.push(KvEvent::BlockRemoved {
                group: 0,
                block_hashes: dropped,
                medium: Medium::HostTier,
            });
        }
        if !stored.is_empty() {
            events.push(KvEvent::BlockStored {
                group: 0,
                block_hashes: stored,
                parent_block_hash: None,
                token_ids: Vec::new(),
                block_size: self.block_size,
                lora_id: None,
                medium: Medium::HostTier,
            });
        }
    }

    /// Takes host blocks `host_ids` (found by [`lookup_run`](Self::lookup_run) under the
    /// same lock) out of the host cache, so that no spill drops them before
    /// [`swap_in`](Self::swap_in) copies them; they stay allocated until then.
    pub(crate) fn take(&self, host_ids: &[u32], events: &mut EventQueue) {
        if host_ids.is_empty() {
            return;
        }
        let hashes = self.take_blocks(host_ids);
        events.push(KvEvent::BlockRemoved {
            group: 0,
            block_hashes: hashes,
            medium: Medium::HostTier,
        });
    }

    /// Copies taken host blocks into pool blocks `device_ids` and frees them on the host: the
    /// content has moved to the pool, whose cache stores it again. On CUDA, work queued
    /// afterwards on the pool's stream waits for the copies. False if the copy failed (a
    /// CUDA error): the content is lost and the caller computes those blocks instead.
    pub(crate) fn swap_in(&self, host_ids: &[u32], device_ids: &[u32]) -> bool {
        if host_ids.is_empty() {
            return true;
        }
        let copied = self.copy_in(host_ids, device_ids);
        self.free_taken(host_ids);
        copied
    }

    /// Drops every host-resident block; returns how many.
    pub(crate) fn clear(&self) -> usize {
        let ids = self.lock().clear();
        self.blocks.free_many(&ids).expect("cached host blocks are allocated");
        ids.len()
    }
}
