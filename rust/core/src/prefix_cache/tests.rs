//! The cache against a plain stand-in for the allocator (a Vec of counts and a Vec free
//! list), so these tests need neither the lock-free list nor the tables.

use std::sync::Mutex;

use super::*;
use crate::pool::SpillTier;

struct FakeRefs {
    state: Mutex<(Vec<u32>, Vec<u32>)>, // (ref counts, free list with the next id to pop last)
}

impl FakeRefs {
    fn new(n: u32) -> Self {
        FakeRefs { state: Mutex::new((vec![0; n as usize], (0..n).rev().collect())) }
    }
    fn rc(&self, id: u32) -> u32 {
        self.state.lock().unwrap().0[id as usize]
    }
}

impl BlockRefs for FakeRefs {
    fn num_blocks(&self) -> usize {
        self.state.lock().unwrap().0.len()
    }
    fn num_free(&self) -> usize {
        self.state.lock().unwrap().1.len()
    }
    fn ref_cnt(&self, id: u32) -> u32 {
        self.rc(id)
    }
    fn set_first_ref(&self, id: u32) {
        let mut s = self.state.lock().unwrap();
        assert_eq!(s.0[id as usize], 0);
        s.0[id as usize] = 1;
    }
    fn add_ref(&self, id: u32) {
        let mut s = self.state.lock().unwrap();
        assert!(s.0[id as usize] > 0);
        s.0[id as usize] += 1;
    }
    fn drop_ref(&self, id: u32) -> Option<u32> {
        let mut s = self.state.lock().unwrap();
        let c = &mut s.0[id as usize];
        *c = c.checked_sub(1)?;
        Some(*c)
    }
    fn pop_free(&self, out: &mut [u32]) -> Result<(), usize> {
        let mut s = self.state.lock().unwrap();
        if s.1.len() < out.len() {
            return Err(s.1.len());
        }
        for slot in out {
            *slot = s.1.pop().unwrap();
            s.0[*slot as usize] = 1;
        }
        Ok(())
    }
    fn push_free(&self, ids: &[u32]) {
        let mut s = self.state.lock().unwrap();
        for &id in ids {
            s.0[id as usize] = 0;
            s.1.push(id);
        }
    }
}

const BS: usize = 4;

fn setup(n: u32) -> (PrefixCache, FakeRefs) {
    let cache =
        PrefixCache::with_hasher(n as usize, n as usize, BS, BlockHasher::with_key([1; 32]))
            .unwrap();
    (cache, FakeRefs::new(n))
}

/// Caches the full blocks of `tokens` held in `ids`, as the tables do when they fill.
fn store_all(cache: &PrefixCache, ids: &[u32], tokens: &[u32]) -> Vec<BlockHash> {
    let root = cache.hasher().root(None, None, b"");
    let hashes = cache.hasher().chain(&root, tokens, BS);
    let blocks: Vec<FilledBlock> = hashes
        .iter()
        .zip(ids)
        .enumerate()
        .map(|(i, (&hash, &block_id))| FilledBlock {
            block_id,
            hash,
            parent: i.checked_sub(1).map(|p| hashes[p]),
            tokens_at: i * BS,
            lora_id: None,
        })
        .collect();
    cache.store(&blocks, tokens);
    hashes
}

