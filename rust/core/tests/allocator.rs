//! Single-threaded unit tests of `BlockAllocator` and a host `Pool`: every call checks the
//! invariants afterwards, and every failing call is shown to change nothing.

use std::collections::HashMap;

use kvpool_core::{BlockAllocator, CoreError, DType, Device, KvLayout, Pool, PoolSize};

mod common;
use common::XorShift;

/// 1 layer x K|V x 1 token x 1 head x 128 dims x 2 bytes = 512 bytes per block.
fn small_layout() -> KvLayout {
    KvLayout::new(1, 1, 128, 1, DType::Float16).unwrap()
}

fn host_pool(num_blocks: usize) -> Pool {
    let pool = Pool::new(small_layout(), PoolSize::NumBlocks(num_blocks), Device::Host).unwrap();
    pool.check_invariants().unwrap();
    pool
}

/// Everything observable about an allocator, to compare before and after a failed call.
#[derive(Debug, PartialEq)]
struct Snapshot {
    num_free: usize,
    num_used: usize,
    high_water: usize,
    ref_cnts: Vec<u32>,
}

fn snapshot(a: &BlockAllocator) -> Snapshot {
    a.check_invariants().unwrap();
    Snapshot {
        num_free: a.num_free(),
        num_used: a.num_used(),
        high_water: a.high_water(),
        ref_cnts: (0..a.num_blocks() as u32).map(|id| a.ref_cnt(id).unwrap()).collect(),
    }
}

/// Runs a call that must fail, checks that it failed as `expected` and changed nothing
/// (counts, every ref count, and a free list that `check_invariants` still finds exact).
/// Tests that care about the free-list order check it by allocating afterwards.
fn assert_fails_unchanged<T: std::fmt::Debug>(
    a: &BlockAllocator,
    call: impl FnOnce(&BlockAllocator) -> Result<T, CoreError>,
    expected: impl FnOnce(&CoreError) -> bool,
) {
    let before = snapshot(a);
    let err = call(a).expect_err("the call should have failed");
    assert!(expected(&err), "unexpected error: {err:?}");
    assert_eq!(snapshot(a), before, "a failed call changed the allocator (error: {err})");
}

fn pool_snapshot(p: &Pool) -> Snapshot {
    p.check_invariants().unwrap();
    Snapshot {
        num_free: p.num_free(),
        num_used: p.num_used(),
        high_water: p.high_water(),
        ref_cnts: (0..p.num_blocks() as u32).map(|id| p.ref_cnt(id).unwrap()).collect(),
    }
}

/// [`assert_fails_unchanged`] through the pool's API (its allocator is private).
fn assert_pool_fails_unchanged<T: std::fmt::Debug>(
    p: &Pool,
    call: impl FnOnce(&Pool) -> Result<T, CoreError>,
    expected: impl FnOnce(&CoreError) -> bool,
) {
    let before = pool_snapshot(p);
    let err = call(p).expect_err("the call should have failed");
    assert!(expected(&err), "unexpected error: {err:?}");
    assert_eq!(pool_snapshot(p), before, "a failed call changed the pool (error: {err})");
}

fn is_out_of_blocks(
    requested: usize,
    free: usize,
    num_blocks: usize,
) -> impl FnOnce(&CoreError) -> bool {
    move |e| *e == CoreError::OutOfBlocks { requested, free, num_blocks }
}

fn is_double_free(block_id: u32) -> impl FnOnce(&CoreError) -> bool {
    move |e| *e == CoreError::DoubleFree { block_id }
}

fn is_invalid(value: u32, reason_part: &'static str) -> impl FnOnce(&CoreError) -> bool {
    move |e| matches!(e, CoreError::InvalidBlock { value: v, reason } if *v == value.to_string() && reason.contains(reason_part))
}

#[test]
fn new_rejects_zero_and_too_many_blocks() {
    assert!(matches!(BlockAllocator::new(0), Err(CoreError::InvalidArgument(_))));
    assert!(matches!(
        BlockAllocator::new(kvpool_core::MAX_NUM_BLOCKS + 1),
        Err(CoreError::InvalidArgument(_))
    ));
    assert!(matches!(
        Pool::new(small_layout(), PoolSize::NumBlocks(0), Device::Host),
        Err(CoreError::InvalidArgument(_))
    ));
}

