//! `HybridTables` on a host pool: per-group growth, window and chunk groups releasing what
//! no query sees (checked down to the bytes), state slots, copy-on-write fork, failed
//! calls changing nothing, and a uniform model taking exactly the blocks `BlockTables` does.

use std::sync::Arc;

use kvpool_core::hybrid::{HybridTables, ModelKvSpec, PageCopy};
use kvpool_core::layout::KvPart;
use kvpool_core::pool::PoolSize;
use kvpool_core::tables::{BlockTables, PromptKey};
use kvpool_core::{CoreError, DType, Device, KvLayout, Pool};

#[path = "common/hybrid.rs"]
#[allow(dead_code)] // The helpers of the caching tests.
mod hybrid_common;
use hybrid_common::PAGE_BYTES;

const FULL: usize = 0;
const WINDOW: usize = 1;
const STATE: usize = 2;
const MLA: usize = 3;
const CHUNKED: usize = 4;
const WINDOW_SIZE: usize = 6;
const CHUNK: usize = 10;

/// Six layers over 1 KiB pages: full (4 tokens a page), a window of 6 over two layers (4 a
/// page), a 1500-byte state (2 pages a slot), an MLA latent (2 a page), chunks of 10 (4 a page).
fn mixed_spec() -> ModelKvSpec {
    hybrid_common::mixed_spec(WINDOW_SIZE, CHUNK)
}

/// A host pool of `num_pages` pages of `PAGE_BYTES`, made from the spec.
fn setup(num_pages: usize) -> HybridTables {
    let spec = mixed_spec();
    let pool = Arc::new(Pool::new(&spec, PoolSize::NumBlocks(num_pages), Device::Host).unwrap());
    HybridTables::new(pool, spec).unwrap()
}

/// Everything a call could change: every table of the given requests, and the pool.
fn snapshot(t: &HybridTables, ids: &[u64]) -> Vec<String> {
    let mut out = vec![format!("free {}", t.pool().num_free())];
    for page in 0..t.pool().num_blocks() as u32 {
        out.push(format!("ref {page} {}", t.pool().ref_cnt(page).unwrap()));
    }
    for &id in ids {
        for g in 0..t.spec().num_groups() {
            out.push(format!("{id}/{g}: {:?}", t.table(id, g).ok()));
        }
    }
    out
}

fn pages(t: &HybridTables, id: u64, group: usize) -> (usize, Vec<u32>) {
    let table = t.table(id, group).unwrap();
    (table.first_page, table.page_ids.to_vec())
}

#[test]
fn add_takes_every_groups_pages_and_a_state_slot() {
    let mut t = setup(64);
    t.add(1, 9).unwrap();
    t.check_invariants().unwrap();
    let lens: Vec<usize> = (0..5).map(|g| t.table(1, g).unwrap().page_ids.len()).collect();
    // 9 tokens: 3 pages of 4 (full, window and chunk: all their queries are still to run),
    // 5 pages of 2 (MLA), 2 pages for the state.
    assert_eq!(lens, vec![3, 3, 2, 5, 3]);
    assert_eq!(t.pool().num_used(), 16);
    assert_eq!(t.spec().pages_to_add(9), 16);
    assert_eq!(t.table(1, STATE).unwrap().block_size, None);
    // An empty request still holds its state.
    t.add(2, 0).unwrap();
    assert_eq!(t.table(2, STATE).unwrap().page_ids.len(), 2);
    assert_eq!(t.table(2, FULL).unwrap().page_ids.len(), 0);
    t.check_invariants().unwrap();
    t.free(1).unwrap();
    t.free(2).unwrap();
    assert_eq!(t.pool().num_free(), 64);
    t.check_invariants().unwrap();
}

#[test]
fn a_window_group_keeps_only_the_pages_the_next_query_sees() {
    let mut t = setup(64);
    t.add(1, 3).unwrap();
    for _ in 0..40 {
        let before = t.num_tokens(1).unwrap();
        t.append(1, 1).unwrap();
        t.check_invariants().unwrap();
        // The query at `before` sees `before - 5 ..= before`.
        let first_live = (before + 1).saturating_sub(WINDOW_SIZE);
        let (first_page, ids) = pages(&t, 1, WINDOW);
        assert_eq!(first_page, first_live / 4, "after {before} tokens");
        assert_eq!(first_page + ids.len(), (before + 1).div_ceil(4));
        assert!(ids.len() <= WINDOW_SIZE.div_ceil(4) + 1);
        // The full group keeps everything.
        let (full_first, full_ids) = pages(&t, 1, FULL);
        assert_eq!((full_first, full_ids.len()), (0, (before + 1).div_ceil(4)));
    }
    let held: usize = (0..5).map(|g| t.table(1, g).unwrap().page_ids.len()).sum();
    assert_eq!(t.pool().num_used(), held);
}

