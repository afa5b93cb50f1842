//! Blocks cached for a caller that keeps its own index of what they hold (hybrid tables:
//! one page serves several chunk hashes, see `../hybrid/hybrid.md`). The caller caches each
//! such block here under one hash of its own choosing (a tag), so the block takes part in
//! the evictable list, the ref counts and the counts of the pool exactly like any cached
//! block; its own index maps its keys to (block, tag), and a key is valid while the tag
//! still maps to the block. These calls queue no event: the caller reports its own keys
//! ([`PrefixCache::push_event`]).

use super::{BlockHash, BlockRefs, KvEvent, PrefixCache};
use crate::sync::Ordering;

impl PrefixCache {
    /// The block cached under `hash`, if any (no reference is taken, nothing moves).
    pub fn cached_block(&self, hash: &BlockHash) -> Option<u32> {
        self.lock().lookup(hash)
    }

    /// Runs `read` under the cache's lock with the `seq` of the newest event numbered so far
    /// and a look-up of the block cached under a tag: no event can be numbered, and no tag
    /// cached or evicted, while `read` runs, so what it reads is consistent with that `seq`
    /// (a caller's snapshot of its own keys). `read` must not call back into this cache (its
    /// lock is held); the host tier's lock nests inside it, as every call nests them.
    pub fn read_consistent<R>(
        &self,
        read: impl FnOnce(u64, &dyn Fn(&BlockHash) -> Option<u32>) -> R,
    ) -> R {
        let idx = self.lock();
        read(idx.events.last_seq(), &|tag| idx.lookup(tag))
    }

    /// Caches block `id` (referenced by the caller, not cached) under `hash`; false, and
    /// nothing changes, when `hash` is cached already.
    pub fn insert_block(&self, id: u32, hash: BlockHash) -> bool {
        let mut idx = self.lock();
        let inserted = idx.insert(id, hash);
        if inserted {
            self.cached[id as usize].store(true, Ordering::Release);
        }
        inserted
    }

    /// Takes one reference to each of `ids`, all cached and distinct, each below
    /// [`MAX_REF_CNT`](crate::MAX_REF_CNT) references: an evictable one leaves the evictable
    /// list (a hit reviving it).
    pub fn acquire(&self, refs: &dyn BlockRefs, ids: &[u32]) {
        let mut idx = self.lock();
        for &id in ids {
            debug_assert!(idx.hash_of(id).is_some(), "block {id} is not cached");
            if idx.revive(id) {
                refs.set_first_ref(id);
            } else {
                refs.add_ref(id);
            }
        }
        self.num_evictable.store(idx.num_evictable(), Ordering::Release);
    }

    /// Evicts up to `count` evictable blocks, least recently used first, onto the free list;
    /// returns each with the hash it was cached under.
    pub fn evict_to_free(&self, refs: &dyn BlockRefs, count: usize) -> Vec<(u32, BlockHash)> {
        let mut idx = self.lock();
        let evicted: Vec<(u32, BlockHash)> =
            std::iter::from_fn(|| idx.evict()).take(count).collect();
        self.uncache(refs, &evicted);
        self.num_evictable.store(idx.num_evictable(), Ordering::Release);
        evicted
    }

    /// Evicts these blocks (each cached; the unreferenced ones, out of LRU order) onto the
    /// free list; returns the ones it evicted with their hashes. Referenced ones stay.
    pub fn evict_blocks_to_free(&self, refs: &dyn BlockRefs, ids: &[u32]) -> Vec<(u32, BlockHash)> {
        let mut idx = self.lock();
        let mut evicted = Vec::with_capacity(ids.len());
        for &id in ids {
            if idx.is_evictable(id) {
                evicted.push((id, idx.evict_block(id)));
            }
        }
        self.uncache(refs, &evicted);
        self.num_evictable.store(idx.num_evictable(), Ordering::Release);
        evicted
    }

    /// Clears the flags of blocks just taken out of the index and frees them.
    fn uncache(&self, refs: &dyn BlockRefs, evicted: &[(u32, BlockHash)]) {
        let ids: Vec<u32> = evicted.iter().map(|&(id, _)| id).collect();
        for &id in &ids {
            self.cached[id as usize].store(false, Ordering::Release);
        }
        refs.push_free(&ids);
    }

    /// Queues `event` (when events are enabled), for a caller reporting its own keys.
    pub fn push_event(&self, event: KvEvent) {
        self.lock().events.push(event);
    }

    /// Counts a prompt of `query_tokens` tokens of which `hit_tokens` were found cached.
    pub fn record_query(&self, query_tokens: usize, hit_tokens: usize) {
        self.lock().record_query(query_tokens, hit_tokens);
    }
}
