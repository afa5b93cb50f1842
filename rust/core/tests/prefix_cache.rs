//! Prefix caching through the block tables on a host pool: hits, the last-token rule,
//! eviction order, copy-on-write with cached blocks, salts, reset, events.

use std::sync::Arc;

use kvpool_core::pool::PoolSize;
use kvpool_core::prefix_cache::KvEvent;
use kvpool_core::tables::{BlockTables, PromptKey};
use kvpool_core::{CoreError, DType, Device, KvLayout, Pool};

const BS: usize = 4;

fn setup(num_blocks: usize) -> (Arc<Pool>, Arc<BlockTables>) {
    let layout = KvLayout::new(1, 1, 64, BS, DType::Float16).unwrap();
    let pool = Pool::new(layout, PoolSize::NumBlocks(num_blocks), Device::Host)
        .unwrap()
        .with_prefix_caching()
        .unwrap();
    let pool = Arc::new(pool);
    let tables = BlockTables::new(pool.clone(), 8, 8).unwrap();
    (pool, tables)
}

fn check(pool: &Pool, tables: &BlockTables) {
    tables.check_invariants().unwrap();
    pool.check_invariants_with(true).unwrap();
}

fn tokens(n: u32) -> Vec<u32> {
    (100..100 + n).collect()
}

#[test]
fn a_repeated_prompt_hits_all_but_its_last_token() {
    let (pool, t) = setup(16);
    let key = PromptKey::default();
    let first = t.add_request(1, &tokens(12), &key).unwrap();
    assert_eq!(first.num_cached_tokens, 0);
    assert_eq!(first.slot_mapping.len(), 12);
    check(&pool, &t);
    // 12 tokens: the third block holds the last token, so only two blocks can hit.
    let second = t.add_request(2, &tokens(12), &key).unwrap();
    assert_eq!(second.num_cached_tokens, 8);
    assert_eq!(second.slot_mapping.len(), 4);
    let (b1, b2) = (t.blocks(1).unwrap(), t.blocks(2).unwrap());
    assert_eq!(b1[..2], b2[..2]);
    assert_ne!(b1[2], b2[2]);
    assert_eq!(pool.ref_cnt(b1[0] as u32).unwrap(), 2);
    check(&pool, &t);
    // Freed: the cached blocks stay, evictable; the duplicate third block of 2 was not cached.
    t.free(1).unwrap();
    t.free(2).unwrap();
    assert_eq!(pool.num_evictable(), 3);
    assert_eq!(pool.num_free() + pool.num_evictable() + pool.num_used(), 16);
    check(&pool, &t);
    // A longer prompt with the same head revives them.
    let third = t.add_request(3, &tokens(13), &key).unwrap();
    assert_eq!(third.num_cached_tokens, 12);
    assert_eq!(pool.num_evictable(), 0);
    check(&pool, &t);
    let s = pool.prefix_cache().unwrap().stats();
    assert_eq!((s.requests, s.queries, s.hits), (3, 37, 20));
}

#[test]
fn appends_with_ids_cache_blocks_and_salts_isolate() {
    let (pool, t) = setup(16);
    t.add_request(1, &tokens(3), &PromptKey::default()).unwrap();
    t.append_tokens_many_with_ids(&[1], &[6], Some(&(103..109).collect::<Vec<_>>())).unwrap();
    check(&pool, &t);
    assert_eq!(pool.prefix_cache().unwrap().stats().num_cached_blocks, 2);
    let salted = PromptKey { cache_salt: Some(b"tenant-b"), ..Default::default() };
    assert_eq!(t.add_request(2, &tokens(9), &salted).unwrap().num_cached_tokens, 0);
    assert_eq!(t.add_request(3, &tokens(9), &PromptKey::default()).unwrap().num_cached_tokens, 8);
    assert_eq!(t.add_request(4, &tokens(9), &salted).unwrap().num_cached_tokens, 8);
    check(&pool, &t);
    // Appending without ids stops caching that request.
    t.append_tokens(3, 3).unwrap();
    assert_eq!(pool.prefix_cache().unwrap().stats().num_cached_blocks, 4);
    check(&pool, &t);
}

#[test]
fn eviction_takes_tail_blocks_first_and_never_a_referenced_block() {
    let (pool, t) = setup(6);
    let key = PromptKey::default();
    t.add_request(1, &tokens(16), &key).unwrap(); // 4 cached blocks
    let b1 = t.blocks(1).unwrap();
    t.free(1).unwrap();
    t.add_request(2, &tokens(5), &key).unwrap(); // hits b1[0], takes a free block
    check(&pool, &t);
    // Needs 3 blocks: 1 free, then the two least recently used: b1[3], then b1[2].
    t.add(3, 12).unwrap();
    let b3 = t.blocks(3).unwrap();
    assert!(b3.contains(&b1[3]) && b3.contains(&b1[2]) && !b3.contains(&b1[1]));
    assert_eq!(pool.prefix_cache().unwrap().stats().evictions, 2);
    check(&pool, &t);
    let err = t.add(4, 8).unwrap_err();
    assert!(matches!(err, CoreError::OutOfBlocks { requested: 2, free: 1, .. }), "{err:?}");
    check(&pool, &t);
}

#[test]
fn fork_and_copy_on_write_with_cached_blocks() {
    let (pool, t) = setup(16);
    t.add_request(1, &tokens(6), &PromptKey::default()).unwrap();
    t.fork(1, 2).unwrap();
    let r = t.append_tokens_many_with_ids(&[1, 2], &[2, 3], Some(&[1, 2, 3, 4, 5])).unwrap();
    // Only the shared partial block is copied; the cached full block stays shared.
    assert_eq!(r.copies.len(), 1);
    assert_eq!(t.blocks(1).unwrap()[0], t.blocks(2).unwrap()[0]);
    check(&pool, &t);
    // Both filled their second block with different tokens: both cached, differently.
    assert_eq!(pool.prefix_cache().unwrap().stats().num_cached_blocks, 3);
    t.free(1).unwrap();
    t.free(2).unwrap();
    check(&pool, &t);
    assert_eq!(pool.num_evictable(), 3);
}

#[test]
fn reset_and_events() {
    let (pool, t) = setup(8);
    let cache = pool.prefix_cache().unwrap();
    cache.set_events_enabled(true);
    t.add_request(1, &tokens(9), &PromptKey { lora_id: Some(3), ..Default::default() }).unwrap();
    assert_eq!(pool.reset_prefix_cache(), Err(CoreError::CacheInUse { in_use: 2 }));
    t.free(1).unwrap();
    assert_eq!(pool.reset_prefix_cache(), Ok(2));
    assert_eq!(pool.num_free(), 8);
    check(&pool, &t);
    let events = cache.drain_events();
    assert!(
        matches!(&events[0], KvEvent::BlockStored { block_hashes, parent_block_hash: None, token_ids, lora_id: Some(3), .. }
        if block_hashes.len() == 2 && token_ids == &tokens(8))
    );
    assert_eq!(events[1], KvEvent::AllBlocksCleared);
    assert_eq!(events.len(), 2);
}