#[test]
fn a_chunked_group_drops_the_previous_chunk_when_a_query_enters_a_new_one() {
    let mut t = setup(64);
    t.add(1, 9).unwrap();
    t.append(1, 1).unwrap(); // the query at 9 is in chunk 0: tokens 0..10 stay
    assert_eq!(pages(&t, 1, CHUNKED).0, 0);
    assert_eq!(pages(&t, 1, CHUNKED).1.len(), 3);
    t.append(1, 3).unwrap(); // the query at 10 starts chunk 1: tokens 10..13 live
    let (first_page, ids) = pages(&t, 1, CHUNKED);
    assert_eq!((first_page, ids.len()), (2, 2)); // page 2 holds tokens 8..12
    t.check_invariants().unwrap();
    // A long prefill appended in one call keeps every page its queries see.
    t.append(1, 30).unwrap(); // queries 13..43 run: from chunk 1 on
    assert_eq!(pages(&t, 1, CHUNKED).0, 10 / 4);
    t.check_invariants().unwrap();
}

#[test]
fn fork_shares_every_group_and_append_copies_what_it_writes() {
    let mut t = setup(64);
    t.add(1, 6).unwrap();
    t.fork(1, 2).unwrap();
    t.check_invariants().unwrap();
    for g in 0..5 {
        assert_eq!(pages(&t, 1, g), pages(&t, 2, g));
        for &id in &pages(&t, 1, g).1 {
            assert_eq!(t.pool().ref_cnt(id).unwrap(), 2);
        }
    }
    let used = t.pool().num_used();
    let parent_state = pages(&t, 1, STATE).1;
    let parent_full = pages(&t, 1, FULL).1;
    let copies = t.append(2, 1).unwrap();
    t.check_invariants().unwrap();
    // Token 6 goes into the partly filled page 1 of the full, window and chunk groups, and
    // page 3 (a fresh one) of the MLA group; the state is rewritten: both its pages copied.
    let copied: Vec<(usize, u32)> = copies.iter().map(|c| (c.group, c.src)).collect();
    assert_eq!(
        copied,
        vec![
            (FULL, parent_full[1]),
            (WINDOW, pages(&t, 1, WINDOW).1[1]),
            (STATE, parent_state[0]),
            (STATE, parent_state[1]),
            (CHUNKED, pages(&t, 1, CHUNKED).1[1]),
        ]
    );
    for PageCopy { group, src, dst } in copies {
        assert_eq!(t.pool().ref_cnt(src).unwrap(), 1, "group {group}");
        assert!(pages(&t, 2, group).1.contains(&dst));
        assert!(!pages(&t, 2, group).1.contains(&src));
    }
    assert_eq!(t.pool().num_used(), used + 6); // five copies and one new MLA page
    assert_eq!(pages(&t, 2, MLA).1[..3], pages(&t, 1, MLA).1[..]);
    assert_eq!(pages(&t, 2, MLA).1.len(), 4);
    // The parent is alone on its pages now: appending to it copies nothing.
    assert_eq!(t.append(1, 1).unwrap(), vec![]);
    t.free(1).unwrap();
    t.free(2).unwrap();
    t.check_invariants().unwrap();
    assert_eq!(t.pool().num_free(), 64);
}

#[test]
fn failed_calls_change_nothing_in_any_group() {
    let mut t = setup(20);
    t.add(1, 8).unwrap();
    t.fork(1, 2).unwrap();
    let before = snapshot(&t, &[1, 2, 3]);
    // 12 pages are used, 8 free; 32 more tokens need 8 new pages in the full group alone.
    assert!(matches!(t.append(1, 32), Err(CoreError::OutOfBlocks { .. })));
    assert!(matches!(t.add(3, 40), Err(CoreError::OutOfBlocks { .. })));
    assert!(matches!(t.add(1, 1), Err(CoreError::DuplicateRequest { request_id: 1 })));
    assert!(matches!(t.append(3, 1), Err(CoreError::UnknownRequest { request_id: 3 })));
    assert!(matches!(t.fork(3, 4), Err(CoreError::UnknownRequest { request_id: 3 })));
    assert!(matches!(t.fork(1, 2), Err(CoreError::DuplicateRequest { request_id: 2 })));
    assert!(matches!(t.free(3), Err(CoreError::UnknownRequest { request_id: 3 })));
    assert!(matches!(t.append(1, usize::MAX), Err(CoreError::InvalidArgument(_))));
    assert!(matches!(t.append(1, usize::MAX - 8), Err(CoreError::OutOfBlocks { .. })));
    assert!(matches!(t.add(3, usize::MAX), Err(CoreError::OutOfBlocks { .. })));
    assert!(matches!(t.table(1, 5), Err(CoreError::InvalidArgument(m)) if m.contains("5 groups")));
    assert_eq!(snapshot(&t, &[1, 2, 3]), before);
    t.check_invariants().unwrap();
}

