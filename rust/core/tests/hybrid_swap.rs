//! `HybridHostTier` over hybrid tables that cache prefixes, on a host pool of the spec's
//! pages: a cached request swaps out and back with its cached pages kept (a hit serves
//! them meanwhile), a swap-in short of free pages evicts through the tables (its events
//! name the groups' chunk hashes, never the pages' tags), one that cannot fit changes
//! nothing, and a page revived by a hit is still the tables' (the plain pool API refuses it).

use std::collections::HashSet;
use std::sync::Arc;

use kvpool_core::hybrid::{HybridHostTier, HybridTables, ModelKvSpec};
use kvpool_core::pool::PoolSize;
use kvpool_core::prefix_cache::{BlockHash, KvEvent};
use kvpool_core::tables::PromptKey;
#[cfg(feature = "cuda")]
use kvpool_core::tier::CopyMethod;
use kvpool_core::{CoreError, Device, Pool};

#[path = "common/hybrid.rs"]
#[allow(dead_code)] // The byte helpers are the other hybrid tests'.
mod hybrid_common;

/// Full (21 tokens a page), window 20 (5 a page), a 2-page state, MLA (2 a page), chunks
/// of 24 (4 a page), over a caching host pool of `num_pages` of its pages.
fn caching_tables(num_pages: usize) -> HybridTables {
    let spec: ModelKvSpec = hybrid_common::cached_spec(20, 24, true);
    let pool = Pool::new(&spec, PoolSize::NumBlocks(num_pages), Device::Host).unwrap();
    let pool = Arc::new(pool.with_prefix_caching().unwrap());
    HybridTables::new(pool, spec).unwrap()
}

fn host_tier(tables: &HybridTables, num_pages: usize) -> HybridHostTier {
    #[cfg(feature = "cuda")]
    return HybridHostTier::new(tables, PoolSize::NumBlocks(num_pages), CopyMethod::Auto).unwrap();
    #[cfg(not(feature = "cuda"))]
    HybridHostTier::new(tables, PoolSize::NumBlocks(num_pages)).unwrap()
}

fn swap_out(tier: &mut HybridHostTier, t: &mut HybridTables, ids: &[u64]) {
    // SAFETY: a host pool: no stream is given and none is used.
    unsafe { tier.swap_out(t, ids, None) }.unwrap();
    tier.wait().unwrap();
}

fn swap_in(tier: &mut HybridHostTier, t: &mut HybridTables, ids: &[u64]) -> Result<(), CoreError> {
    // SAFETY: as in `swap_out`.
    unsafe { tier.swap_in(t, ids, None) }?;
    tier.wait().unwrap();
    Ok(())
}

/// A chunk hash with the group whose pages hold it.
type GroupHash = (u32, BlockHash);

/// The (group, chunk hash) pairs stored and removed by `events`.
fn split_events(events: &[KvEvent]) -> (Vec<GroupHash>, Vec<GroupHash>) {
    let (mut stored, mut removed) = (Vec::new(), Vec::new());
    for event in events {
        match event {
            KvEvent::BlockStored { group, block_hashes, .. } => {
                stored.extend(block_hashes.iter().map(|h| (*group, *h)))
            }
            KvEvent::BlockRemoved { group, block_hashes, .. } => {
                removed.extend(block_hashes.iter().map(|h| (*group, *h)))
            }
            KvEvent::AllBlocksCleared => {}
        }
    }
    (stored, removed)
}

