//! The pool's side of prefix caching: the evictable set beside the free list.
//!
//! Allocation takes the lock-free free list first, unchanged; only when it runs short does
//! it take the cache's lock and evict (see `growth.rs`, `alloc_into`). Dropping references
//! stays lock-free for blocks that are not cached; a cached block's last reference is
//! dropped under the cache's lock, which puts it on the evictable list.

use super::{AttachedStage, EvictionStage, Owner, Pool, SpillTier};
use crate::block_copy::Engine;
use crate::error::CoreError;
use crate::prefix_cache::{
    BlockHash, BlockHasher, CacheSnapshot, PrefixAlloc, PrefixCache, PrefixCacheStats,
    PrefixLookup, SpillTarget,
};
use crate::slab::Device;
use crate::tables::PromptKey;

impl Pool {
    /// Turns prefix caching on for a new pool (before it is shared). A growable pool evicts
    /// before it grows (evictable blocks count as free), and its shrink evicts the evictable
    /// blocks above the highest referenced one first, so that their chunks can go. The
    /// cache's per-block metadata covers the mapped blocks and grows with them (fallibly:
    /// `OutOfMemory`, never an abort). A pool of a hybrid model's pages caches for hybrid
    /// tables, whose 16-token chunks are its cache's blocks of tokens.
    pub fn with_prefix_caching(self) -> Result<Self, CoreError> {
        self.with_prefix_caching_key(None)
    }

    /// [`with_prefix_caching`](Self::with_prefix_caching) with the block hashes keyed by
    /// `hash_key` (`None`: a random key, the default). Pools, or a router, given the same
    /// key hash the same tokens (under the same salt, LoRA and extra keys) to the same
    /// block hashes, so their KV events name blocks alike. Whoever knows the key can predict
    /// every hash: share it only with parties trusted not to forge blocks.
    pub fn with_prefix_caching_key(
        mut self,
        hash_key: Option<[u8; 32]>,
    ) -> Result<Self, CoreError> {
        let hasher = match hash_key {
            Some(key) => BlockHasher::with_key(key),
            None => BlockHasher::new_random()?,
        };
        self.prefix_cache = Some(PrefixCache::with_hasher(
            self.max_num_blocks(),
            self.num_blocks(),
            self.geometry.hash_block_tokens(),
            hasher,
        )?);
        Ok(self)
    }

    /// Every block the prefix cache holds, on both tiers, with the event sequence number it
    /// is consistent with (`None` without prefix caching). A pool of hybrid pages caches one
    /// internal tag a page here (listed as group 0): its chunks per group are
    /// `HybridTables::kv_cache_snapshot`'s to list.
    pub fn prefix_cache_snapshot(&self) -> Option<CacheSnapshot> {
        Some(self.prefix_cache.as_ref()?.snapshot(self.spill_target()))
    }

    /// How many tokens of a prompt `add_request` would find cached now (a multiple of
    /// block_size, never the block of the last token), with the split between the pool and
    /// its host tier. Changes nothing: no reference, no LRU order, no event, no counter.
    /// Without prefix caching nothing is cached: 0. A pool of hybrid pages has no uniform
    /// block_size either (its `HybridTables` match prompts per group): 0.
    pub fn lookup_prefix(&self, token_ids: &[u32], key: &PromptKey<'_>) -> PrefixLookup {
        let Some(cache) = &self.prefix_cache else { return PrefixLookup::default() };
        let Ok(layout) = self.layout() else { return PrefixLookup::default() };
        let bs = layout.block_size();
        let root = cache.hasher().root(key.cache_salt, key.lora_id, key.extra_keys);
        let max_hits = token_ids.len().saturating_sub(1) / bs;
        let hashes = cache.hasher().chain(&root, &token_ids[..max_hits * bs], bs);
        cache.lookup(&self.allocator, self.spill_target(), &hashes)
    }