#[test]
fn new_refuses_a_pool_that_does_not_fit_the_model() {
    let pool = |block_size, num_blocks| {
        let layout = KvLayout::new(1, 1, 128, block_size, DType::Float16).unwrap();
        Arc::new(Pool::new(layout, PoolSize::NumBlocks(num_blocks), Device::Host).unwrap())
    };
    let err = HybridTables::new(pool(1, 64), mixed_spec()).err().unwrap();
    assert!(matches!(err, CoreError::InvalidLayout(m) if m.contains("1024") && m.contains("512")));
    // One token needs 1 page in each token group and 2 for the state: 6 pages.
    let err = HybridTables::new(pool(2, 5), mixed_spec()).err().unwrap();
    assert!(matches!(err, CoreError::InvalidLayout(m) if m.contains("needs 6 pages")));
    assert!(HybridTables::new(pool(2, 6), mixed_spec()).is_ok());
    // A prefix-caching pool is taken, and one whose cache spills to a host tier.
    let caching = |host_tier: bool| {
        let layout = KvLayout::new(1, 1, 128, 2, DType::Float16).unwrap();
        let pool = Pool::new(layout, PoolSize::NumBlocks(8), Device::Host).unwrap();
        let pool = pool.with_prefix_caching().unwrap();
        Arc::new(if host_tier { pool.with_prefix_host_tier(4).unwrap() } else { pool })
    };
    assert!(HybridTables::new(caching(false), mixed_spec()).unwrap().caches_prefixes());
    assert!(HybridTables::new(caching(true), mixed_spec()).unwrap().caches_prefixes());
}

/// Writes `value` at `offset` of page `page` of a host pool.
fn poke(pool: &Pool, page: u32, offset: usize, value: u8) {
    assert!(offset < pool.block_bytes());
    let address = pool.block_ptr(page).unwrap() as usize + offset;
    // SAFETY: a host pool's slab is `num_blocks * block_bytes` bytes of memory the pool owns
    // and keeps mapped while it lives; `page` is in range (block_ptr checked it) and
    // `offset < block_bytes`, and no other thread touches the pool in this test.
    unsafe { (address as *mut u8).write(value) }
}

fn peek(pool: &Pool, page: u32, offset: usize) -> u8 {
    assert!(offset < pool.block_bytes());
    let address = pool.block_ptr(page).unwrap() as usize + offset;
    // SAFETY: as in `poke`: in range of the pool's mapped slab, no concurrent access.
    unsafe { (address as *const u8).read() }
}

/// Token `p`'s K byte 0 of the window group's second layer: `p`'s mark.
fn window_mark_offset(spec: &ModelKvSpec, slot_in_page: usize) -> usize {
    spec.attention_offset_bytes(WINDOW, 0, 1, KvPart::K, slot_in_page, 0, 0).unwrap()
}

