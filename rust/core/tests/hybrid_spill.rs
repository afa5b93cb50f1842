//! Cached pages of `HybridTables` spilling to the prefix cache's host tier: evicted pages of
//! every group (token pages and state checkpoints) go to the tier under their group's keys,
//! a later prompt sharing the prefix brings them back (checked down to the bytes), KV events
//! name each move's group and medium, the invariants hold over both tiers, a refused call
//! changes neither, and a swap-in from the wrong host slot fails the content check.

use std::sync::Arc;

use kvpool_core::hybrid::mutation::{self, Mutation};
use kvpool_core::hybrid::{HybridTables, ModelKvSpec};
use kvpool_core::layout::KvPart;
use kvpool_core::pool::PoolSize;
use kvpool_core::prefix_cache::{KvEvent, Medium};
use kvpool_core::tables::PromptKey;
use kvpool_core::{CoreError, Device, Pool};

#[path = "common/hybrid.rs"]
#[allow(dead_code)] // The helpers other hybrid tests use.
mod hybrid_common;
use hybrid_common::{read_u64, run_copies, write_u64, PAGE_BYTES};

const FULL: usize = 0;
const WINDOW: usize = 1;
const STATE: usize = 2;
const MLA: usize = 3;
const NUM_GROUPS: usize = 5;
const WINDOW_SIZE: usize = 20;

/// Full (21 tokens a page), window 20 (5 a page), a state (2 pages a slot), MLA (2 a page),
/// chunks of 24 (4 a page), over a caching pool of `num_pages` whose cache spills to a host
/// tier of `host_pages`.
fn spilling(num_pages: usize, host_pages: usize) -> HybridTables {
    let spec = hybrid_common::cached_spec(WINDOW_SIZE, 24, true);
    let pool = Pool::new(&spec, PoolSize::NumBlocks(num_pages), Device::Host).unwrap();
    let pool = pool.with_prefix_caching().unwrap().with_prefix_host_tier(host_pages).unwrap();
    pool.prefix_cache().unwrap().set_events_enabled(true);
    HybridTables::new(Arc::new(pool), spec).unwrap()
}

/// What the kernels write for token `p` of group `g` of the test's one prompt family.
fn mark(g: usize, p: usize) -> u64 {
    0x5eed_0000_0000 | ((g as u64 + 1) << 20) | p as u64
}

/// The state after `t` tokens, page `i` of the slot.
fn state_mark(t: usize, i: usize) -> u64 {
    0x57a7_0000_0000 | ((t as u64) << 8) | i as u64
}

fn token_offset(spec: &ModelKvSpec, g: usize, slot: i64, block_size: usize) -> usize {
    let (page, token) = (slot as usize / block_size, slot as usize % block_size);
    if g == MLA {
        spec.latent_offset_bytes(g, page, 0, token, 0).unwrap()
    } else {
        spec.attention_offset_bytes(g, page, 0, KvPart::K, token, 0, 0).unwrap()
    }
}

/// Plays the kernels of a step computing `id`'s tokens `from..` (and its state after them).
fn write_step(t: &HybridTables, id: u64, from: usize) {
    let pool = t.pool();
    let n = t.num_tokens(id).unwrap();
    for g in 0..NUM_GROUPS {
        let table = t.table(id, g).unwrap();
        match table.block_size {
            None => {
                for (i, &page) in table.page_ids.iter().enumerate() {
                    write_u64(pool, page as usize * PAGE_BYTES, state_mark(n, i));
                }
            }
            Some(bs) => {
                for p in from..n {
                    let slot = table.slot(p).expect("a token being computed is held");
                    write_u64(pool, token_offset(t.spec(), g, slot, bs), mark(g, p));
                }
            }
        }
    }
}