    /// Gives the prefix cache a second tier of `num_blocks` host blocks (pinned for a CUDA
    /// pool): cached blocks this pool evicts spill there instead of being dropped, and a
    /// prefix hit on one copies it back. Before the pool is shared.
    pub fn with_prefix_host_tier(mut self, num_blocks: usize) -> Result<Self, CoreError> {
        if self.prefix_cache.is_none() {
            return Err(CoreError::InvalidArgument(
                "a prefix-cache host tier needs prefix caching on the pool".into(),
            ));
        }
        self.require_memory("a prefix-cache host tier")?;
        let pinned_for = match self.device() {
            Device::Host => None,
            Device::Cuda(ordinal) => Some(ordinal),
        };
        let tier = SpillTier::new(
            self.block_bytes(),
            self.geometry.hash_block_tokens(),
            num_blocks,
            pinned_for,
            self.spill_engine()?,
            self.base_ptr(),
            self.stream_handle().unwrap_or(0),
        )?;
        self.lower.host = Some(tier);
        Ok(self)
    }

    /// Attaches the stage that evictions hand blocks to on their way out of memory
    /// (`evicted.rs`): from now on, every cached block that leaves the pool's last in-memory
    /// tier (the host tier if the pool has one, else the pool) is copied with its hash into
    /// one of `num_slots` host slots before its memory is reused, for a tier below memory to
    /// take ([`eviction_stage`](Self::eviction_stage)). Once per pool, while it is shared.
    /// Host pools of a `KvLayout` with prefix caching only (`InvalidArgument` otherwise, and
    /// for a second stage; a pool of hybrid pages is `InvalidLayout`: its tables spill to the
    /// host tier themselves, `hybrid/spill.rs`, and feed no stage); a failed allocation is
    /// `OutOfMemory`. Nothing changes on failure.
    pub fn attach_eviction_stage(&self, num_slots: usize) -> Result<&EvictionStage, CoreError> {
        if self.prefix_cache.is_none() {
            return Err(CoreError::InvalidArgument(
                "an eviction stage needs prefix caching on the pool".into(),
            ));
        }
        self.require_memory("an eviction stage")?;
        if self.device() != Device::Host {
            return Err(CoreError::InvalidArgument(format!(
                "an eviction stage captures host pools' blocks, not {}'s (their copies to the \
                 host tier are asynchronous)",
                self.device()
            )));
        }
        let block_bytes = self.layout()?.block_bytes();
        if self.lower.stage.get().is_some() {
            return Err(CoreError::InvalidArgument(
                "the pool has an eviction stage already".into(),
            ));
        }
        let stage = EvictionStage::new(num_slots, block_bytes)?;
        // Two threads may race here: the loser's stage is dropped and it is told so.
        let mut ours = false;
        let attached = self.lower.stage.get_or_init(|| {
            ours = true;
            AttachedStage::new(stage, self.base_ptr())
        });
        if !ours {
            return Err(CoreError::InvalidArgument(
                "the pool has an eviction stage already".into(),
            ));
        }
        Ok(&attached.stage)
    }

    /// The eviction stage, once attached.
    pub fn eviction_stage(&self) -> Option<&EvictionStage> {
        self.lower.stage.get().map(|attached| &attached.stage)
    }

    /// The second tier as the cache sees it.
    fn spill_target(&self) -> Option<&dyn SpillTarget> {
        self.lower.target()
    }

