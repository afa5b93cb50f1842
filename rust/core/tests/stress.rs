//! Many threads hammering one allocator, each on the ids it holds. Checks that no id is ever
//! held by two threads at once and that every block comes back: the outcome does not depend
//! on timing, only the interleaving does.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;

use kvpool_core::{BlockAllocator, CoreError};

mod common;
use common::XorShift;

const NUM_THREADS: usize = 8;
const NUM_BLOCKS: usize = 64;
const ITERATIONS: usize = 20_000;
/// Each thread keeps at most this many ids, so together they can exhaust the pool.
const MAX_HELD: usize = 12;

/// Marks `ids` as owned by the calling thread; a flag already set is a double hand-out.
fn claim(owned: &[AtomicBool], ids: &[u32]) {
    for &id in ids {
        assert!(
            !owned[id as usize].swap(true, Ordering::AcqRel),
            "block {id} handed to two threads at once"
        );
    }
}

/// Clears the flags before the ids go back, so a fast re-allocation elsewhere is legal.
fn release(owned: &[AtomicBool], ids: &[u32]) {
    for &id in ids {
        assert!(
            owned[id as usize].swap(false, Ordering::AcqRel),
            "block {id} freed while not owned"
        );
    }
}

fn check_out_of_blocks(e: CoreError, requested: usize) {
    match e {
        CoreError::OutOfBlocks { requested: r, free, num_blocks } => {
            assert_eq!((r, num_blocks), (requested, NUM_BLOCKS));
            assert!(free < requested, "refused {requested} with {free} free");
        }
        other => panic!("unexpected error {other:?}"),
    }
}

/// One thread's loop. Returns how many blocks it allocated, for the summary check.
fn worker(a: &BlockAllocator, owned: &[AtomicBool], seed: u64) -> usize {
    let mut rng = XorShift(seed);
    let mut held: Vec<u32> = Vec::new();
    let mut allocated = 0;
    for _ in 0..ITERATIONS {
        let room = MAX_HELD - held.len();
        match rng.below(4) {
            0 if room > 0 => match a.alloc() {
                Ok(id) => {
                    claim(owned, &[id]);
                    held.push(id);
                    allocated += 1;
                }
                Err(e) => check_out_of_blocks(e, 1),
            },
            1 if room > 0 => {
                let n = 1 + rng.below(room.min(6));
                match a.alloc_many(n) {
                    Ok(ids) => {
                        assert_eq!(ids.len(), n);
                        claim(owned, &ids);
                        held.extend_from_slice(&ids);
                        allocated += n;
                    }
                    Err(e) => check_out_of_blocks(e, n),
                }
            }
            2 if !held.is_empty() => {
                let id = held.swap_remove(rng.below(held.len()));
                release(owned, &[id]);
                a.free(id).unwrap();
            }
            _ if !held.is_empty() => {
                let n = 1 + rng.below(held.len());
                let ids: Vec<u32> = held.drain(held.len() - n..).collect();
                release(owned, &ids);
                a.free_many(&ids).unwrap();
            }
            _ => {}
        }
    }
    release(owned, &held);
    a.free_many(&held).unwrap();
    allocated
}

#[test]
fn threads_never_share_an_id_and_every_block_comes_back() {
    let a = BlockAllocator::new(NUM_BLOCKS).unwrap();
    let owned: Vec<AtomicBool> = (0..NUM_BLOCKS).map(|_| AtomicBool::new(false)).collect();
    let start = Barrier::new(NUM_THREADS);
    let allocated: usize = std::thread::scope(|s| {
        let handles: Vec<_> = (0..NUM_THREADS)
            .map(|t| {
                let (a, owned, start) = (&a, &owned, &start);
                s.spawn(move || {
                    start.wait();
                    worker(a, owned, 0x9e37_79b9_7f4a_7c15 ^ (t as u64 + 1))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert!(
        allocated >= NUM_THREADS * ITERATIONS / 8,
        "the threads barely allocated ({allocated})"
    );
    a.check_invariants().unwrap();
    assert_eq!((a.num_free(), a.num_used()), (NUM_BLOCKS, 0));
    assert!(owned.iter().all(|f| !f.load(Ordering::Acquire)));
    assert!(a.high_water() <= NUM_BLOCKS);
    // Every id is still usable exactly once.
    let mut all = a.alloc_many(NUM_BLOCKS).unwrap();
    all.sort_unstable();
    assert_eq!(all, (0..NUM_BLOCKS as u32).collect::<Vec<_>>());
    a.check_invariants().unwrap();
    a.free_many(&all).unwrap();
    a.check_invariants().unwrap();
}

/// Together the threads never hold more blocks than the pool has, so no allocation may be
/// refused, however the calls interleave: a refusal means fewer than `n` blocks were free at
/// one instant, never that some were on their way between a cache and the depot. (Frees fill
/// each thread's cache, so most allocations that miss their own cache steal from others.)
#[test]
fn no_refusal_while_the_demand_fits_the_pool() {
    const MOST_PER_THREAD: usize = NUM_BLOCKS / NUM_THREADS;
    let a = BlockAllocator::new(NUM_BLOCKS).unwrap();
    std::thread::scope(|s| {
        for t in 0..NUM_THREADS {
            let a = &a;
            s.spawn(move || {
                let mut rng = XorShift(t as u64 + 101);
                for _ in 0..ITERATIONS {
                    let n = 1 + rng.below(MOST_PER_THREAD);
                    let ids = a.alloc_many(n).unwrap_or_else(|e| {
                        panic!("alloc_many({n}) with at least {n} free: {e:?}")
                    });
                    a.free_many(&ids).unwrap();
                }
            });
        }
    });
    a.check_invariants().unwrap();
    assert_eq!(a.num_free(), NUM_BLOCKS);
}

/// Forks race with frees of other references to the same blocks: each thread shares a block
/// it holds and drops both references, so the counts must come back to zero exactly.
#[test]
fn concurrent_share_and_free_balance_out() {
    let a = BlockAllocator::new(NUM_BLOCKS).unwrap();
    std::thread::scope(|s| {
        for t in 0..NUM_THREADS {
            let a = &a;
            s.spawn(move || {
                let mut rng = XorShift(t as u64 + 17);
                for _ in 0..ITERATIONS / 4 {
                    let n = 1 + rng.below(4);
                    let Ok(ids) = a.alloc_many(n) else { continue };
                    a.share_many(&ids).unwrap();
                    a.free_many(&ids).unwrap();
                    assert!(ids.iter().all(|&id| a.ref_cnt(id).unwrap() == 1));
                    a.free_many(&ids).unwrap();
                }
            });
        }
    });
    a.check_invariants().unwrap();
    assert_eq!(a.num_free(), NUM_BLOCKS);
}
