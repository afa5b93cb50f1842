//! The eviction stage under concurrency: threads add and free requests through shared block
//! tables on a host pool too small for them (so every allocation evicts), while a reader
//! takes staged blocks, checks their bytes against what the writers put in those blocks, and
//! releases them. Nothing deadlocks, every staged block holds its own bytes whole, and the
//! pool, the tables and the stage stay conserved.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvpool_core::pool::PoolSize;
use kvpool_core::prefix_cache::BlockHash;
use kvpool_core::tables::{BlockTables, PromptKey};
use kvpool_core::{DType, Device, KvLayout, Pool};

const BS: usize = 4;
const PROMPTS: u32 = 6;
const FULL_BLOCKS: usize = 3; // each prompt: 3 full blocks and 1 token

fn prompt(p: u32) -> Vec<u32> {
    (0..(FULL_BLOCKS * BS + 1) as u32).map(|t| 1000 * (p + 1) + t).collect()
}

/// The byte every byte of block `k` of prompt `p` holds once computed.
fn fill_byte(p: u32, k: usize) -> u8 {
    1 + (p as usize * FULL_BLOCKS + k) as u8
}

#[test]
fn staged_blocks_hold_their_own_bytes_while_threads_evict_and_a_reader_drains() {
    let layout = KvLayout::new(1, 1, 64, BS, DType::Float16).unwrap();
    let bb = layout.block_bytes();
    let pool = Pool::new(layout, PoolSize::NumBlocks(12), Device::Host)
        .unwrap()
        .with_prefix_caching()
        .unwrap();
    let pool = Arc::new(pool);
    let tables = BlockTables::new(pool.clone(), 8, 8).unwrap();
    pool.attach_eviction_stage(4).unwrap();
    let hasher = pool.prefix_cache().unwrap().hasher();
    let root = hasher.root(None, None, b"");
    let mut expected: HashMap<BlockHash, u8> = HashMap::new();
    for p in 0..PROMPTS {
        let hashes = hasher.chain(&root, &prompt(p)[..FULL_BLOCKS * BS], BS);
        for (k, h) in hashes.into_iter().enumerate() {
            expected.insert(h, fill_byte(p, k));
        }
    }
    let done = AtomicBool::new(false);
    let (checked, writers) = std::thread::scope(|s| {
        let writers: Vec<_> = (0..2u64)
            .map(|w| {
                let (pool, tables) = (pool.clone(), tables.clone());
                s.spawn(move || {
                    let key = PromptKey::default();
                    let mut added = 0;
                    for i in 0..200u64 {
                        let p = ((i * 7 + w * 3) % PROMPTS as u64) as u32;
                        let id = w * 1_000_000 + i;
                        let Ok(r) = tables.add_request(id, &prompt(p), &key) else {
                            continue; // out of blocks while the other writer holds them
                        };
                        let blocks = tables.blocks(id).unwrap();
                        let first_fresh = r.num_cached_tokens / BS;
                        for (k, &b) in blocks.iter().enumerate().take(FULL_BLOCKS).skip(first_fresh)
                        {
                            let at = pool.block_ptr(b as u32).unwrap() as usize;
                            // SAFETY: block `b` is this request's fresh block (referenced by it
                            // alone until it is freed below), of `bb` bytes in the host slab.
                            unsafe { std::ptr::write_bytes(at as *mut u8, fill_byte(p, k), bb) };
                        }
                        tables.free(id).unwrap();
                        added += 1;
                    }
                    added
                })
            })
            .collect();
        let reader = s.spawn(|| {
            let stage = pool.eviction_stage().unwrap();
            let mut checked = 0usize;
            let mut last_round = false;
            loop {
                let (take_id, taken) = stage.take(3);
                for &(slot, hash) in &taken {
                    let at = stage.base_ptr() as usize + slot as usize * stage.block_bytes();
                    // SAFETY: a taken slot lies in the stage and no capture writes it until
                    // it is released below.
                    let bytes = unsafe { std::slice::from_raw_parts(at as *const u8, bb) };
                    let want = expected[&hash];
                    assert!(bytes.iter().all(|&x| x == want), "slot {slot}: not its block's bytes");
                    checked += 1;
                }
                let slots: Vec<u32> = taken.iter().map(|&(slot, _)| slot).collect();
                stage.release(take_id, &slots).unwrap();
                if last_round && taken.is_empty() {
                    return checked;
                }
                last_round = done.load(Ordering::Acquire);
                std::thread::yield_now();
            }
        });
        let writers: Vec<usize> = writers.into_iter().map(|h| h.join().unwrap()).collect();
        done.store(true, Ordering::Release);
        (reader.join().unwrap(), writers)
    });
    let stats = pool.eviction_stage().unwrap().stats();
    assert!(writers.iter().sum::<usize>() > 100, "the writers ran: {writers:?}");
    assert!(checked > 0 && stats.captured > 0, "blocks were staged and checked");
    assert_eq!(stats.taken as usize, checked);
    assert_eq!((stats.num_filled, stats.num_taken), (0, 0));
    assert!(stats.captured >= stats.taken, "{stats:?}");
    pool.eviction_stage().unwrap().check_invariants().unwrap();
    tables.check_invariants().unwrap();
    pool.check_invariants_with(true).unwrap();
    assert_eq!(pool.num_free() + pool.num_evictable() + pool.num_used(), pool.num_blocks());
}