/// Whether every key the query at `query` sees, and the state slot, read back what the
/// step that computed them wrote.
fn reads_back(t: &HybridTables, id: u64, query: usize) -> bool {
    let pool = t.pool();
    (0..NUM_GROUPS).all(|g| {
        let table = t.table(id, g).unwrap();
        match table.block_size {
            None => table.page_ids.iter().enumerate().all(|(i, &page)| {
                read_u64(pool, page as usize * PAGE_BYTES) == state_mark(query, i)
            }),
            Some(bs) => {
                let first = if g == WINDOW { (query + 1).saturating_sub(WINDOW_SIZE) } else { 0 };
                let first = if g == 4 { query / 24 * 24 } else { first };
                (first..query).all(|p| {
                    let offset = token_offset(t.spec(), g, table.slot(p).unwrap(), bs);
                    read_u64(pool, offset) == mark(g, p)
                })
            }
        }
    })
}

/// Per group and medium, the chunk hashes the drained events stored and removed.
#[derive(Default, Debug)]
struct Moves {
    stored: Vec<(u32, Medium, usize)>,
    removed: Vec<(u32, Medium, usize)>,
}

fn drain(t: &HybridTables) -> Moves {
    let mut moves = Moves::default();
    for event in t.pool().prefix_cache().unwrap().drain_events() {
        match event {
            KvEvent::BlockStored { group, block_hashes, medium, .. } => {
                moves.stored.push((group, medium, block_hashes.len()))
            }
            KvEvent::BlockRemoved { group, block_hashes, medium } => {
                moves.removed.push((group, medium, block_hashes.len()))
            }
            KvEvent::AllBlocksCleared => {}
        }
    }
    moves
}

fn groups_of(moves: &[(u32, Medium, usize)], medium: Medium) -> Vec<u32> {
    let mut groups: Vec<u32> = moves.iter().filter(|m| m.1 == medium).map(|m| m.0).collect();
    groups.sort_unstable();
    groups.dedup();
    groups
}

/// Request 1 computes 48 tokens of the prompt family, checkpoints its state there and ends;
/// an unrelated request then takes most of the pool, evicting (spilling) request 1's pages.
fn cache_then_evict(t: &mut HybridTables) {
    let key = PromptKey::default();
    let prompt: Vec<u32> = (0..40).collect();
    t.add_request(1, &prompt, &key).unwrap();
    write_step(t, 1, 0);
    t.append_tokens(1, &(40..48).collect::<Vec<u32>>()).unwrap();
    write_step(t, 1, 40);
    let copies = t.checkpoint(1).unwrap();
    run_copies(t.pool(), &copies);
    t.free(1).unwrap();
    t.check_invariants().unwrap();
    drain(t);
    let unrelated: Vec<u32> = (10_000..10_096).collect();
    t.add_request(2, &unrelated, &key).unwrap();
    t.check_invariants().unwrap();
    t.free(2).unwrap();
}

#[test]
fn evicted_pages_spill_per_group_and_a_hit_brings_them_back_with_their_bytes() {
    let mut t = spilling(100, 128);
    cache_then_evict(&mut t);
    // Every group's pages left the pool (its events say so) and are on the host tier.
    // (Events were drained after request 1; these are request 2's evictions.)
    let stats = t.cache_stats();
    for (g, group) in stats.iter().enumerate() {
        assert!(group.host_pages > 0, "group {g} spilled nothing: {stats:?}");
    }
    let host_total: usize = stats.iter().map(|s| s.host_pages).sum();
    let pool_stats = t.pool().prefix_cache_stats().unwrap();
    assert_eq!(pool_stats.host_num_cached_blocks, host_total);
    assert_eq!(pool_stats.host_evictions, 0, "the host tier had room for every page");
    t.check_invariants().unwrap();

    // A prompt sharing the 48 tokens: the hit counts the host pages, every group serves it.
    let key = PromptKey::default();
    let prompt: Vec<u32> = (0..48).chain(500..505).collect();
    let added = t.add_request(3, &prompt, &key).unwrap();
    assert_eq!(added.num_cached_tokens, 48);
    assert!(added.swapped_in_pages > 0);
    let moves = drain(&t);
    // Brought back: removed from the host tier and stored in the pool, per group; the state
    // group's checkpoint among them.
    let back = groups_of(&moves.removed, Medium::HostTier);
    assert!(back.contains(&(FULL as u32)) && back.contains(&(STATE as u32)), "{moves:?}");
    assert_eq!(back, groups_of(&moves.stored, Medium::Pool), "{moves:?}");
    run_copies(t.pool(), &added.copies);
    assert!(reads_back(&t, 3, 48), "a page brought back holds other bytes");
    t.check_invariants().unwrap();
    let swapped_in = t.pool().prefix_cache_stats().unwrap().swapped_in_blocks;
    assert_eq!(swapped_in, added.swapped_in_pages as u64);
    t.free(3).unwrap();
    t.check_invariants().unwrap();
    assert_eq!(t.pool().num_used(), 0);
}

