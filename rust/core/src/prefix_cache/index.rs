//! `CacheIndex`: the hash -> block map, each block's hash, and the evictable list. Plain
//! single-threaded data; `PrefixCache` keeps it behind its mutex and does the reference
//! counting around it.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use super::events::{EventQueue, KvEvent};
use super::hash::BlockHash;
use super::lru::EvictableList;
use super::stats::PrefixCacheStats;
use crate::error::CoreError;
use crate::zeroed::try_grow;

pub struct CacheIndex {
    /// Content -> the one block that holds it.
    map: FxHashMap<BlockHash, u32>,
    /// Block -> its content hash, if cached. `map[hash_of[b]] == b` for every cached `b`.
    /// Covers the ids that exist (grown with a growable pool, see `grow_to`).
    hash_of: Vec<Option<BlockHash>>,
    /// Block -> the hash of the block before it in the request that stored it (`None` for
    /// a request's first block, and for blocks stored without one). Read only where
    /// `hash_of` is `Some`; a snapshot reports it so a router can rebuild its prefix tree.
    parent_of: Vec<Option<BlockHash>>,
    lru: EvictableList,
    pub events: EventQueue,
    /// Blocks a tier outside the core holds (`Medium::Disk`), as the events it appended say
    /// (`PrefixCache::record_external_event`): kept beside the queue, under the same lock,
    /// so a snapshot lists them consistently with its `seq`.
    pub external: BTreeSet<BlockHash>,
    /// The counters; the gauges in it are filled in by [`stats`](Self::stats).
    counters: PrefixCacheStats,
}

impl CacheIndex {
    /// An empty index over ids `0..num_blocks`; `OutOfMemory` if its arrays cannot be had.
    pub fn new(num_blocks: usize) -> Result<Self, CoreError> {
        let mut index = CacheIndex {
            // Grown as blocks are cached, not sized for every block: a dense map keeps a
            // decode step's inserts in cache (sized up front, they cost more than the rehashes).
            map: FxHashMap::default(),
            hash_of: Vec::new(),
            parent_of: Vec::new(),
            lru: EvictableList::new(0)?,
            events: EventQueue::default(),
            external: BTreeSet::new(),
            counters: PrefixCacheStats::default(),
        };
        index.grow_to(num_blocks)?;
        Ok(index)
    }

    /// Makes room for ids below `num_blocks` (never shrinks: ids a shrink removed are
    /// uncached and come back as they were). `OutOfMemory` changes nothing that matters:
    /// the index covers the ids it covered.
    pub fn grow_to(&mut self, num_blocks: usize) -> Result<(), CoreError> {
        if num_blocks <= self.hash_of.len() {
            return Ok(());
        }
        self.lru.grow_to(num_blocks)?;
        try_grow(&mut self.parent_of, num_blocks, None)?;
        try_grow(&mut self.hash_of, num_blocks, None)
    }
    /// The ids it covers.
    pub fn num_ids(&self) -> usize {
        self.hash_of.len()
    }