#[test]
fn the_pages_a_window_group_frees_are_exactly_those_that_left_the_window() {
    let mut t = setup(64);
    let spec = t.spec().clone();
    let mark = |p: usize| (p % 251) as u8 + 1;
    let write_marks = |t: &HybridTables, from: usize, to: usize| {
        let table = t.table(1, WINDOW).unwrap();
        for p in from..to {
            let slot = table.slot(p).unwrap() as usize;
            poke(t.pool(), (slot / 4) as u32, window_mark_offset(&spec, slot % 4), mark(p));
        }
    };
    t.add(1, 5).unwrap();
    write_marks(&t, 0, 5);
    for step in 0..30 {
        let n = t.num_tokens(1).unwrap();
        let (old_first, old_ids) = pages(&t, 1, WINDOW);
        let count = 1 + step % 3;
        t.append(1, count).unwrap();
        write_marks(&t, n, n + count);
        let (first, ids) = pages(&t, 1, WINDOW);
        // Freed: the old pages now outside the table; every one holds only tokens below
        // the first token the query at `n` sees, and every page kept holds one it sees.
        let first_seen = (n + 1).saturating_sub(WINDOW_SIZE);
        let freed: Vec<(usize, u32)> = (old_first..)
            .zip(old_ids.iter().copied())
            .filter(|(_, id)| !ids.contains(id))
            .collect();
        for &(page, id) in &freed {
            assert!((page + 1) * 4 <= first_seen, "page {page} holds a token the window sees");
            assert_eq!(t.pool().ref_cnt(id).unwrap(), 0, "page {page} was not returned");
        }
        assert_eq!(freed.len(), first - old_first);
        assert!(first * 4 + 4 > first_seen, "page {first} holds no token the window sees");
        // Every token the window still sees reads back its mark through the new table.
        let table = t.table(1, WINDOW).unwrap();
        for p in first_seen..n + count {
            let slot = table.slot(p).unwrap() as usize;
            assert_eq!(
                peek(t.pool(), (slot / 4) as u32, window_mark_offset(&spec, slot % 4)),
                mark(p)
            );
        }
        if first > 0 {
            assert_eq!(table.slot(first * 4 - 1), None, "a token before the table's first page");
        }
        t.check_invariants().unwrap();
    }
}

#[test]
fn a_uniform_model_takes_exactly_the_blocks_block_tables_take() {
    let layout = KvLayout::new(2, 2, 64, 4, DType::Float16).unwrap();
    let new_pool = || Arc::new(Pool::new(layout, PoolSize::NumBlocks(40), Device::Host).unwrap());
    let (hybrid_pool, plain_pool) = (new_pool(), new_pool());
    let mut hybrid = HybridTables::new(hybrid_pool.clone(), ModelKvSpec::uniform(&layout)).unwrap();
    let plain = BlockTables::new(plain_pool.clone(), 8, 64).unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |bound: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % bound
    };
    let mut succeeded = 0;
    for _ in 0..300 {
        let (id, other, count) = (next(5), next(5), next(9) as usize);
        let (hybrid_ok, plain_ok) = match next(4) {
            0 => (hybrid.add(id, count).is_ok(), plain.add(id, count).is_ok()),
            1 => {
                let h = hybrid.append(id, count).map(|c| c.len());
                let p = plain.append_tokens(id, count).map(|r| r.copies.len());
                assert_eq!(h.as_ref().ok(), p.as_ref().ok(), "the same copies");
                (h.is_ok(), p.is_ok())
            }
            2 => (hybrid.fork(id, other).is_ok(), plain.fork(id, other).is_ok()),
            _ => (hybrid.free(id).is_ok(), plain.free(id).is_ok()),
        };
        assert_eq!(hybrid_ok, plain_ok);
        succeeded += hybrid_ok as usize;
        assert_eq!(hybrid_pool.num_used(), plain_pool.num_used());
        for k in plain.request_ids() {
            let blocks = plain.blocks(k).unwrap();
            assert_eq!(hybrid.table(k, 0).unwrap().page_ids.len(), blocks.len());
        }
        hybrid.check_invariants().unwrap();
    }
    assert!(succeeded > 100, "only {succeeded} calls succeeded");
}

/// A caching pool of `num_pages` pages under `spec`.
fn caching(spec: ModelKvSpec, num_pages: usize) -> HybridTables {
    let carrier = KvLayout::new(1, 1, PAGE_BYTES / 4, 1, DType::Float16).unwrap();
    let pool = Pool::new(carrier, PoolSize::NumBlocks(num_pages), Device::Host).unwrap();
    HybridTables::new(Arc::new(pool.with_prefix_caching().unwrap()), spec).unwrap()
}

#[test]
fn window_pages_that_left_the_window_serve_a_shorter_hit() {
    // Full (21 tokens a page), window 20 (5 a page), MLA (2), chunks of 24 (4): no state.
    let mut t = caching(hybrid_common::cached_spec(20, 24, false), 512);
    let key = PromptKey::default();
    let prompt: Vec<u32> = (0..70).collect();
    t.add_request(1, &prompt, &key).unwrap();
    // The first append caches the prompt's pages, then the window lets its head go.
    t.append_tokens(1, &[70]).unwrap();
    assert_eq!(t.table(1, 1).unwrap().first_page, 10);
    assert!(t.pool().num_evictable() >= 10, "the window's old pages are evictable");
    let stats = t.cache_stats();
    assert!(stats[1].evictable_pages >= 10, "{stats:?}");
    // A prompt sharing the first 24 tokens hits 16 of them: the window group serves them
    // from the pages that left request 1's window.
    let mut other: Vec<u32> = (0..24).collect();
    other.extend(1000..1010);
    let added = t.add_request(2, &other, &key).unwrap();
    assert_eq!(added.num_cached_tokens, 16);
    // The full group's page 0 (tokens 0..21) holds the hit's end: copied, not shared.
    assert!(added
        .copies
        .iter()
        .any(|c| c.group == 0 && c.src == t.table(1, 0).unwrap().page_ids[0]));
    t.check_invariants().unwrap();
    // A page size that is not a multiple of the chunk loses nothing: a full group of 21
    // tokens a page hits at 64, inside its fourth page.
    let longer: Vec<u32> = (0..66).chain([7, 7]).collect();
    assert_eq!(t.add_request(3, &longer, &key).unwrap().num_cached_tokens, 64);
    for id in [1, 2, 3] {
        t.free(id).unwrap();
    }
    t.check_invariants().unwrap();
    assert_eq!(t.pool().num_used(), 0);
}