#[test]
fn a_cached_request_swaps_out_and_back_and_its_cached_pages_serve_a_hit_meanwhile() {
    let mut t = caching_tables(400);
    let mut tier = host_tier(&t, 200);
    let key = PromptKey::default();
    let prompt: Vec<u32> = (0..32).collect();
    t.add_request(1, &prompt, &key).unwrap();
    // The prompt has run: its chunks are cached, and the state checkpointed after it.
    assert_eq!(t.checkpoint(1).unwrap().len(), 2);
    t.append_tokens(1, &(32..40).collect::<Vec<u32>>()).unwrap();
    let cached_before: usize = t.cache_stats().iter().map(|s| s.cached_pages).sum();
    assert!(cached_before > 0);
    let held = t.request_pages(1).unwrap().len();

    swap_out(&mut tier, &mut t, &[1]);
    tier.check_invariants(&t).unwrap();
    assert_eq!(t.pool().num_used(), 0, "every device page went back");
    let stats = t.cache_stats();
    assert_eq!(stats.iter().map(|s| s.cached_pages).sum::<usize>(), cached_before);
    assert_eq!(stats.iter().map(|s| s.evictable_pages).sum::<usize>(), cached_before);

    // Swapped out, its cached pages still serve a hit (revived: the tables' pages again).
    let mut other: Vec<u32> = (0..40).collect();
    other.extend(900..910);
    assert_eq!(t.add_request(2, &other, &key).unwrap().num_cached_tokens, 32);
    let shared = t.table(2, 0).unwrap().page_ids[0];
    assert_eq!(t.cached_page_group(shared), Some(0));
    match t.pool().free(shared) {
        Err(CoreError::InvalidBlock { reason, .. }) => assert!(reason.contains("hybrid tables")),
        other => panic!("Pool::free of a revived hybrid page: {other:?}"),
    }
    tier.check_invariants(&t).unwrap();

    swap_in(&mut tier, &mut t, &[1]).unwrap();
    tier.check_invariants(&t).unwrap();
    assert_eq!(t.request_pages(1).unwrap().len(), held);
    // It carries on, and its later chunks are cached from its new pages.
    let more: Vec<u32> = (41..70).collect();
    t.append_tokens(1, &more).unwrap();
    t.cache_computed(1).unwrap();
    tier.check_invariants(&t).unwrap();
    for id in [1, 2] {
        t.free(id).unwrap();
    }
    t.check_invariants().unwrap();
    assert_eq!(t.pool().num_used(), 0);
}

#[test]
fn a_swap_in_short_of_free_pages_evicts_through_the_tables_or_changes_nothing() {
    let mut t = caching_tables(160);
    let mut tier = host_tier(&t, 200);
    let pool = t.pool().clone();
    let cache = pool.prefix_cache().unwrap();
    cache.set_events_enabled(true);
    let key = PromptKey::default();
    let prompt: Vec<u32> = (0..64).collect();
    t.add_request(1, &prompt, &key).unwrap();
    t.append_tokens(1, &[64]).unwrap();
    let needed = t.request_pages(1).unwrap().len();
    swap_out(&mut tier, &mut t, &[1]);
    assert!(pool.num_evictable() > 0);

    // Other requests take the free pages until request 1 no longer fits in them alone.
    let mut next_id = 10;
    while pool.num_free() >= needed {
        t.add(next_id, 1).unwrap();
        next_id += 1;
    }
    assert!(pool.num_free() + pool.num_evictable() >= needed, "the setup leaves room");
    let (stored, _) = split_events(&cache.drain_events());
    let stored: HashSet<GroupHash> = stored.into_iter().collect();

    swap_in(&mut tier, &mut t, &[1]).unwrap();
    tier.check_invariants(&t).unwrap();
    let (_, removed) = split_events(&cache.drain_events());
    assert!(!removed.is_empty(), "the swap-in evicted cached pages and says so");
    for entry in &removed {
        assert!(stored.contains(entry), "{entry:?} was never reported stored in that group");
    }

    // Swapped out again, then too little room even counting the evictable pages: refused.
    swap_out(&mut tier, &mut t, &[1]);
    while pool.num_free() + pool.num_evictable() >= needed {
        t.add(next_id, 1).unwrap();
        next_id += 1;
    }
    let before = (pool.num_free(), pool.num_evictable(), t.cache_stats());
    cache.drain_events();
    let err = swap_in(&mut tier, &mut t, &[1]).unwrap_err();
    assert!(matches!(err, CoreError::OutOfBlocks { .. }), "{err:?}");
    assert_eq!((pool.num_free(), pool.num_evictable(), t.cache_stats()), before);
    assert!(cache.drain_events().is_empty(), "a refused swap-in evicts nothing");
    assert_eq!(tier.request_ids(), [1]);
    tier.check_invariants(&t).unwrap();
}