    /// The cache's counters with its host tier's (`None` without prefix caching).
    pub fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        let mut stats = self.prefix_cache.as_ref()?.stats();
        if let Some(tier) = &self.lower.host {
            tier.fill_stats(&mut stats);
        }
        Some(stats)
    }

    /// The copy engine of a host tier for this pool: memcpy on the host, a copy stream on CUDA.
    #[cfg(feature = "cuda")]
    fn spill_engine(&self) -> Result<Engine, CoreError> {
        match self.device_context() {
            Some(dc) => Ok(Engine::Cuda(crate::block_copy::CudaEngine::new(
                dc.context(),
                crate::block_copy::CopyMethod::Auto,
            )?)),
            None => Ok(Engine::Host),
        }
    }
    #[cfg(not(feature = "cuda"))]
    fn spill_engine(&self) -> Result<Engine, CoreError> {
        Ok(Engine::Host)
    }

    pub fn prefix_cache(&self) -> Option<&PrefixCache> {
        self.prefix_cache.as_ref()
    }

    /// Cached blocks nobody references (0 without prefix caching).
    pub fn num_evictable(&self) -> usize {
        self.prefix_cache.as_ref().map_or(0, PrefixCache::num_evictable)
    }

    /// [`Pool::free_many`] on a pool with prefix caching: validates everything, then drops
    /// uncached blocks' references lock-free and cached blocks' under the cache's lock.
    pub(super) fn free_many_cached(
        &self,
        cache: &PrefixCache,
        block_ids: &[u32],
    ) -> Result<(), CoreError> {
        let num_blocks = self.num_blocks();
        if !block_ids.iter().any(|&id| (id as usize) < num_blocks && cache.is_cached(id)) {
            return self.allocator.free_many(block_ids);
        }
        self.allocator.check_distinct_and_in_range(block_ids)?;
        if let Some(&id) =
            block_ids.iter().find(|&&id| self.allocator.ref_cnt_unchecked(id as usize) == 0)
        {
            return Err(CoreError::DoubleFree { block_id: id });
        }
        // A block we hold cannot change between cached and not (only its sole holder
        // caches it, and only unreferenced blocks are dropped), so the split is stable.
        let (cached, plain): (Vec<u32>, Vec<u32>) =
            block_ids.iter().partition(|&&id| cache.is_cached(id));
        self.allocator.free_many(&plain)?;
        cache.release(&self.allocator, &cached);
        Ok(())
    }

    /// Fills `out` from the free list and, what it lacks, by evicting cached blocks. A
    /// growable pool grows only when free and evictable blocks together fall short, by the
    /// shortfall, then retries (another thread may take the new blocks first; then this
    /// fails as it would have).
    pub(crate) fn alloc_evicting(&self, out: &mut [u32]) -> Result<(), CoreError> {
        let Some(cache) = &self.prefix_cache else { return self.allocator.alloc_into(out) };
        let spill = self.spill_target();
        match cache.alloc_evicting(&self.allocator, spill, out) {
            Err(CoreError::OutOfBlocks { requested, free, .. }) if self.is_growable() => {
                self.grow_for(requested, free)?;
                cache.alloc_evicting(&self.allocator, spill, out)
            }
            result => result,
        }
    }

    /// Before a shrink: evicts the evictable blocks above both the highest referenced block
    /// and every live view's extent (they alone keep those chunks mapped). Not the pages of
    /// hybrid tables: their index keys each page under tags of its own and reports its
    /// removal per group, so they evict theirs themselves (`HybridTables::shrink`); evicting
    /// them here would leave their keys behind and report the tags, as group 0.
    pub(super) fn evict_for_shrink(&self) {
        if let Some(cache) = &self.prefix_cache {
            if cache.evictable_ids().iter().any(|&id| self.owners.get(id) == Owner::HybridTables) {
                return;
            }
            cache.evict_above(&self.allocator, self.spill_target(), self.max_view_extent());
        }
    }

    /// References the cached blocks of the longest prefix of `hashes` and allocates the
    /// rest of `total_blocks` (see [`PrefixCache::alloc_with_prefix`]).
    pub(crate) fn alloc_with_prefix(
        &self,
        cache: &PrefixCache,
        hashes: &[BlockHash],
        total_blocks: usize,
        query_tokens: usize,
    ) -> Result<PrefixAlloc, CoreError> {
        let (refs, spill) = (&self.allocator, self.spill_target());
        let alloc = match cache.alloc_with_prefix(refs, spill, hashes, total_blocks, query_tokens) {
            // Short even counting the evictable blocks: grow as `alloc_evicting` does.
            Err(CoreError::OutOfBlocks { requested, free, .. }) if self.is_growable() => {
                self.grow_for(requested, free)?;
                cache.alloc_with_prefix(refs, spill, hashes, total_blocks, query_tokens)?
            }
            result => result?,
        };
        // Hits were tables' blocks already (only tables cache blocks).
        self.owners.set(&alloc.fresh, Owner::Tables);
        // Revived hits are in use again, like fresh blocks.
        cache.raise_used_high_water(self.num_used());
        Ok(alloc)
    }

    /// Drops every cached block back to the free list (after a weight update: their KV is
    /// stale); returns how many. Refuses with `CacheInUse`, changing nothing, while a cached
    /// block is referenced. Without prefix caching there is nothing to drop.
    pub fn reset_prefix_cache(&self) -> Result<usize, CoreError> {
        match &self.prefix_cache {
            Some(cache) => cache.reset(&self.allocator, self.spill_target()),
            None => Ok(0),
        }
    }

    /// The allocator's invariants, the cache's, and
    /// `num_free + num_evictable + num_used == num_blocks`.
    pub(crate) fn check_block_invariants(&self) -> Result<(), String> {
        let Some(cache) = &self.prefix_cache else {
            return self.allocator.check_invariants();
        };
        self.allocator.check_invariants_with_evictable(&cache.evictable_ids())?;
        cache.check_invariants(&self.allocator)?;
        if let Some(tier) = &self.lower.host {
            tier.check_invariants()?;
        }
        if let Some(attached) = self.lower.stage.get() {
            attached.stage.check_invariants()?;
        }
        let (free, evictable, used) =
            (self.allocator.num_free(), self.num_evictable(), self.num_used());
        if free + evictable + used != self.num_blocks() {
            return Err(format!(
                "num_free {free} + num_evictable {evictable} + num_used {used} != num_blocks {}",
                self.num_blocks()
            ));
        }
        Ok(())
    }
}