#[test]
fn spilling_reports_each_group_on_both_mediums() {
    let mut t = spilling(100, 128);
    let key = PromptKey::default();
    t.add_request(1, &(0..40).collect::<Vec<u32>>(), &key).unwrap();
    t.append_tokens(1, &(40..48).collect::<Vec<u32>>()).unwrap();
    t.checkpoint(1).unwrap();
    t.free(1).unwrap();
    drain(&t);
    t.add_request(2, &(10_000..10_090).collect::<Vec<u32>>(), &key).unwrap();
    let moves = drain(&t);
    let removed = groups_of(&moves.removed, Medium::Pool);
    assert_eq!(removed, groups_of(&moves.stored, Medium::HostTier), "{moves:?}");
    assert!(removed.contains(&(STATE as u32)) && removed.contains(&(MLA as u32)), "{moves:?}");
    // Each chunk hash removed from the pool is stored on the host (the tier had room).
    let count = |m: &[(u32, Medium, usize)], medium| -> usize {
        m.iter().filter(|x| x.1 == medium).map(|x| x.2).sum()
    };
    assert_eq!(count(&moves.removed, Medium::Pool), count(&moves.stored, Medium::HostTier));
    t.check_invariants().unwrap();
}

#[test]
fn a_hit_from_the_wrong_host_slot_fails_the_content_check() {
    let mut t = spilling(100, 128);
    cache_then_evict(&mut t);
    let prompt: Vec<u32> = (0..48).chain(500..505).collect();
    mutation::set(Some(Mutation::HostHitFromTheNextSlot));
    let added = t.add_request(3, &prompt, &PromptKey::default());
    mutation::set(None);
    let added = added.unwrap();
    assert_eq!(added.num_cached_tokens, 48);
    run_copies(t.pool(), &added.copies);
    assert!(!reads_back(&t, 3, 48), "the content check missed pages from the wrong host slot");
}

#[test]
fn a_refused_add_changes_neither_tier() {
    let mut t = spilling(100, 128);
    cache_then_evict(&mut t);
    let key = PromptKey::default();
    // A request holding most of the pool, then a prompt whose hit needs host pages and fresh
    // ones beyond what is left.
    t.add_request(4, &(20_000..20_080).collect::<Vec<u32>>(), &key).unwrap();
    let before = (t.cache_stats(), t.pool().num_free(), t.pool().prefix_cache_stats());
    let prompt: Vec<u32> = (0..48).chain(600..630).collect();
    let err = t.add_request(3, &prompt, &key).unwrap_err();
    assert!(matches!(err, CoreError::OutOfBlocks { .. }), "{err:?}");
    assert_eq!(before, (t.cache_stats(), t.pool().num_free(), t.pool().prefix_cache_stats()));
    t.check_invariants().unwrap();
    // Once there is room the same prompt hits the host pages.
    t.free(4).unwrap();
    let added = t.add_request(3, &prompt, &key).unwrap();
    assert_eq!(added.num_cached_tokens, 48);
    run_copies(t.pool(), &added.copies);
    assert!(reads_back(&t, 3, 48));
    t.check_invariants().unwrap();
}