#[test]
fn kv_events_name_the_group_of_each_cached_chunk() {
    use kvpool_core::prefix_cache::KvEvent;
    // Full (21 a page), window 20 (5), state (2 pages), MLA (2), chunks of 24 (4); a pool
    // that must evict to take a second request.
    let mut t = caching(hybrid_common::cached_spec(20, 24, true), 60);
    let pool = t.pool().clone();
    let cache = pool.prefix_cache().unwrap();
    cache.set_events_enabled(true);
    let key = PromptKey::default();
    let prompt: Vec<u32> = (0..32).collect();
    t.add_request(1, &prompt, &key).unwrap();
    assert!(cache.drain_events().is_empty(), "nothing is cached before it has run");
    let copies = t.checkpoint(1).unwrap();
    assert_eq!(copies.len(), 2, "the state slot's two pages");
    let events = cache.drain_events();
    let mut stored: Vec<(u32, usize)> = Vec::new();
    for event in &events {
        if let KvEvent::BlockStored { group, block_hashes, block_size, .. } = event {
            assert_eq!(*block_size, 16);
            stored.push((*group, block_hashes.len()));
        }
    }
    // Both chunks for every token group (0, 1, 3, 4), one checkpoint for the state (2).
    assert_eq!(stored, [(0, 2), (1, 2), (3, 2), (4, 2), (2, 1)]);
    t.free(1).unwrap();
    // A prompt sharing nothing needs more pages than are free: the tables evict and say so.
    let other: Vec<u32> = (500..556).collect();
    t.add_request(2, &other, &key).unwrap();
    let removed: Vec<u32> = cache
        .drain_events()
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockRemoved { group, .. } => Some(*group),
            _ => None,
        })
        .collect();
    assert!(!removed.is_empty(), "evicting cached pages is reported");
    t.check_invariants().unwrap();
}

#[test]
fn append_many_is_every_append_at_once() {
    // The same calls on two tables, one append per request against one append_many.
    let (mut one, mut many) = (setup(200), setup(200));
    for t in [&mut one, &mut many] {
        for (id, n) in [(1, 3), (2, 9), (3, 1)] {
            t.add(id, n).unwrap();
        }
        t.fork(2, 4).unwrap();
    }
    let ids = [1, 2, 3, 4];
    for step in 0..12 {
        let counts = [1, step % 3, 5, 1];
        let mut expected = Vec::new();
        for (&id, &count) in ids.iter().zip(&counts) {
            expected.extend(one.append(id, count).unwrap());
        }
        let copies = many.append_many(&ids, &counts, None).unwrap();
        assert_eq!(copies.len(), expected.len(), "step {step}");
        assert_eq!(snapshot(&many, &ids).len(), snapshot(&one, &ids).len());
        for &id in &ids {
            for g in 0..5 {
                let (a, b) = (one.table(id, g).unwrap(), many.table(id, g).unwrap());
                assert_eq!((a.first_page, a.page_ids.len()), (b.first_page, b.page_ids.len()));
            }
        }
        assert_eq!(one.pool().num_free(), many.pool().num_free(), "step {step}");
        many.check_invariants().unwrap();
    }
    // A repeated id, a count short, or a request unknown: refused, nothing changes.
    let before = snapshot(&many, &ids);
    assert!(many.append_many(&[1, 1], &[1, 1], None).is_err());
    assert!(many.append_many(&[1, 2], &[1], None).is_err());
    assert!(many.append_many(&[1, 9], &[1, 1], None).is_err());
    assert!(many.append_many(&[1], &[1], Some(&[])).is_err());
    assert_eq!(snapshot(&many, &ids), before);
}
