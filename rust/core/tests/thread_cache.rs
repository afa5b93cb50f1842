//! Free ids held in per-thread caches: they count as free, a batch is all-or-nothing across
//! caches and depot, a double free of a cached id is caught, a shrink reclaims cached ids,
//! and the ids a thread cached before it exited are neither lost nor stranded.

use std::sync::Barrier;

use kvpool_core::{BlockAllocator, CoreError, DType, Device, GrowableSize, KvLayout, Pool};

/// Spawns `threads` threads that each allocate `per_thread` blocks and free them (so the ids
/// end in their caches), all holding at once, then exit.
fn churn_in_threads(a: &BlockAllocator, threads: usize, per_thread: usize) {
    let all_hold = Barrier::new(threads);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let ids = a.alloc_many(per_thread).unwrap();
                all_hold.wait();
                a.free_many(&ids).unwrap();
                // A second round trip served from the cache alone.
                let again = a.alloc_many(per_thread).unwrap();
                a.free_many(&again).unwrap();
            });
        }
    });
}

#[test]
fn cached_ids_count_as_free() {
    let a = BlockAllocator::new(64).unwrap();
    let ids = a.alloc_many(10).unwrap();
    // Freed by this thread: they land in its cache, not on the depot.
    a.free_many(&ids[..4]).unwrap();
    a.check_invariants().unwrap();
    assert_eq!((a.num_free(), a.num_used()), (58, 6));
    a.free_many(&ids[4..]).unwrap();
    a.check_invariants().unwrap();
    assert_eq!((a.num_free(), a.num_used()), (64, 0));
}

#[test]
fn ids_cached_by_exited_threads_stay_free_and_reachable() {
    const THREADS: usize = 4;
    const PER_THREAD: usize = 12;
    let a = BlockAllocator::new(THREADS * PER_THREAD).unwrap();
    churn_in_threads(&a, THREADS, PER_THREAD);
    // Every id is back in some exited thread's cache: all free, and every one can be
    // allocated again by another thread in one call (which must reach all those caches).
    a.check_invariants().unwrap();
    assert_eq!((a.num_free(), a.num_used()), (THREADS * PER_THREAD, 0));
    let mut all = a.alloc_many(THREADS * PER_THREAD).unwrap();
    all.sort_unstable();
    assert_eq!(all, (0..(THREADS * PER_THREAD) as u32).collect::<Vec<_>>());
    a.check_invariants().unwrap();
    a.free_many(&all).unwrap();
    assert_eq!(a.num_free(), THREADS * PER_THREAD);
}

#[test]
fn a_batch_spanning_cache_and_depot_is_all_or_nothing() {
    let a = BlockAllocator::new(40).unwrap();
    let held = a.alloc_many(30).unwrap();
    a.free_many(&held[..5]).unwrap(); // 5 in this thread's cache, 10 elsewhere
    churn_in_threads(&a, 2, 3); // and some in other threads' caches
    a.check_invariants().unwrap();
    let before: Vec<u32> = (0..40).map(|id| a.ref_cnt(id).unwrap()).collect();
    assert_eq!(
        a.alloc_many(16),
        Err(CoreError::OutOfBlocks { requested: 16, free: 15, num_blocks: 40 })
    );
    a.check_invariants().unwrap();
    assert_eq!(
        (0..40).map(|id| a.ref_cnt(id).unwrap()).collect::<Vec<_>>(),
        before,
        "a failed call changed a count"
    );
    assert_eq!(a.num_free(), 15);
    let rest = a.alloc_many(15).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.num_free(), 0);
    let mut all: Vec<u32> = rest.iter().chain(&held[5..]).copied().collect();
    all.sort_unstable();
    assert_eq!(all, (0..40).collect::<Vec<u32>>(), "some id was handed out twice or lost");
}

#[test]
fn double_free_of_a_cached_id_is_rejected_and_changes_nothing() {
    let a = BlockAllocator::new(8).unwrap();
    let ids = a.alloc_many(3).unwrap();
    a.free(ids[1]).unwrap(); // now in this thread's cache
    let free_before = a.num_free();
    assert_eq!(a.free(ids[1]), Err(CoreError::DoubleFree { block_id: ids[1] }));
    assert_eq!(a.free_many(&[ids[0], ids[1]]), Err(CoreError::DoubleFree { block_id: ids[1] }));
    a.check_invariants().unwrap();
    assert_eq!((a.num_free(), a.ref_cnt(ids[0]).unwrap()), (free_before, 1));
    // The cached id comes back exactly once.
    assert_eq!(a.alloc().unwrap(), ids[1]);
    a.check_invariants().unwrap();
}

/// 1536-byte blocks in 4 KiB host chunks (as in `growable.rs`).
fn growable_pool(max_num_blocks: usize, initial_num_blocks: usize) -> Pool {
    let layout = KvLayout::new(1, 1, 384, 1, DType::Float16).unwrap();
    let size = GrowableSize { max_num_blocks, initial_num_blocks, chunk_bytes: Some(4096) };
    Pool::new_growable(layout, size, Device::Host).unwrap()
}

#[test]
fn shrink_reclaims_ids_cached_by_this_and_exited_threads() {
    let p = growable_pool(64, 0);
    let mine = p.alloc_many(16).unwrap();
    let theirs = std::thread::scope(|s| s.spawn(|| p.alloc_many(16).unwrap()).join().unwrap());
    // Both halves freed into caches: this thread's, and an exited thread's.
    p.free_many(&mine).unwrap();
    std::thread::scope(|s| s.spawn(|| p.free_many(&theirs).unwrap()).join().unwrap());
    p.check_invariants().unwrap();
    assert_eq!(p.num_free(), p.num_blocks());
    assert!(p.shrink().unwrap() > 0);
    p.check_invariants().unwrap();
    assert_eq!((p.num_blocks(), p.mapped_bytes()), (0, 0), "a cached id kept its chunk mapped");
}

#[test]
fn cached_ids_count_as_free_for_the_high_water_mark() {
    let a = BlockAllocator::new(64).unwrap();
    for _ in 0..3 {
        // The second and third rounds are served from this thread's cache.
        let ids = a.alloc_many(10).unwrap();
        a.free_many(&ids).unwrap();
    }
    assert_eq!(a.high_water(), 10);
    // Ids cached by an exited thread are free too: allocating around them does not count them.
    churn_in_threads(&a, 1, 20);
    let ids = a.alloc_many(5).unwrap();
    assert_eq!((a.high_water(), a.num_used()), (20, 5));
    a.free_many(&ids).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn a_growth_keeps_cached_ids_free_and_hands_out_the_lowest_first() {
    let p = growable_pool(64, 0);
    let ids = p.alloc_many(8).unwrap();
    p.free_many(&ids[2..]).unwrap(); // 6 ids in this thread's cache
    std::thread::scope(|s| {
        s.spawn(|| {
            let more = p.alloc_many(4).unwrap();
            p.free_many(&more).unwrap(); // and some in an exited thread's cache
        });
    });
    let free_before = p.num_free();
    p.grow(p.num_blocks() + 20).unwrap();
    p.check_invariants().unwrap();
    assert_eq!((p.num_used(), p.num_free()), (2, p.num_blocks() - 2));
    assert!(
        p.num_free() >= free_before + 20,
        "{} free after growing from {free_before}",
        p.num_free()
    );
    assert_eq!(p.alloc_many(3).unwrap(), [2, 3, 4], "the growth sorted the cached ids back in");
    assert_eq!(p.high_water(), 8, "the first allocation held 8");
}
