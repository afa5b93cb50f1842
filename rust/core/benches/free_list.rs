//! The lock-free `BlockAllocator` against a `Mutex<Vec<u32>>` free list doing the same job:
//! per-block ref counts, range and repeat checks, double-free detection before any change,
//! all-or-nothing batches. Groups: one block, 16 and 256 blocks per call; 1, 2, 4, 8, 16
//! threads. Each starts from a fresh pool, whose free list hands out neighbouring ids (0, 1,
//! 2, ...), and a LIFO list keeps handing back the ids a batch freed, so a batch's ids stay
//! neighbours: the case our packed reference counts serve best (one atomic word per four ids).
//! `batch16_scattered` first frees the whole pool one id at a time in a random order, so a
//! batch's ids are scattered (about one word per id): the case they serve worst.
//!
//! One iteration = every thread does one round trip (allocate a batch, free it); throughput is
//! counted in blocks, so criterion's time per element is wall-clock ns per block round trip
//! across all threads (the inverse of aggregate throughput).
//!
//! ```text
//! python3 bench/kvbench.py --routine free_list   # -> bench/results/<date>_<commit>_<machine>/free_list.json
//! ```

use std::hint::black_box;
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvpool_core::{BlockAllocator, CoreError};

const THREADS: [usize; 5] = [1, 2, 4, 8, 16];
/// (group name, blocks per call, free list shuffled first).
const BATCHES: [(&str, usize, bool); 4] = [
    ("single", 1, false),
    ("batch16", 16, false),
    ("batch256", 256, false),
    ("batch16_scattered", 16, true),
];
/// Enough for 16 threads to hold a batch of 256 each, with as many again to spare.
const NUM_BLOCKS: usize = 8192;

/// What both free lists offer the benchmark.
trait FreeList: Sync {
    fn alloc_into(&self, out: &mut [u32]) -> Result<(), CoreError>;
    fn free_many(&self, block_ids: &[u32]) -> Result<(), CoreError>;
}

impl FreeList for BlockAllocator {
    fn alloc_into(&self, out: &mut [u32]) -> Result<(), CoreError> {
        BlockAllocator::alloc_into(self, out)
    }
    fn free_many(&self, block_ids: &[u32]) -> Result<(), CoreError> {
        BlockAllocator::free_many(self, block_ids)
    }
}

/// The baseline: a vector of free ids and the ref counts, under one mutex.
struct MutexFreeList {
    num_blocks: usize,
    state: Mutex<State>,
}

struct State {
    free: Vec<u32>,
    ref_cnt: Vec<u32>,
    high_water: usize,
}

impl MutexFreeList {
    fn new(num_blocks: usize) -> Self {
        // Lowest id on top, as in ours.
        let free = (0..num_blocks as u32).rev().collect();
        MutexFreeList {
            num_blocks,
            state: Mutex::new(State { free, ref_cnt: vec![0; num_blocks], high_water: 0 }),
        }
    }

    /// Range and repeat checks, the same as `BlockAllocator::check_distinct_and_in_range`;
    /// they need no shared state, so they run outside the lock.
    fn check_distinct_and_in_range(&self, block_ids: &[u32]) -> Result<(), CoreError> {
        if let Some(&id) = block_ids.iter().find(|&&id| id as usize >= self.num_blocks) {
            return Err(CoreError::InvalidBlock {
                value: id.to_string(),
                reason: "out of range".into(),
            });
        }
        if block_ids.len() > 1 {
            let mut sorted = block_ids.to_vec();
            sorted.sort_unstable();
            if let Some(pair) = sorted.windows(2).find(|p| p[0] == p[1]) {
                return Err(CoreError::InvalidBlock {
                    value: pair[0].to_string(),
                    reason: "repeated in one call".into(),
                });
            }
        }
        Ok(())
    }
}

