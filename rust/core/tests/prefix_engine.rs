//! What an engine and a router need from the prefix cache: a lookup that changes nothing,
//! a settable hash key.

use std::sync::Arc;

use kvpool_core::pool::PoolSize;
use kvpool_core::prefix_cache::{KvEvent, PrefixLookup};
use kvpool_core::tables::{BlockTables, PromptKey};
use kvpool_core::{DType, Device, KvLayout, Pool};

const BS: usize = 4;

fn layout() -> KvLayout {
    KvLayout::new(1, 1, 64, BS, DType::Float16).unwrap()
}

fn setup(num_blocks: usize, key: Option<[u8; 32]>) -> (Arc<Pool>, Arc<BlockTables>) {
    let pool = Pool::new(layout(), PoolSize::NumBlocks(num_blocks), Device::Host)
        .unwrap()
        .with_prefix_caching_key(key)
        .unwrap();
    let pool = Arc::new(pool);
    let tables = BlockTables::new(pool.clone(), 8, 8).unwrap();
    (pool, tables)
}

fn tokens(n: u32) -> Vec<u32> {
    (100..100 + n).collect()
}

/// Everything a lookup could disturb: ref counts, the evictable order, stats, queued events.
fn observable(pool: &Pool) -> (Vec<u32>, Vec<u32>, String) {
    let refs = (0..pool.num_blocks() as u32).map(|b| pool.ref_cnt(b).unwrap()).collect();
    let cache = pool.prefix_cache().unwrap();
    (refs, cache.evictable_ids(), format!("{:?}", pool.prefix_cache_stats()))
}

#[test]
fn lookup_answers_what_add_request_finds_and_changes_nothing() {
    let (pool, t) = setup(16, None);
    let key = PromptKey::default();
    pool.prefix_cache().unwrap().set_events_enabled(true);
    assert_eq!(pool.lookup_prefix(&tokens(12), &key), PrefixLookup::default());
    t.add_request(1, &tokens(12), &key).unwrap();
    t.add_request(2, &tokens(6), &PromptKey { cache_salt: Some(b"s"), ..key }).unwrap();
    t.free(1).unwrap();
    let events_before = pool.prefix_cache().unwrap().drain_events();
    assert!(!events_before.is_empty());
    let before = observable(&pool);
    // 12 tokens: the last token's block never hits; 13 tokens: all three blocks.
    assert_eq!(pool.lookup_prefix(&tokens(12), &key).num_blocks(), 2);
    assert_eq!(pool.lookup_prefix(&tokens(13), &key).num_blocks(), 3);
    assert_eq!(pool.lookup_prefix(&tokens(3), &key).num_blocks(), 0);
    // Salt and extra keys are part of the key.
    let salted = PromptKey { cache_salt: Some(b"s"), ..key };
    assert_eq!(pool.lookup_prefix(&tokens(13), &salted).num_blocks(), 1);
    let extra = PromptKey { extra_keys: b"img", ..key };
    assert_eq!(pool.lookup_prefix(&tokens(13), &extra).num_blocks(), 0);
    assert_eq!(observable(&pool), before, "a lookup changed the pool");
    assert!(pool.prefix_cache().unwrap().drain_events().is_empty(), "a lookup queued events");
    pool.check_invariants().unwrap();
    // And the add that follows finds exactly that.
    let found = pool.lookup_prefix(&tokens(13), &key).num_blocks();
    assert_eq!(t.add_request(3, &tokens(13), &key).unwrap().num_cached_tokens, found * BS);
}

#[test]
fn lookup_counts_host_tier_blocks_without_taking_them() {
    let pool = Pool::new(layout(), PoolSize::NumBlocks(4), Device::Host)
        .unwrap()
        .with_prefix_caching()
        .unwrap()
        .with_prefix_host_tier(8)
        .unwrap();
    let pool = Arc::new(pool);
    let t = BlockTables::new(pool.clone(), 8, 8).unwrap();
    let key = PromptKey::default();
    t.add_request(1, &tokens(13), &key).unwrap();
    t.free(1).unwrap();
    // A second prompt evicts the first's blocks into the host tier.
    t.add_request(2, &(500..516).collect::<Vec<u32>>(), &key).unwrap();
    t.free(2).unwrap();
    let before = pool.prefix_cache_stats();
    let found = pool.lookup_prefix(&tokens(13), &key);
    assert_eq!(found.num_blocks(), 3);
    assert!(found.host_blocks > 0, "{found:?}");
    assert_eq!(pool.prefix_cache_stats(), before);
    pool.check_invariants().unwrap();
}