#[test]
fn fresh_allocator_is_all_free() {
    let a = BlockAllocator::new(5).unwrap();
    a.check_invariants().unwrap();
    assert_eq!((a.num_blocks(), a.num_free(), a.num_used(), a.high_water()), (5, 5, 0, 0));
    for id in 0..5 {
        assert_eq!(a.ref_cnt(id).unwrap(), 0);
    }
    assert!(matches!(a.ref_cnt(5), Err(CoreError::InvalidBlock { .. })));
}

#[test]
fn alloc_hands_out_low_ids_first_then_runs_out() {
    let a = BlockAllocator::new(3).unwrap();
    for expected in 0..3 {
        assert_eq!(a.alloc().unwrap(), expected);
        a.check_invariants().unwrap();
        assert_eq!(a.ref_cnt(expected).unwrap(), 1);
    }
    assert_eq!((a.num_free(), a.num_used()), (0, 3));
    assert_fails_unchanged(&a, |a| a.alloc(), is_out_of_blocks(1, 0, 3));
}

#[test]
fn alloc_many_is_all_or_nothing_with_exact_counts() {
    let a = BlockAllocator::new(8).unwrap();
    let first = a.alloc_many(5).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(first, vec![0, 1, 2, 3, 4]);
    assert_fails_unchanged(&a, |a| a.alloc_many(4), is_out_of_blocks(4, 3, 8));
    assert_fails_unchanged(
        &a,
        |a| a.alloc_many(usize::MAX / 8),
        is_out_of_blocks(usize::MAX / 8, 3, 8),
    );
    // The failed calls took nothing: exactly the 3 that were free are still there.
    let rest = a.alloc_many(3).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(rest, vec![5, 6, 7]);
    assert_fails_unchanged(&a, |a| a.alloc_many(1), is_out_of_blocks(1, 0, 8));
}

#[test]
fn alloc_many_zero_is_a_no_op() {
    let a = BlockAllocator::new(2).unwrap();
    assert_eq!(a.alloc_many(0).unwrap(), Vec::<u32>::new());
    a.check_invariants().unwrap();
    assert_eq!(a.num_free(), 2);
    a.free_many(&[]).unwrap();
    a.share_many(&[]).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn alloc_into_fills_the_slice() {
    let a = BlockAllocator::new(4).unwrap();
    let mut out = [u32::MAX; 3];
    a.alloc_into(&mut out).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(out, [0, 1, 2]);
    let mut too_many = [7u32; 2];
    assert_fails_unchanged(&a, |a| a.alloc_into(&mut too_many), is_out_of_blocks(2, 1, 4));
    assert_eq!(too_many, [7, 7], "a failed alloc_into must not write ids");
}

#[test]
fn free_returns_blocks_for_reuse_most_recent_first() {
    let a = BlockAllocator::new(4).unwrap();
    let ids = a.alloc_many(4).unwrap();
    a.free(ids[1]).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.ref_cnt(ids[1]).unwrap(), 0);
    a.free(ids[3]).unwrap();
    a.check_invariants().unwrap();
    assert_eq!((a.num_free(), a.num_used()), (2, 2));
    // LIFO: the most recently freed block is reused first (it is the warmest in cache).
    assert_eq!(a.alloc().unwrap(), ids[3]);
    a.check_invariants().unwrap();
    assert_eq!(a.alloc().unwrap(), ids[1]);
    a.check_invariants().unwrap();
}

#[test]
fn free_many_releases_all_and_batch_realloc_takes_them() {
    let a = BlockAllocator::new(6).unwrap();
    let ids = a.alloc_many(6).unwrap();
    a.free_many(&[4, 0, 2]).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.num_free(), 3);
    for id in [0, 2, 4] {
        assert_eq!(a.ref_cnt(id).unwrap(), 0);
    }
    for id in [1, 3, 5] {
        assert_eq!(a.ref_cnt(id).unwrap(), 1);
    }
    // The chain is pushed with its first id on top.
    assert_eq!(a.alloc_many(3).unwrap(), vec![4, 0, 2]);
    a.check_invariants().unwrap();
    a.free_many(&ids).unwrap();
    a.check_invariants().unwrap();
    assert_eq!((a.num_free(), a.num_used()), (6, 0));
}