#[test]
fn hit_revive_and_share() {
    let (cache, refs) = setup(8);
    cache.set_events_enabled(true);
    let tokens: Vec<u32> = (0..12).collect();
    let first = cache.alloc_with_prefix(&refs, None, &[], 3, 12).unwrap();
    assert!(first.hits.is_empty());
    let hashes = store_all(&cache, &first.fresh, &tokens);
    cache.check_invariants(&refs).unwrap();
    // A second request while the first still runs: hits share the referenced blocks.
    let second = cache.alloc_with_prefix(&refs, None, &hashes[..2], 3, 12).unwrap();
    assert_eq!(second.hits, first.fresh[..2]);
    assert_eq!(refs.rc(first.fresh[0]), 2);
    cache.release(&refs, &second.hits);
    refs.push_free(&second.fresh);
    cache.release(&refs, &first.fresh);
    // All three cached blocks are evictable now, tail first.
    assert_eq!(cache.evictable_ids(), [first.fresh[2], first.fresh[1], first.fresh[0]]);
    cache.check_invariants(&refs).unwrap();
    // A hit on evictable blocks revives them.
    let third = cache.alloc_with_prefix(&refs, None, &hashes[..2], 3, 12).unwrap();
    assert_eq!(third.hits, first.fresh[..2]);
    assert_eq!(cache.evictable_ids(), [first.fresh[2]]);
    cache.check_invariants(&refs).unwrap();
    let s = cache.stats();
    assert_eq!(
        (s.requests, s.queries, s.hits, s.num_cached_blocks, s.num_evictable_blocks),
        (3, 36, 16, 3, 1)
    );
    let events = cache.drain_events();
    assert_eq!(events.len(), 1);
    match &events[0] {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, .. } => {
            assert_eq!(block_hashes, &hashes);
            assert_eq!(*parent_block_hash, None);
            assert_eq!(token_ids, &tokens);
            assert_eq!(*block_size, BS);
        }
        e => panic!("unexpected {e:?}"),
    }
}

#[test]
fn eviction_when_free_list_runs_short_never_takes_a_hit() {
    let (cache, refs) = setup(4);
    cache.set_events_enabled(true);
    let tokens: Vec<u32> = (0..16).collect();
    let a = cache.alloc_with_prefix(&refs, None, &[], 4, 16).unwrap();
    let hashes = store_all(&cache, &a.fresh, &tokens);
    cache.release(&refs, &a.fresh);
    cache.drain_events();
    // Reuse the first two blocks, need two more: the free list is empty, so the two least
    // recently used evictable blocks that are not hits go: the tail of `a` first.
    let b = cache.alloc_with_prefix(&refs, None, &hashes[..2], 4, 16).unwrap();
    assert_eq!(b.hits, a.fresh[..2]);
    let mut evicted = b.fresh.clone();
    evicted.sort_unstable();
    let mut tail = a.fresh[2..].to_vec();
    tail.sort_unstable();
    assert_eq!(evicted, tail);
    assert_eq!(
        cache.drain_events(),
        vec![KvEvent::BlockRemoved {
            group: 0,
            block_hashes: vec![hashes[3], hashes[2]],
            medium: Medium::Pool
        }]
    );
    cache.check_invariants(&refs).unwrap();
    assert_eq!(cache.stats().evictions, 2);
    // Nothing left: a failed call changes nothing.
    let before = (cache.stats(), cache.evictable_ids(), refs.num_free());
    let err = cache.alloc_with_prefix(&refs, None, &[], 1, 4).unwrap_err();
    assert!(matches!(err, CoreError::OutOfBlocks { requested: 1, free: 0, .. }), "{err:?}");
    let mut out = [0u32; 1];
    assert!(cache.alloc_evicting(&refs, None, &mut out).is_err());
    assert_eq!(before, (cache.stats(), cache.evictable_ids(), refs.num_free()));
    cache.check_invariants(&refs).unwrap();
}

#[test]
fn reset_refuses_while_referenced_then_drops_everything() {
    let (cache, refs) = setup(4);
    cache.set_events_enabled(true);
    let a = cache.alloc_with_prefix(&refs, None, &[], 2, 8).unwrap();
    store_all(&cache, &a.fresh, &(0..8).collect::<Vec<_>>());
    assert_eq!(cache.reset(&refs, None), Err(CoreError::CacheInUse { in_use: 2 }));
    cache.check_invariants(&refs).unwrap();
    cache.release(&refs, &a.fresh);
    assert_eq!(cache.reset(&refs, None), Ok(2));
    assert_eq!(refs.num_free(), 4);
    assert_eq!(cache.stats().num_cached_blocks, 0);
    cache.check_invariants(&refs).unwrap();
    assert_eq!(cache.drain_events().last(), Some(&KvEvent::AllBlocksCleared));
}