fn stored_hashes(pool: &Pool) -> Vec<[u8; 32]> {
    pool.prefix_cache()
        .unwrap()
        .drain_events()
        .into_iter()
        .flat_map(|e| match e {
            KvEvent::BlockStored { block_hashes, .. } => block_hashes,
            _ => Vec::new(),
        })
        .map(|h| h.0)
        .collect()
}

#[test]
fn pools_with_one_hash_key_hash_alike_and_others_do_not() {
    let run = |key: Option<[u8; 32]>| {
        let (pool, t) = setup(16, key);
        pool.prefix_cache().unwrap().set_events_enabled(true);
        t.add_request(1, &tokens(9), &PromptKey::default()).unwrap();
        stored_hashes(&pool)
    };
    let a = run(Some([7; 32]));
    assert_eq!(a.len(), 2);
    assert_eq!(a, run(Some([7; 32])));
    assert_ne!(a, run(Some([8; 32])));
    assert_ne!(run(None), run(None), "the default key is random per pool");
}

#[test]
fn a_snapshot_plus_the_events_after_it_is_what_the_cache_holds() {
    use std::collections::BTreeSet;
    let (pool, t) = setup(6, None);
    let cache = pool.prefix_cache().unwrap();
    cache.set_events_enabled(true);
    let key = PromptKey::default();
    t.add_request(1, &tokens(9), &key).unwrap();
    t.free(1).unwrap();
    let snap = pool.prefix_cache_snapshot().unwrap();
    assert_eq!(snap.blocks.len(), 2);
    assert_eq!(snap.blocks.iter().filter(|b| b.parent.is_none()).count(), 1);
    let first = snap.blocks.iter().find(|b| b.parent.is_none()).unwrap().hash;
    assert!(snap.blocks.iter().any(|b| b.parent == Some(first)), "the chain is reported");
    // Events after the snapshot: another prompt evicts and stores.
    t.add_request(2, &(500..516).collect::<Vec<u32>>(), &key).unwrap();
    let mut held: BTreeSet<_> = snap.blocks.iter().map(|b| b.hash).collect();
    let batch = cache.drain_event_batch();
    assert_eq!(batch.dropped, 0);
    for e in batch.events.iter().filter(|e| e.seq > snap.seq) {
        match &e.event {
            KvEvent::BlockStored { block_hashes, .. } => held.extend(block_hashes),
            KvEvent::BlockRemoved { block_hashes, .. } => {
                block_hashes.iter().for_each(|h| assert!(held.remove(h)))
            }
            KvEvent::AllBlocksCleared => held.clear(),
        }
    }
    let now: BTreeSet<_> =
        pool.prefix_cache_snapshot().unwrap().blocks.iter().map(|b| b.hash).collect();
    assert_eq!(held, now);
    assert_eq!(pool.prefix_cache_snapshot().unwrap().seq, batch.last_seq);
}

#[test]
fn an_undrained_queue_stays_bounded_and_reports_the_gap() {
    let (pool, t) = setup(64, None);
    let cache = pool.prefix_cache().unwrap();
    cache.set_events_enabled(true);
    cache.set_max_queued_events(100);
    for r in 0..1000u64 {
        let prompt: Vec<u32> = (0..8).map(|i| (r as u32) * 8 + i).collect();
        t.add_request(r, &prompt, &PromptKey::default()).unwrap();
        t.free(r).unwrap();
    }
    assert_eq!(cache.num_queued_events(), 100);
    let batch = cache.drain_event_batch();
    assert_eq!(batch.events.len(), 100);
    assert_eq!(batch.dropped + 100, batch.last_seq, "every numbered event is kept or counted");
    assert_eq!(batch.events.last().unwrap().seq, batch.last_seq);
    assert_eq!(cache.drain_event_batch().dropped, 0);
    pool.check_invariants().unwrap();
}