#[test]
fn double_free_is_rejected_and_changes_nothing() {
    let a = BlockAllocator::new(4).unwrap();
    let ids = a.alloc_many(3).unwrap();
    a.free(ids[0]).unwrap();
    assert_fails_unchanged(&a, |a| a.free(ids[0]), is_double_free(ids[0]));
    // A never-allocated block counts as a double free too.
    assert_fails_unchanged(&a, |a| a.free(3), is_double_free(3));
    // In a batch, one freed id poisons the whole call: the good ids keep their reference.
    assert_fails_unchanged(&a, |a| a.free_many(&[ids[1], ids[0], ids[2]]), is_double_free(ids[0]));
    assert_eq!(a.ref_cnt(ids[1]).unwrap(), 1);
    assert_eq!(a.ref_cnt(ids[2]).unwrap(), 1);
    // The free list order is unchanged too: the next alloc gets the last freed block.
    assert_eq!(a.alloc().unwrap(), ids[0]);
    a.check_invariants().unwrap();
}

#[test]
fn out_of_range_id_is_rejected_and_changes_nothing() {
    let a = BlockAllocator::new(4).unwrap();
    let ids = a.alloc_many(2).unwrap();
    assert_fails_unchanged(&a, |a| a.free(4), is_invalid(4, "out of range"));
    assert_fails_unchanged(&a, |a| a.free(u32::MAX), is_invalid(u32::MAX, "out of range"));
    assert_fails_unchanged(
        &a,
        |a| a.free_many(&[ids[0], 99, ids[1]]),
        is_invalid(99, "out of range"),
    );
    assert_fails_unchanged(&a, |a| a.share_many(&[ids[0], 4]), is_invalid(4, "out of range"));
    assert!(matches!(a.ref_cnt(4), Err(CoreError::InvalidBlock { .. })));
}

#[test]
fn repeated_id_in_one_free_many_is_rejected_and_changes_nothing() {
    let a = BlockAllocator::new(4).unwrap();
    let ids = a.alloc_many(3).unwrap();
    assert_fails_unchanged(
        &a,
        |a| a.free_many(&[ids[0], ids[1], ids[0]]),
        is_invalid(ids[0], "repeated"),
    );
    // Even when the block holds two references, one call may drop only one of them.
    a.share_many(&[ids[2]]).unwrap();
    assert_fails_unchanged(&a, |a| a.free_many(&[ids[2], ids[2]]), is_invalid(ids[2], "repeated"));
    assert_eq!(a.ref_cnt(ids[2]).unwrap(), 2);
}

#[test]
fn share_many_forks_ref_counts_and_frees_release_at_zero() {
    let a = BlockAllocator::new(4).unwrap();
    let ids = a.alloc_many(3).unwrap();
    // Fork twice: every block is now held by three sequences.
    a.share_many(&ids).unwrap();
    a.check_invariants().unwrap();
    a.share_many(&ids).unwrap();
    a.check_invariants().unwrap();
    assert!(ids.iter().all(|&id| a.ref_cnt(id).unwrap() == 3));
    assert_eq!(a.num_free(), 1);
    for remaining in [2, 1] {
        a.free_many(&ids).unwrap();
        a.check_invariants().unwrap();
        assert!(ids.iter().all(|&id| a.ref_cnt(id).unwrap() == remaining));
        assert_eq!(a.num_free(), 1, "a shared block stays allocated");
    }
    a.free_many(&ids).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.num_free(), 4);
    assert_fails_unchanged(&a, |a| a.free_many(&ids), is_double_free(ids[0]));
}

#[test]
fn share_many_rejects_free_blocks_and_changes_nothing() {
    let a = BlockAllocator::new(4).unwrap();
    let ids = a.alloc_many(2).unwrap();
    assert_fails_unchanged(
        &a,
        |a| a.share_many(&[ids[0], 3, ids[1]]),
        is_invalid(3, "not allocated"),
    );
    assert_eq!(a.ref_cnt(ids[0]).unwrap(), 1);
    // A shared id listed twice takes two references (two forks of the same sequence).
    a.share_many(&[ids[1], ids[1]]).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.ref_cnt(ids[1]).unwrap(), 3);
}

#[test]
fn high_water_tracks_the_peak() {
    let a = BlockAllocator::new(10).unwrap();
    let first = a.alloc_many(4).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.high_water(), 4);
    let second = a.alloc_many(3).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.high_water(), 7);
    a.free_many(&first).unwrap();
    a.check_invariants().unwrap();
    assert_eq!((a.high_water(), a.num_used()), (7, 3));
    let third = a.alloc_many(2).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.high_water(), 7, "5 in use is below the old peak");
    assert_fails_unchanged(&a, |a| a.alloc_many(6), is_out_of_blocks(6, 5, 10));
    assert_eq!(a.high_water(), 7, "a failed alloc does not move the peak");
    let fourth = a.alloc_many(5).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.high_water(), 10);
    for ids in [second, third, fourth] {
        a.free_many(&ids).unwrap();
        a.check_invariants().unwrap();
    }
    assert_eq!((a.high_water(), a.num_used()), (10, 0));
}