#[test]
fn duplicate_content_stays_uncached() {
    let (cache, refs) = setup(8);
    cache.set_events_enabled(true);
    let tokens: Vec<u32> = (0..8).collect();
    let a = cache.alloc_with_prefix(&refs, None, &[], 2, 8).unwrap();
    let hashes = store_all(&cache, &a.fresh, &tokens);
    cache.drain_events();
    // Another request computed the same two blocks before seeing the first's.
    let b = cache.alloc_with_prefix(&refs, None, &[], 2, 8).unwrap();
    assert_eq!(store_all(&cache, &b.fresh, &tokens), hashes);
    assert!(!cache.is_cached(b.fresh[0]) && !cache.is_cached(b.fresh[1]));
    assert!(cache.drain_events().is_empty());
    cache.check_invariants(&refs).unwrap();
}

#[test]
fn events_off_queue_nothing() {
    let (cache, refs) = setup(4);
    let a = cache.alloc_with_prefix(&refs, None, &[], 1, 4).unwrap();
    store_all(&cache, &a.fresh, &[1, 2, 3, 4]);
    assert!(cache.drain_events().is_empty());
    assert_eq!(cache.stats().stored_blocks, 1);
}

/// A cache over 4 "pool" blocks (a plain buffer stands in for the pool's slab) with a host
/// tier of 2 blocks.
fn setup_with_host_tier() -> (PrefixCache, FakeRefs, SpillTier, Vec<u8>, usize) {
    use crate::layout::{DType, KvLayout};
    let layout = KvLayout::new(1, 1, 16, BS, DType::Float16).unwrap();
    let block_bytes = layout.block_bytes();
    let device = vec![0u8; 4 * block_bytes];
    let engine = crate::block_copy::Engine::Host;
    let tier = SpillTier::new(
        layout.block_bytes(),
        layout.block_size(),
        2,
        None,
        engine,
        device.as_ptr() as u64,
        0,
    )
    .unwrap();
    let (cache, refs) = setup(4);
    (cache, refs, tier, device, block_bytes)
}

#[test]
fn evicted_blocks_spill_to_the_host_tier_and_come_back_on_a_hit() {
    let (cache, refs, tier, mut device, bb) = setup_with_host_tier();
    let spill = Some(&tier as &dyn SpillTarget);
    cache.set_events_enabled(true);
    let tokens: Vec<u32> = (0..12).collect();
    let a = cache.alloc_with_prefix(&refs, spill, &[], 3, 12).unwrap();
    let hashes = store_all(&cache, &a.fresh, &tokens);
    for (k, &b) in a.fresh.iter().enumerate() {
        device[b as usize * bb..][..bb].fill(10 + k as u8);
    }
    cache.release(&refs, &a.fresh);
    cache.drain_events();
    // Four blocks needed: the three cached ones are evicted; the host keeps the newest two
    // (the head of the request, released last).
    let mut out = [0u32; 4];
    cache.alloc_evicting(&refs, spill, &mut out).unwrap();
    let events = cache.drain_events();
    assert_eq!(
        events[0],
        KvEvent::BlockRemoved {
            group: 0,
            block_hashes: vec![hashes[2], hashes[1], hashes[0]],
            medium: Medium::Pool
        }
    );
    assert!(
        matches!(&events[1], KvEvent::BlockStored { block_hashes, token_ids, parent_block_hash: None, medium: Medium::HostTier, .. }
        if block_hashes == &[hashes[1], hashes[0]] && token_ids.is_empty())
    );
    assert_eq!(tier.cached_hashes(), [hashes[1], hashes[0]]);
    device.fill(0xEE);
    refs.push_free(&out);
    cache.check_invariants(&refs).unwrap();
    tier.check_invariants().unwrap();
    // The prompt again: nothing in the pool, its first two blocks on the host.
    let b = cache.alloc_with_prefix(&refs, spill, &hashes[..2], 3, 12).unwrap();
    assert_eq!((b.hits.len(), b.swapped_in), (0, 2));
    for (k, &blk) in b.fresh[..2].iter().enumerate() {
        assert!(
            device[blk as usize * bb..][..bb].iter().all(|&x| x == 10 + k as u8),
            "block {k} came back"
        );
    }
    let mut s = cache.stats();
    tier.fill_stats(&mut s);
    assert_eq!(
        (s.hits, s.host_num_cached_blocks, s.host_stored_blocks, s.swapped_in_blocks),
        (8, 0, 2, 2)
    );
    cache.check_invariants(&refs).unwrap();
    tier.check_invariants().unwrap();
}