    pub fn lookup(&self, hash: &BlockHash) -> Option<u32> {
        self.map.get(hash).copied()
    }
    pub fn hash_of(&self, id: u32) -> Option<BlockHash> {
        self.hash_of[id as usize]
    }
    pub fn is_evictable(&self, id: u32) -> bool {
        self.lru.contains(id)
    }
    pub fn num_evictable(&self) -> usize {
        self.lru.len()
    }
    pub fn num_cached(&self) -> usize {
        self.map.len()
    }
    /// Evictable ids, least recently used first.
    pub fn evictable(&self) -> impl Iterator<Item = u32> + '_ {
        self.lru.iter()
    }
    /// Every cached block's `(hash, parent)`, in id order.
    pub fn cached_blocks(&self) -> Vec<(BlockHash, Option<BlockHash>)> {
        self.hash_of
            .iter()
            .zip(&self.parent_of)
            .filter_map(|(hash, parent)| hash.map(|h| (h, *parent)))
            .collect()
    }
    /// Cached ids (any order).
    pub fn cached(&self) -> impl Iterator<Item = u32> + '_ {
        self.map.values().copied()
    }

    /// Records that block `id` (referenced, not cached) holds the content `hash`. Returns
    /// false and changes nothing when another block holds that content already: then `id`
    /// stays uncached (a duplicate computed before the first was stored).
    pub fn insert(&mut self, id: u32, hash: BlockHash) -> bool {
        self.insert_with_parent(id, hash, None)
    }

    /// [`insert`](Self::insert), remembering the block's parent for snapshots.
    pub fn insert_with_parent(
        &mut self,
        id: u32,
        hash: BlockHash,
        parent: Option<BlockHash>,
    ) -> bool {
        debug_assert!(self.hash_of[id as usize].is_none(), "block {id} is cached already");
        match self.map.entry(hash) {
            std::collections::hash_map::Entry::Occupied(_) => return false,
            std::collections::hash_map::Entry::Vacant(slot) => slot.insert(id),
        };
        self.hash_of[id as usize] = Some(hash);
        self.parent_of[id as usize] = parent;
        self.counters.stored_blocks += 1;
        true
    }

    /// A cached block's last reference is gone: it becomes the most recently used evictable.
    pub fn push_evictable(&mut self, id: u32) {
        debug_assert!(self.hash_of[id as usize].is_some(), "block {id} is not cached");
        self.lru.push_back(id);
    }

    /// A hit on an evictable block takes it off the evictable list; false if it was not on it.
    pub fn revive(&mut self, id: u32) -> bool {
        self.lru.remove(id)
    }

    /// Takes the least recently used evictable block and forgets its content.
    pub fn evict(&mut self) -> Option<(u32, BlockHash)> {
        let id = self.lru.pop_front()?;
        let hash = self.hash_of[id as usize].take().expect("an evictable block is cached");
        self.map.remove(&hash);
        self.counters.evictions += 1;
        Some((id, hash))
    }

    /// Takes cached, evictable block `id` out of the cache (a second tier handing its
    /// content back); returns its hash.
    pub fn remove(&mut self, id: u32) -> BlockHash {
        let hash = self.hash_of[id as usize].take().expect("only cached blocks are removed");
        self.map.remove(&hash);
        self.lru.remove(id);
        hash
    }

    /// Evicts block `id` (cached and evictable) out of LRU order (a shrink reclaiming its
    /// chunk); returns its hash.
    pub fn evict_block(&mut self, id: u32) -> BlockHash {
        self.counters.evictions += 1;
        self.remove(id)
    }

    /// Counts blocks a second tier handed back to the pool.
    pub fn record_swap_in(&mut self, num_blocks: usize) {
        self.counters.swapped_in_blocks += num_blocks as u64;
    }

    /// Takes back a [`record_swap_in`](Self::record_swap_in) whose swap-in did not happen,
    /// and the stores of the blocks put back (they were stored once already).
    pub fn unrecord_swap_in(&mut self, num_blocks: usize) {
        self.counters.swapped_in_blocks -= num_blocks as u64;
        self.counters.stored_blocks -= num_blocks as u64;
    }

    /// Forgets every cached block; all must be evictable. Returns their ids.
    pub fn clear(&mut self) -> Vec<u32> {
        debug_assert_eq!(self.lru.len(), self.map.len(), "a cached block is still referenced");
        let ids: Vec<u32> = std::iter::from_fn(|| self.lru.pop_front()).collect();
        for &id in &ids {
            self.hash_of[id as usize] = None;
        }
        self.map.clear();
        self.counters.resets += 1;
        self.events.push(KvEvent::AllBlocksCleared);
        ids
    }

    pub fn record_query(&mut self, query_tokens: usize, hit_tokens: usize) {
        self.counters.requests += 1;
        self.counters.queries += query_tokens as u64;
        self.counters.hits += hit_tokens as u64;
    }

    pub fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats {
            num_cached_blocks: self.map.len(),
            num_evictable_blocks: self.lru.len(),
            ..self.counters
        }
    }

    /// Map and hashes agree (every cached block is in the map once, under its own hash), the
    /// list is well linked, and exactly the cached blocks with `ref_cnt(b) == 0` are on it.
    pub fn check(&self, ref_cnt: impl Fn(u32) -> u32) -> Result<(), String> {
        self.lru.check()?;
        for (hash, &id) in &self.map {
            if self.hash_of.get(id as usize).copied().flatten() != Some(*hash) {
                return Err(format!(
                    "the map sends {hash:?} to block {id}, which does not hold it"
                ));
            }
        }
        let hashed = self.hash_of.iter().filter(|h| h.is_some()).count();
        if hashed != self.map.len() {
            return Err(format!(
                "{hashed} blocks hold a hash, the map has {} entries",
                self.map.len()
            ));
        }
        for (id, hash) in self.hash_of.iter().enumerate() {
            let id = id as u32;
            let rc = ref_cnt(id);
            match (hash.is_some(), rc == 0, self.lru.contains(id)) {
                (true, true, false) => {
                    return Err(format!(
                        "cached block {id} has ref_cnt 0 but is not evictable (lost)"
                    ))
                }
                (_, false, true) => {
                    return Err(format!("block {id} is evictable with ref_cnt {rc}"))
                }
                (false, _, true) => return Err(format!("block {id} is evictable but not cached")),
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u8) -> BlockHash {
        BlockHash([n; 32])
    }

    #[test]
    fn insert_evict_revive_clear() {
        let mut idx = CacheIndex::new(4).unwrap();
        idx.events.set_enabled(true);
        assert!(idx.insert(0, h(1)));
        assert!(!idx.insert(1, h(1)), "one block per content");
        assert!(idx.insert(2, h(2)));
        assert_eq!(idx.lookup(&h(1)), Some(0));
        let refs = |id: u32| u32::from(id == 1);
        idx.push_evictable(2);
        idx.push_evictable(0);
        idx.check(refs).unwrap();
        assert!(idx.revive(2));
        assert!(!idx.revive(2));
        idx.push_evictable(2);
        // 0 is now the least recently used.
        assert_eq!(idx.evict(), Some((0, h(1))));
        assert_eq!(idx.lookup(&h(1)), None);
        assert_eq!(idx.hash_of(0), None);
        idx.check(refs).unwrap();
        assert_eq!(idx.clear(), vec![2]);
        assert_eq!(idx.num_cached(), 0);
        idx.check(refs).unwrap();
        let s = idx.stats();
        assert_eq!((s.stored_blocks, s.evictions, s.resets), (2, 1, 1));
        assert_eq!(idx.events.drain(), vec![KvEvent::AllBlocksCleared]);
    }

    #[test]
    fn check_catches_a_referenced_evictable_block() {
        let mut idx = CacheIndex::new(2).unwrap();
        idx.insert(0, h(1));
        idx.push_evictable(0);
        assert!(idx.check(|_| 1).unwrap_err().contains("evictable with ref_cnt 1"));
        assert!(idx.check(|_| 0).is_ok());
        idx.revive(0);
        assert!(idx.check(|_| 0).unwrap_err().contains("lost"));
    }
}