#[test]
fn a_small_host_tier_keeps_whole_checkpoints_and_no_stale_key() {
    // 5 host pages: the tier drops most of what spills, and must never keep half a slot.
    for host_pages in [1, 2, 3, 5, 9] {
        let mut t = spilling(100, host_pages);
        cache_then_evict(&mut t);
        t.check_invariants().unwrap();
        let stats = t.cache_stats();
        assert!(stats[STATE].host_pages % 2 == 0, "half a checkpoint on the host: {stats:?}");
        let prompt: Vec<u32> = (0..48).chain(500..505).collect();
        let added = t.add_request(3, &prompt, &PromptKey::default()).unwrap();
        run_copies(t.pool(), &added.copies);
        let h = added.num_cached_tokens;
        assert!(h == 0 || reads_back(&t, 3, h), "host pages {host_pages}: a hit of {h}");
        t.check_invariants().unwrap();
    }
}

#[test]
fn a_reset_leaves_no_host_page_to_serve() {
    let mut t = spilling(100, 128);
    cache_then_evict(&mut t);
    assert!(t.cache_stats().iter().any(|s| s.host_pages > 0));
    t.pool().reset_prefix_cache().unwrap();
    t.check_invariants().unwrap();
    assert!(t.cache_stats().iter().all(|s| s.host_pages == 0 && s.cached_pages == 0));
    let prompt: Vec<u32> = (0..48).chain(500..505).collect();
    let added = t.add_request(3, &prompt, &PromptKey::default()).unwrap();
    assert_eq!(added.num_cached_tokens, 0);
    t.check_invariants().unwrap();
    // Spilling again after the reset drops the stale entries and keeps the new pages.
    t.free(3).unwrap();
    cache_then_evict(&mut t);
    t.check_invariants().unwrap();
    let added = t.add_request(5, &prompt, &PromptKey::default()).unwrap();
    assert_eq!(added.num_cached_tokens, 48);
    run_copies(t.pool(), &added.copies);
    assert!(reads_back(&t, 5, 48));
}

#[test]
fn a_growable_pool_that_cannot_grow_puts_the_host_pages_back() {
    use kvpool_core::pool::GrowableSize;
    // A growable pool does not refuse up front (it grows when evicting is not enough), so
    // its add takes the host pages before it finds it cannot grow: it must put them back.
    let spec = hybrid_common::cached_spec(WINDOW_SIZE, 24, true);
    let size = GrowableSize { max_num_blocks: 100, initial_num_blocks: 100, chunk_bytes: None };
    let pool = Pool::new_growable(&spec, size, Device::Host).unwrap();
    let pool = pool.with_prefix_caching().unwrap().with_prefix_host_tier(128).unwrap();
    let mut t = HybridTables::new(Arc::new(pool), spec).unwrap();
    cache_then_evict(&mut t);
    let key = PromptKey::default();
    t.add_request(4, &(20_000..20_080).collect::<Vec<u32>>(), &key).unwrap();
    let host_before: Vec<usize> = t.cache_stats().iter().map(|s| s.host_pages).collect();
    let swapped_before = t.pool().prefix_cache_stats().unwrap().swapped_in_blocks;
    let prompt: Vec<u32> = (0..48).chain(600..630).collect();
    assert!(t.add_request(3, &prompt, &key).is_err());
    let host_after: Vec<usize> = t.cache_stats().iter().map(|s| s.host_pages).collect();
    assert_eq!(host_before, host_after, "the host pages of the refused hit are back");
    assert_eq!(t.pool().prefix_cache_stats().unwrap().swapped_in_blocks, swapped_before);
    t.check_invariants().unwrap();
    t.free(4).unwrap();
    let added = t.add_request(3, &prompt, &key).unwrap();
    assert_eq!(added.num_cached_tokens, 48);
    run_copies(t.pool(), &added.copies);
    assert!(reads_back(&t, 3, 48));
    t.check_invariants().unwrap();
}