#[test]
fn pool_block_ptr_is_base_plus_id_times_block_bytes() {
    let pool = host_pool(7);
    let block_bytes = pool.block_bytes() as u64;
    assert_eq!(block_bytes, 512);
    assert_eq!(pool.base_ptr() % 256, 0, "host slabs are 256-byte aligned");
    assert!(pool.mapped_bytes() >= 7 * 512);
    for id in 0..7 {
        assert_eq!(pool.block_ptr(id).unwrap(), pool.base_ptr() + id as u64 * block_bytes);
    }
    assert!(matches!(pool.block_ptr(7), Err(CoreError::InvalidBlock { .. })));
    assert!(matches!(pool.block_ptr(u32::MAX), Err(CoreError::InvalidBlock { .. })));
    // Blocks tile the slab exactly: the last one ends at the end of the needed bytes.
    assert_eq!(pool.block_ptr(6).unwrap() + block_bytes, pool.base_ptr() + 7 * block_bytes);
}

#[test]
fn pool_delegates_to_its_allocator_and_reports_stats() {
    let pool = host_pool(6);
    let ids = pool.alloc_many(4).unwrap();
    pool.check_invariants().unwrap();
    pool.free(ids[0]).unwrap();
    pool.check_invariants().unwrap();
    let stats = pool.stats().unwrap();
    assert_eq!((stats.num_blocks, stats.num_free, stats.num_used, stats.high_water), (6, 3, 3, 4));
    assert_eq!(stats.block_bytes, 512);
    assert_eq!(stats.device, Device::Host);
    assert_eq!(stats.memory, None);
    assert_eq!(pool.device(), Device::Host);
    assert_pool_fails_unchanged(&pool, |p| p.alloc_many(4), is_out_of_blocks(4, 3, 6));
    assert_pool_fails_unchanged(&pool, |p| p.free(ids[0]), is_double_free(ids[0]));
    pool.free_many(&ids[1..]).unwrap();
    pool.check_invariants().unwrap();
    assert_eq!(pool.num_free(), 6);
}

#[test]
fn pool_memory_bytes_rounds_down_to_whole_blocks() {
    let pool =
        Pool::new(small_layout(), PoolSize::MemoryBytes(512 * 5 + 511), Device::Host).unwrap();
    pool.check_invariants().unwrap();
    assert_eq!(pool.num_blocks(), 5);
    assert!(matches!(
        Pool::new(small_layout(), PoolSize::MemoryBytes(511), Device::Host),
        Err(CoreError::InvalidArgument(_))
    ));
    assert!(matches!(
        Pool::new(small_layout(), PoolSize::DeviceMemoryFraction(0.5), Device::Host),
        Err(CoreError::InvalidArgument(_))
    ));
}

/// The plain model: which ids are allocated and with how many references.
struct Model {
    num_blocks: usize,
    ref_cnt: HashMap<u32, u32>,
    high_water: usize,
}

impl Model {
    fn num_used(&self) -> usize {
        self.ref_cnt.len()
    }
    fn num_free(&self) -> usize {
        self.num_blocks - self.num_used()
    }
    fn held(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.ref_cnt.keys().copied().collect();
        ids.sort_unstable();
        ids
    }
    fn take(&mut self, ids: &[u32]) {
        for &id in ids {
            assert!(id < self.num_blocks as u32, "id {id} out of range");
            assert!(self.ref_cnt.insert(id, 1).is_none(), "block {id} handed out while allocated");
        }
        self.high_water = self.high_water.max(self.num_used());
    }
    fn drop_refs(&mut self, ids: &[u32]) {
        for id in ids {
            let rc = self.ref_cnt.get_mut(id).unwrap();
            *rc -= 1;
            if *rc == 0 {
                self.ref_cnt.remove(id);
            }
        }
    }
    fn assert_matches(&self, a: &BlockAllocator) {
        a.check_invariants().unwrap();
        assert_eq!(a.num_free(), self.num_free());
        assert_eq!(a.num_used(), self.num_used());
        assert_eq!(a.high_water(), self.high_water);
        for id in 0..self.num_blocks as u32 {
            assert_eq!(
                a.ref_cnt(id).unwrap(),
                self.ref_cnt.get(&id).copied().unwrap_or(0),
                "block {id}"
            );
        }
    }
}