impl FreeList for MutexFreeList {
    fn alloc_into(&self, out: &mut [u32]) -> Result<(), CoreError> {
        let mut state = self.state.lock().unwrap();
        let (free, requested) = (state.free.len(), out.len());
        if free < requested {
            return Err(CoreError::OutOfBlocks { requested, free, num_blocks: self.num_blocks });
        }
        let State { free: list, ref_cnt, high_water } = &mut *state;
        for (slot, id) in out.iter_mut().zip(list.drain(free - requested..).rev()) {
            debug_assert_eq!(ref_cnt[id as usize], 0);
            ref_cnt[id as usize] = 1;
            *slot = id;
        }
        *high_water = (*high_water).max(self.num_blocks - list.len());
        Ok(())
    }

    fn free_many(&self, block_ids: &[u32]) -> Result<(), CoreError> {
        self.check_distinct_and_in_range(block_ids)?;
        let mut state = self.state.lock().unwrap();
        if let Some(&id) = block_ids.iter().find(|&&id| state.ref_cnt[id as usize] == 0) {
            return Err(CoreError::DoubleFree { block_id: id });
        }
        let State { free, ref_cnt, .. } = &mut *state;
        // Pushed in reverse so `block_ids[0]` ends on top, as in ours.
        for &id in block_ids.iter().rev() {
            let rc = &mut ref_cnt[id as usize];
            *rc -= 1;
            if *rc == 0 {
                free.push(id);
            }
        }
        Ok(())
    }
}

/// Allocates every block, then frees them one at a time in a fixed pseudo-random order, so
/// that the free list hands out scattered ids from then on.
fn scatter(list: &dyn FreeList) {
    let mut ids = vec![0u32; NUM_BLOCKS];
    list.alloc_into(&mut ids).unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..ids.len()).rev() {
        // xorshift64: deterministic, and no dependency for a shuffle.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ids.swap(i, (state % (i as u64 + 1)) as usize);
    }
    for id in ids {
        list.free_many(&[id]).unwrap();
    }
}

/// Runs `iters` round trips of `batch` blocks on each of `threads` threads; returns the wall
/// time from the first thread's start to the last thread's end (thread spawns excluded).
fn run_round_trips(list: &dyn FreeList, threads: usize, batch: usize, iters: u64) -> Duration {
    let barrier = Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let barrier = &barrier;
                s.spawn(move || {
                    let mut ids = vec![0u32; batch];
                    barrier.wait();
                    let start = Instant::now();
                    for _ in 0..iters {
                        list.alloc_into(&mut ids).unwrap();
                        black_box(&mut ids);
                        list.free_many(&ids).unwrap();
                    }
                    (start, Instant::now())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let start = spans.iter().map(|s| s.0).min().unwrap();
    let end = spans.iter().map(|s| s.1).max().unwrap();
    end - start
}

fn free_list_benches(c: &mut Criterion) {
    for (name, batch, scattered) in BATCHES {
        let mut group = c.benchmark_group(name);
        for threads in THREADS {
            group.throughput(Throughput::Elements((threads * batch) as u64));
            let ours = BlockAllocator::new(NUM_BLOCKS).unwrap();
            if scattered {
                scatter(&ours);
            }
            group.bench_with_input(BenchmarkId::new("ours", threads), &threads, |b, &threads| {
                b.iter_custom(|iters| run_round_trips(&ours, threads, batch, iters))
            });
            assert_eq!(ours.num_free(), NUM_BLOCKS);
            let mutex = MutexFreeList::new(NUM_BLOCKS);
            if scattered {
                scatter(&mutex);
            }
            group.bench_with_input(BenchmarkId::new("mutex", threads), &threads, |b, &threads| {
                b.iter_custom(|iters| run_round_trips(&mutex, threads, batch, iters))
            });
            assert_eq!(mutex.state.lock().unwrap().free.len(), NUM_BLOCKS);
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    // Plots cost seconds per benchmark on a small machine and nobody reads them here.
    config = Criterion::default().without_plots();
    targets = free_list_benches
}
criterion_main!(benches);
