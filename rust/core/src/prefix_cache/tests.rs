//! The cache against a plain stand-in for the allocator (a Vec of counts and a Vec free
//! list), so these tests need neither the lock-free list nor the tables.

use std::sync::Mutex;

use super::*;
use crate::pool::{AttachedStage, EvictionStage, LowerTiers, SpillTier};

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
fn setup_with_host_tier() -> (PrefixCache, FakeRefs, LowerTiers, Vec<u8>, usize) {
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
    let lower = LowerTiers { host: Some(tier), ..Default::default() };
    (cache, refs, lower, device, block_bytes)
}

#[test]
fn evicted_blocks_spill_to_the_host_tier_and_come_back_on_a_hit() {
    let (cache, refs, lower, mut device, bb) = setup_with_host_tier();
    let spill = lower.target();
    let tier = lower.host.as_ref().unwrap();
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

/// Fills `blocks` of the stand-in slab with `first`, `first + 1`, ... and releases them.
fn compute_and_release(
    cache: &PrefixCache,
    refs: &FakeRefs,
    device: &mut [u8],
    bb: usize,
    blocks: &[u32],
    first: u8,
) {
    for (k, &b) in blocks.iter().enumerate() {
        device[b as usize * bb..][..bb].fill(first + k as u8);
    }
    cache.release(refs, blocks);
}

/// What a stage took, as (hash, the byte every byte of its slot holds).
fn take_staged(stage: &EvictionStage) -> Vec<(BlockHash, u8)> {
    let (take_id, taken) = stage.take(usize::MAX);
    let out = taken
        .iter()
        .map(|&(slot, hash)| {
            let at = stage.base_ptr() as usize + slot as usize * stage.block_bytes();
            // SAFETY: a taken slot of the stage, inside its allocation, written by no capture.
            let bytes = unsafe { std::slice::from_raw_parts(at as *const u8, stage.block_bytes()) };
            assert!(bytes.iter().all(|&x| x == bytes[0]), "one block's bytes, whole");
            (hash, bytes[0])
        })
        .collect();
    stage.release(take_id, &taken.iter().map(|&(slot, _)| slot).collect::<Vec<_>>()).unwrap();
    out
}

#[test]
fn blocks_leaving_the_last_memory_tier_reach_the_stage_with_their_bytes() {
    let (cache, refs, lower, mut device, bb) = setup_with_host_tier();
    let stage = EvictionStage::new(4, bb).unwrap();
    assert!(lower.stage.set(AttachedStage::new(stage, device.as_ptr() as u64)).is_ok());
    let spill = lower.target();
    let stage = &lower.stage.get().unwrap().stage;
    let a = cache.alloc_with_prefix(&refs, spill, &[], 3, 12).unwrap();
    let first = store_all(&cache, &a.fresh, &(0..12).collect::<Vec<u32>>());
    compute_and_release(&cache, &refs, &mut device, bb, &a.fresh, 10);
    // Four blocks: the three cached ones are evicted, the host keeps two; the third leaves
    // memory, from the pool's own slab, before the caller gets its block.
    let mut out = [0u32; 4];
    cache.alloc_evicting(&refs, spill, &mut out).unwrap();
    device.fill(0xEE); // the caller overwrites what it got
    assert_eq!(take_staged(stage), [(first[2], 12)]);
    refs.push_free(&out);
    // A second prompt: its three blocks are evicted in turn; the pool's LRU block leaves
    // memory straight away, and the host drops its two to take the other two.
    let b = cache.alloc_with_prefix(&refs, spill, &[], 3, 12).unwrap();
    let second = store_all(&cache, &b.fresh, &(100..112).collect::<Vec<u32>>());
    compute_and_release(&cache, &refs, &mut device, bb, &b.fresh, 20);
    cache.alloc_evicting(&refs, spill, &mut out).unwrap();
    device.fill(0xEE);
    assert_eq!(take_staged(stage), [(second[2], 22), (first[1], 11), (first[0], 10)]);
    let stats = stage.stats();
    assert_eq!((stats.captured, stats.dropped, stats.taken), (4, 0, 4));
    refs.push_free(&out);
    stage.check_invariants().unwrap();
    cache.check_invariants(&refs).unwrap();
    lower.host.as_ref().unwrap().check_invariants().unwrap();
}

#[test]
fn without_a_host_tier_the_pool_blocks_go_to_the_stage_and_a_reset_drops_them() {
    let (cache, refs) = setup(3);
    let bb = 64;
    let mut device = vec![0u8; 3 * bb];
    let lower = LowerTiers::default();
    assert!(lower.target().is_none(), "nothing below: the cache evicts as it always did");
    let stage = EvictionStage::new(2, bb).unwrap();
    assert!(lower.stage.set(AttachedStage::new(stage, device.as_ptr() as u64)).is_ok());
    let spill = lower.target();
    let stage = &lower.stage.get().unwrap().stage;
    let a = cache.alloc_with_prefix(&refs, spill, &[], 3, 12).unwrap();
    let hashes = store_all(&cache, &a.fresh, &(0..12).collect::<Vec<u32>>());
    compute_and_release(&cache, &refs, &mut device, bb, &a.fresh, 1);
    let mut out = [0u32; 3];
    cache.alloc_evicting(&refs, spill, &mut out).unwrap();
    // Three evicted into two slots: the oldest staged one is overwritten, and counted.
    assert_eq!(stage.stats().dropped, 1);
    assert_eq!(take_staged(stage), [(hashes[1], 2), (hashes[0], 1)]);
    refs.push_free(&out);
    let b = cache.alloc_with_prefix(&refs, spill, &[], 2, 8).unwrap();
    store_all(&cache, &b.fresh, &(50..58).collect::<Vec<u32>>());
    compute_and_release(&cache, &refs, &mut device, bb, &b.fresh, 7);
    cache.alloc_evicting(&refs, spill, &mut out).unwrap();
    assert_eq!(stage.stats().num_filled, 2);
    refs.push_free(&out);
    cache.reset(&refs, spill).unwrap();
    assert_eq!(stage.stats().num_filled, 0, "a reset's stale KV leaves the stage too");
    stage.check_invariants().unwrap();
    cache.check_invariants(&refs).unwrap();
}

#[test]
fn disk_events_join_the_queue_in_order_and_the_snapshot_lists_disk_blocks() {
    let (cache, refs) = setup(2);
    cache.set_events_enabled(true);
    let a = cache.alloc_with_prefix(&refs, None, &[], 2, 8).unwrap();
    let hashes = store_all(&cache, &a.fresh, &(0..8).collect::<Vec<u32>>());
    let disk = |stored: bool, hashes: Vec<BlockHash>| match stored {
        true => KvEvent::BlockStored {
            group: 0,
            block_hashes: hashes,
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: BS,
            lora_id: None,
            medium: Medium::Disk,
        },
        false => KvEvent::BlockRemoved { group: 0, block_hashes: hashes, medium: Medium::Disk },
    };
    let other = BlockHash([9; 32]);
    assert_eq!(cache.record_external_event(disk(true, vec![hashes[0], other])).unwrap(), 2);
    assert_eq!(cache.record_external_event(disk(false, vec![hashes[0]])).unwrap(), 3);
    let pool_event = KvEvent::BlockRemoved { group: 0, block_hashes: vec![], medium: Medium::Pool };
    assert!(cache.record_external_event(pool_event).is_err(), "the core makes its own");
    assert!(cache.record_external_event(KvEvent::AllBlocksCleared).is_err());
    let batch = cache.drain_event_batch();
    assert_eq!(batch.events.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3]);
    let snap = cache.snapshot(None);
    assert_eq!(snap.seq, 3);
    let on_disk: Vec<BlockHash> =
        snap.blocks.iter().filter(|b| b.medium == Medium::Disk).map(|b| b.hash).collect();
    assert_eq!(on_disk, [other]);
    assert_eq!(snap.blocks.len(), 3, "two pool blocks and one on disk");
    cache.release(&refs, &a.fresh);
    cache.reset(&refs, None).unwrap();
    assert_eq!(cache.num_external_blocks(), 0, "AllBlocksCleared covers the disk too");
    cache.set_events_enabled(false);
    assert_eq!(cache.record_external_event(disk(true, vec![other])).unwrap(), 0);
    assert_eq!(cache.num_external_blocks(), 1, "kept with events off");
}