/// The pool's side of blocks cached for a caller with its own index
/// (`prefix_cache/tagged.rs`; hybrid tables): the allocator is the pool's, so these calls
/// pass it to the cache.
impl Pool {
    /// Takes one reference to each of `ids`, cached, distinct and below `MAX_REF_CNT`
    /// references (evictable ones are revived), on behalf of `owner`, the API that cached
    /// them. No-op without prefix caching.
    ///
    /// Owner tags of cached blocks, as for block tables' hits in `alloc_with_prefix`: a tag
    /// is written only when a block leaves the free list, and a cached block is not on it,
    /// evictable or not; so a cached block keeps the tag of the allocation that filled it
    /// until it is evicted, and a hit revives it under that tag. Each owner finds only the
    /// blocks it cached (block tables by their chain hashes, hybrid tables by their own
    /// tags), so the tag already is `owner`'s.
    pub(crate) fn acquire_cached(&self, ids: &[u32], owner: Owner) {
        debug_assert!(
            ids.iter().all(|&id| self.owners.get(id) == owner),
            "a hit on a block cached by another owner"
        );
        if let Some(cache) = &self.prefix_cache {
            cache.acquire(&self.allocator, ids);
            cache.raise_used_high_water(self.num_used());
        }
    }

    /// Evicts up to `count` least recently used evictable blocks onto the free list, without
    /// an event; returns them with their hashes.
    pub(crate) fn evict_to_free(&self, count: usize) -> Vec<(u32, BlockHash)> {
        match &self.prefix_cache {
            Some(cache) => cache.evict_to_free(&self.allocator, count),
            None => Vec::new(),
        }
    }

    /// Evicts these cached blocks, the unreferenced ones, onto the free list, without an
    /// event; returns the ones evicted with their hashes.
    pub(crate) fn evict_blocks_to_free(&self, ids: &[u32]) -> Vec<(u32, BlockHash)> {
        match &self.prefix_cache {
            Some(cache) => cache.evict_blocks_to_free(&self.allocator, ids),
            None => Vec::new(),
        }
    }

    /// The prefix cache's second tier in host memory, if it has one (hybrid tables drive it
    /// themselves, `hybrid/spill.rs`).
    pub(crate) fn prefix_host_tier(&self) -> Option<&SpillTier> {
        self.lower.host.as_ref()
    }

    /// The address of the prefix cache's host tier slab (`None` without one): host memory,
    /// `prefix_cache_host_blocks` blocks of `block_bytes`, host block `i` at
    /// `i * block_bytes`. For reading what the tier holds (tests, a tier below it); the
    /// tier alone writes it.
    pub fn prefix_host_tier_base_ptr(&self) -> Option<u64> {
        self.lower.host.as_ref().map(SpillTier::base_ptr)
    }
}