/// Picks up to `max` distinct held ids.
fn pick_held(rng: &mut XorShift, model: &Model, max: usize) -> Vec<u32> {
    let mut held = model.held();
    let count = rng.below(max.min(held.len()) + 1);
    for i in 0..count {
        let j = i + rng.below(held.len() - i);
        held.swap(i, j);
    }
    held.truncate(count);
    held
}

fn run_random_sequence(seed: u64, num_blocks: usize, steps: usize) {
    let mut rng = XorShift(seed);
    let a = BlockAllocator::new(num_blocks).unwrap();
    let mut model = Model { num_blocks, ref_cnt: HashMap::new(), high_water: 0 };
    for _ in 0..steps {
        match rng.below(9) {
            0 => match a.alloc() {
                Ok(id) => model.take(&[id]),
                Err(e) => assert_eq!(
                    e,
                    CoreError::OutOfBlocks { requested: 1, free: model.num_free(), num_blocks }
                ),
            },
            1 | 2 => {
                let n = rng.below(num_blocks / 2 + 2);
                match a.alloc_many(n) {
                    Ok(ids) => {
                        assert_eq!(ids.len(), n);
                        model.take(&ids);
                    }
                    Err(e) => {
                        assert!(n > model.num_free());
                        assert_eq!(
                            e,
                            CoreError::OutOfBlocks {
                                requested: n,
                                free: model.num_free(),
                                num_blocks
                            }
                        );
                    }
                }
            }
            3 | 4 => {
                let ids = pick_held(&mut rng, &model, 8);
                a.free_many(&ids).unwrap();
                model.drop_refs(&ids);
            }
            5 => {
                let ids = pick_held(&mut rng, &model, 4);
                a.share_many(&ids).unwrap();
                for id in &ids {
                    *model.ref_cnt.get_mut(id).unwrap() += 1;
                }
            }
            6 => {
                // A free block (double free) slipped in among held ones.
                let free_id = (0..num_blocks as u32).find(|id| !model.ref_cnt.contains_key(id));
                if let Some(bad) = free_id {
                    let mut ids = pick_held(&mut rng, &model, 3);
                    ids.insert(rng.below(ids.len() + 1), bad);
                    assert_eq!(a.free_many(&ids), Err(CoreError::DoubleFree { block_id: bad }));
                }
            }
            7 => {
                // An out-of-range id among held ones.
                let mut ids = pick_held(&mut rng, &model, 3);
                let bad = num_blocks as u32 + rng.below(3) as u32;
                ids.insert(rng.below(ids.len() + 1), bad);
                assert!(
                    matches!(a.free_many(&ids), Err(CoreError::InvalidBlock { value, .. }) if value == bad.to_string())
                );
            }
            _ => {
                // A held id repeated in one call.
                let mut ids = pick_held(&mut rng, &model, 3);
                if let Some(&dup) = ids.first() {
                    ids.push(dup);
                    assert!(
                        matches!(a.free_many(&ids), Err(CoreError::InvalidBlock { reason, .. }) if reason.contains("repeated"))
                    );
                }
            }
        }
        model.assert_matches(&a);
    }
    let held = model.held();
    for id in held {
        let rc = model.ref_cnt[&id];
        for _ in 0..rc {
            a.free(id).unwrap();
        }
        model.ref_cnt.remove(&id);
        model.assert_matches(&a);
    }
    assert_eq!(a.num_free(), num_blocks);
}

#[test]
fn random_sequences_match_a_simple_model() {
    for (seed, num_blocks) in
        [(1, 1), (0x9e37_79b9_7f4a_7c15, 4), (42, 16), (7, 64), (0xdead_beef, 33)]
    {
        run_random_sequence(seed, num_blocks, 2_000);
    }
}

#[test]
fn a_pool_too_large_to_back_is_out_of_memory_before_any_bookkeeping() {
    // 4 MiB blocks: 10^9 of them are 4 PB, past any address space, so the slab is refused
    // before the allocator sizes its per-block state for them (which would abort).
    let layout = KvLayout::new(64, 8, 128, 16, DType::Float16).unwrap();
    let err = Pool::new(layout, PoolSize::NumBlocks(1_000_000_000), Device::Host).err().unwrap();
    assert!(matches!(err, CoreError::OutOfMemory { .. }), "{err:?}");
}
