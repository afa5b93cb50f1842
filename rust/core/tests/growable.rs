//! Growable pools on the host backend: growth on demand, explicit grow, shrink, failed growth
//! leaving the pool exactly as it was (including a backend that refuses memory), data
//! surviving resizes, and allocation racing a shrinking thread.
#![cfg(unix)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use kvpool_core::slab::host_chunks::HostChunks;
use kvpool_core::slab::{ChunkBackend, Device, MemoryInfo};
use kvpool_core::tables::BlockTables;
use kvpool_core::{CoreError, DType, GrowableSize, KvLayout, Pool, PoolSize};

/// 1 layer x K|V x 1 token x 1 head x 384 dims x 2 bytes = 1536 bytes per block: with 4 KiB
/// chunks, blocks straddle chunk boundaries (8 blocks per 3 chunks).
fn layout() -> KvLayout {
    KvLayout::new(1, 1, 384, 1, DType::Float16).unwrap()
}
const BLOCK: usize = 1536;
const CHUNK: usize = 4096;

fn size(max_num_blocks: usize, initial_num_blocks: usize) -> GrowableSize {
    GrowableSize { max_num_blocks, initial_num_blocks, chunk_bytes: Some(CHUNK) }
}

fn pool(max_num_blocks: usize, initial_num_blocks: usize) -> Pool {
    let pool = Pool::new_growable(layout(), size(max_num_blocks, initial_num_blocks), Device::Host)
        .unwrap();
    pool.check_invariants().unwrap();
    pool
}

/// A host backend that fails with `refusal` (lack of memory unless a test says otherwise)
/// for chunks at or past `refuse_from`.
struct Refusing {
    inner: HostChunks,
    refuse_from: AtomicUsize,
    maps: AtomicUsize,
    refusal: CoreError,
}

impl ChunkBackend for Refusing {
    fn base_ptr(&self) -> u64 {
        self.inner.base_ptr()
    }
    fn chunk_bytes(&self) -> usize {
        self.inner.chunk_bytes()
    }
    fn num_chunks(&self) -> usize {
        self.inner.num_chunks()
    }
    fn device(&self) -> Device {
        Device::Host
    }
    fn memory_info(&self) -> Result<Option<MemoryInfo>, CoreError> {
        Ok(None)
    }
    fn map_chunks(&self, first: usize, count: usize) -> Result<(), CoreError> {
        self.maps.fetch_add(1, Ordering::Relaxed);
        if first + count > self.refuse_from.load(Ordering::Relaxed) {
            return Err(self.refusal.clone());
        }
        self.inner.map_chunks(first, count)
    }
    fn unmap_chunks(&self, first: usize, count: usize) -> Result<(), CoreError> {
        self.inner.unmap_chunks(first, count)
    }
}

fn refusing_pool(max_num_blocks: usize, refuse_from_chunk: usize) -> (Pool, *const Refusing) {
    let refusal = CoreError::OutOfMemory { requested_bytes: CHUNK, device: "test".into() };
    failing_pool(max_num_blocks, refuse_from_chunk, refusal)
}

fn failing_pool(
    max_num_blocks: usize,
    refuse_from_chunk: usize,
    refusal: CoreError,
) -> (Pool, *const Refusing) {
    let backend = Box::new(Refusing {
        inner: HostChunks::new(max_num_blocks * BLOCK, CHUNK).unwrap(),
        refuse_from: AtomicUsize::new(refuse_from_chunk),
        maps: AtomicUsize::new(0),
        refusal,
    });
    let raw: *const Refusing = &*backend;
    let pool = Pool::with_chunk_backend(layout(), size(max_num_blocks, 0), backend).unwrap();
    (pool, raw)
}

/// Everything observable about a pool, to compare before and after a failed call.
#[derive(Debug, PartialEq)]
struct Snapshot {
    num_blocks: usize,
    num_free: usize,
    mapped_bytes: usize,
    ref_cnts: Vec<u32>,
}

fn snapshot(pool: &Pool) -> Snapshot {
    pool.check_invariants().unwrap();
    let stats = pool.stats().unwrap();
    Snapshot {
        num_blocks: stats.num_blocks,
        num_free: stats.num_free,
        mapped_bytes: stats.mapped_bytes,
        ref_cnts: (0..pool.num_blocks() as u32).map(|id| pool.ref_cnt(id).unwrap()).collect(),
    }
}

fn block_ptr(pool: &Pool, id: u32) -> *mut u8 {
    pool.block_ptr(id).unwrap() as *mut u8
}

fn fill(pool: &Pool, id: u32) {
    let ptr = block_ptr(pool, id);
    for i in 0..BLOCK {
        // SAFETY: `id < num_blocks`, so its bytes are mapped and inside the pool's
        // reservation; a test writes a block only while it holds it.
        unsafe { ptr.add(i).write((id as usize * 31 + i) as u8) };
    }
}

fn check_filled(pool: &Pool, id: u32) {
    // SAFETY: as in `fill`; nobody writes the block while its holder reads it.
    let bytes = unsafe { std::slice::from_raw_parts(block_ptr(pool, id), BLOCK) };
    assert!(
        bytes.iter().enumerate().all(|(i, &b)| b == (id as usize * 31 + i) as u8),
        "block {id} lost its bytes"
    );
}

#[test]
fn starts_with_whole_chunks_and_no_more() {
    let p = pool(100, 0);
    assert_eq!((p.num_blocks(), p.max_num_blocks(), p.mapped_bytes()), (0, 100, 0));
    assert_eq!(p.reserved_bytes(), (100 * BLOCK).div_ceil(CHUNK) * CHUNK);
    // 3 blocks need 4608 bytes: two chunks, which hold floor(8192 / 1536) = 5 blocks.
    let p = pool(100, 3);
    assert_eq!((p.num_blocks(), p.mapped_bytes(), p.num_free()), (5, 2 * CHUNK, 5));
    let stats = p.stats().unwrap();
    assert!(stats.growable);
    assert_eq!((stats.num_chunks, stats.chunk_bytes, stats.max_num_blocks), (2, CHUNK, 100));
    // The last chunk's spare room never makes more blocks than the maximum.
    let p = pool(7, 7);
    assert_eq!((p.num_blocks(), p.mapped_bytes()), (7, 3 * CHUNK));
}

#[test]
fn alloc_grows_on_demand_and_never_moves_blocks() {
    let p = pool(64, 0);
    let base = p.base_ptr();
    let first = p.alloc_many(3).unwrap();
    assert_eq!(first, [0, 1, 2]);
    assert_eq!(p.num_blocks(), 5);
    first.iter().for_each(|&id| fill(&p, id));
    let more = p.alloc_many(10).unwrap();
    more.iter().for_each(|&id| fill(&p, id));
    p.check_invariants().unwrap();
    assert_eq!(p.base_ptr(), base);
    assert!(p.num_blocks() >= 13);
    assert_eq!(p.num_blocks(), p.mapped_bytes() / BLOCK);
    // Lowest ids first, across the growth: 3, 4 (old free) then the new ones.
    assert_eq!(&more[..3], &[3, 4, 5]);
    first.iter().chain(&more).for_each(|&id| check_filled(&p, id));
    assert_eq!(p.alloc().unwrap(), 13);
}

#[test]
fn growth_past_the_maximum_fails_and_changes_nothing() {
    let p = pool(10, 0);
    let held = p.alloc_many(4).unwrap();
    let before = snapshot(&p);
    let err = p.alloc_many(7).unwrap_err();
    assert!(
        matches!(
            err,
            CoreError::CannotGrow { requested: 7, free: 1, num_blocks: 5, max_num_blocks: 10, .. }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("max_num_blocks 10"), "{err}");
    assert_eq!(snapshot(&p), before, "the chunks mapped for the failed call are unmapped again");
    // Asking for more than the maximum at once is refused up front.
    assert!(matches!(p.alloc_many(11), Err(CoreError::CannotGrow { requested: 11, .. })));
    assert!(matches!(p.grow(11), Err(CoreError::CannotGrow { max_num_blocks: 10, .. })));
    assert_eq!(snapshot(&p), before);
    // Exactly the maximum works.
    let rest = p.alloc_many(6).unwrap();
    assert_eq!(p.num_blocks(), 10);
    p.free_many(&rest).unwrap();
    p.free_many(&held).unwrap();
    p.check_invariants().unwrap();
}

#[test]
fn refused_memory_fails_with_out_of_blocks_and_changes_nothing() {
    // Chunks 0..4 may be mapped (10 blocks); the fifth is refused.
    let (p, backend) = refusing_pool(100, 4);
    let held = p.alloc_many(6).unwrap();
    let before = snapshot(&p);
    let err = p.alloc_many(8).unwrap_err();
    match &err {
        CoreError::CannotGrow { requested: 8, max_num_blocks: 100, reason, .. } => {
            assert!(reason.contains("out of memory"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(snapshot(&p), before);
    assert!(matches!(p.grow(50), Err(CoreError::CannotGrow { .. })));
    assert_eq!(snapshot(&p), before);
    // SAFETY: the backend lives inside `p`, which is alive and never moves it.
    let backend = unsafe { &*backend };
    backend.refuse_from.store(usize::MAX, Ordering::Relaxed);
    let more = p.alloc_many(8).unwrap();
    assert!(backend.maps.load(Ordering::Relaxed) >= 3);
    held.iter().chain(&more).for_each(|&id| assert_eq!(p.ref_cnt(id).unwrap(), 1));
    p.check_invariants().unwrap();
}

#[test]
fn refused_memory_at_creation_is_reported() {
    let backend = Box::new(Refusing {
        inner: HostChunks::new(100 * BLOCK, CHUNK).unwrap(),
        refuse_from: AtomicUsize::new(1),
        maps: AtomicUsize::new(0),
        refusal: CoreError::OutOfMemory { requested_bytes: CHUNK, device: "test".into() },
    });
    let err = Pool::with_chunk_backend(layout(), size(100, 10), backend).err().unwrap();
    assert!(matches!(err, CoreError::OutOfMemory { requested_bytes: 15360, .. }), "{err:?}");
}

#[test]
fn shrink_releases_only_free_top_chunks() {
    let p = pool(64, 0);
    let ids = p.alloc_many(16).unwrap(); // 16 blocks = 24 KiB = 6 chunks
    assert_eq!((p.num_blocks(), p.mapped_bytes()), (16, 6 * CHUNK));
    assert_eq!(p.shrink().unwrap(), 0, "every chunk holds a live block");
    ids.iter().for_each(|&id| fill(&p, id));
    // Free 6..16 except 9: block 9 spans bytes 13824..15360, chunk 3.
    let freed: Vec<u32> = (6..16).filter(|&id| id != 9).collect();
    p.free_many(&freed).unwrap();
    assert_eq!(p.shrink().unwrap(), 2 * CHUNK);
    assert_eq!((p.num_blocks(), p.mapped_bytes()), (10, 4 * CHUNK));
    p.check_invariants().unwrap();
    [0, 1, 2, 3, 4, 5, 9].iter().for_each(|&id| check_filled(&p, id));
    // A second shrink finds nothing more; freeing 9 lets it go down to block 5's chunk
    // (block 5 ends at byte 9216, in chunk 2; chunks 0..3 hold 8 blocks).
    assert_eq!(p.shrink().unwrap(), 0);
    p.free(9).unwrap();
    assert_eq!(p.shrink().unwrap(), CHUNK);
    assert_eq!((p.num_blocks(), p.mapped_bytes()), (8, 3 * CHUNK));
    (0..6).for_each(|id| check_filled(&p, id));
    p.free_many(&[0, 1, 2, 3, 4, 5]).unwrap();
    assert_eq!(p.shrink().unwrap(), 3 * CHUNK);
    assert_eq!((p.num_blocks(), p.mapped_bytes(), p.num_free()), (0, 0, 0));
    assert!(matches!(p.free(0), Err(CoreError::InvalidBlock { .. })), "no block exists");
    p.check_invariants().unwrap();
    // And it grows back from nothing, handing out 0 first.
    assert_eq!(p.alloc().unwrap(), 0);
}

#[test]
fn after_shrink_low_ids_come_first() {
    let p = pool(64, 0);
    let ids = p.alloc_many(20).unwrap();
    // Free in an order that leaves high ids on top of the LIFO list.
    p.free_many(&[1, 3, 5]).unwrap();
    p.free_many(&[17, 18, 19]).unwrap();
    p.shrink().unwrap();
    assert_eq!(p.num_blocks(), 18, "the last live block, 16, ends in chunk 6, which holds 17 too");
    assert_eq!(p.alloc_many(3).unwrap(), [1, 3, 5]);
    let _ = ids;
    p.check_invariants().unwrap();
}

#[test]
fn explicit_grow_returns_mapped_bytes() {
    let p = pool(64, 0);
    assert_eq!(p.grow(8).unwrap(), 3 * CHUNK);
    assert_eq!((p.num_blocks(), p.num_free()), (8, 8));
    assert_eq!(p.grow(8).unwrap(), 0);
    assert_eq!(p.grow(2).unwrap(), 0, "grow never shrinks");
    assert_eq!(p.alloc_many(8).unwrap(), (0..8).collect::<Vec<_>>());
    assert_eq!(p.num_blocks(), 8, "free blocks were enough: no growth");
    p.check_invariants().unwrap();
}

#[test]
fn fixed_pools_are_unchanged() {
    let p = Pool::new(layout(), PoolSize::NumBlocks(4), Device::Host).unwrap();
    assert!(!p.is_growable());
    assert_eq!(p.max_num_blocks(), 4);
    assert_eq!(p.alloc_many(4).unwrap(), [0, 1, 2, 3]);
    assert_eq!(
        p.alloc().unwrap_err(),
        CoreError::OutOfBlocks { requested: 1, free: 0, num_blocks: 4 }
    );
    assert_eq!(
        p.alloc_many(5).unwrap_err(),
        CoreError::OutOfBlocks { requested: 5, free: 0, num_blocks: 4 }
    );
    assert_eq!(p.shrink().unwrap(), 0);
    assert!(matches!(p.grow(5), Err(CoreError::InvalidArgument(_))));
    let stats = p.stats().unwrap();
    assert_eq!(
        (stats.mapped_bytes, stats.reserved_bytes, stats.num_chunks),
        (4 * BLOCK, 4 * BLOCK, 1)
    );
}

#[test]
fn invalid_sizes_are_rejected() {
    for (max, initial) in [(0, 0), (5, 6)] {
        let err = Pool::new_growable(layout(), size(max, initial), Device::Host).err().unwrap();
        assert!(matches!(err, CoreError::InvalidArgument(_)), "{err:?}");
    }
}

#[test]
fn block_tables_grow_the_pool() {
    let p = Arc::new(pool(32, 0));
    let t = BlockTables::new(p.clone(), 8, 16).unwrap();
    t.add(1, 5).unwrap();
    assert_eq!(p.num_blocks(), 5);
    t.append_tokens_many(&[1], &[6]).unwrap();
    assert!(p.num_blocks() >= 11);
    t.add(2, 16).unwrap();
    assert!(matches!(t.add(3, 16), Err(CoreError::CannotGrow { max_num_blocks: 32, .. })));
    p.check_invariants_with(true).unwrap();
    t.free(2).unwrap();
    assert!(p.shrink().unwrap() > 0);
    p.check_invariants_with(true).unwrap();
}

/// Threads allocate, write, check and free while one thread shrinks and grows: no block is
/// ever held twice, no allocation fails spuriously (demand stays below the maximum), and the
/// bytes of held blocks survive every resize.
#[test]
fn alloc_and_free_race_with_shrink() {
    const THREADS: usize = 4;
    const PER_THREAD: usize = 8;
    let p = Arc::new(pool(THREADS * PER_THREAD * 2, 0));
    let held: Arc<Vec<AtomicBool>> =
        Arc::new((0..p.max_num_blocks()).map(|_| AtomicBool::new(false)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let resizer = {
        let (p, stop) = (p.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut shrinks = 0;
            while !stop.load(Ordering::Relaxed) {
                p.shrink().unwrap();
                p.grow(PER_THREAD).unwrap();
                shrinks += 1;
            }
            shrinks
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (p, held) = (p.clone(), held.clone());
            std::thread::spawn(move || {
                for round in 0..300 {
                    let n = 1 + (t + round) % PER_THREAD;
                    let ids = p.alloc_many(n).expect("demand stays below max_num_blocks");
                    for &id in &ids {
                        assert!(
                            !held[id as usize].swap(true, Ordering::AcqRel),
                            "block {id} handed out twice"
                        );
                        fill(&p, id);
                    }
                    std::thread::yield_now();
                    for &id in &ids {
                        check_filled(&p, id);
                        held[id as usize].store(false, Ordering::Release);
                    }
                    p.free_many(&ids).unwrap();
                }
            })
        })
        .collect();
    workers.into_iter().for_each(|w| w.join().unwrap());
    stop.store(true, Ordering::Relaxed);
    assert!(resizer.join().unwrap() > 0);
    p.check_invariants().unwrap();
    assert_eq!(p.num_used(), 0);
    p.shrink().unwrap();
    assert_eq!((p.num_blocks(), p.mapped_bytes()), (0, 0));
}

/// A host backend that unmaps one chunk at a time from the top, like the CUDA backend, and
/// fails once it has unmapped `unmap_budget` chunks. It keeps its own count (reported through
/// `mapped_chunks` when `reports`) and refuses, as an error, a call that does not match it.
struct Flaky {
    inner: HostChunks,
    mapped: AtomicUsize,
    unmap_budget: AtomicUsize,
    reports: bool,
    unmap_calls: AtomicUsize,
}

impl ChunkBackend for Flaky {
    fn base_ptr(&self) -> u64 {
        self.inner.base_ptr()
    }
    fn chunk_bytes(&self) -> usize {
        self.inner.chunk_bytes()
    }
    fn num_chunks(&self) -> usize {
        self.inner.num_chunks()
    }
    fn device(&self) -> Device {
        Device::Host
    }
    fn memory_info(&self) -> Result<Option<MemoryInfo>, CoreError> {
        Ok(None)
    }
    fn map_chunks(&self, first: usize, count: usize) -> Result<(), CoreError> {
        if first != self.mapped.load(Ordering::SeqCst) {
            return Err(CoreError::Cuda(format!(
                "map from {first}, {} mapped",
                self.mapped.load(Ordering::SeqCst)
            )));
        }
        self.inner.map_chunks(first, count)?;
        self.mapped.store(first + count, Ordering::SeqCst);
        Ok(())
    }
    fn unmap_chunks(&self, first: usize, count: usize) -> Result<(), CoreError> {
        self.unmap_calls.fetch_add(1, Ordering::SeqCst);
        if first + count != self.mapped.load(Ordering::SeqCst) {
            return Err(CoreError::Cuda(format!(
                "unmap {first}..{}, {} mapped",
                first + count,
                self.mapped.load(Ordering::SeqCst)
            )));
        }
        for top in (first..first + count).rev() {
            if self.unmap_budget.load(Ordering::SeqCst) == 0 {
                return Err(CoreError::Cuda("injected unmap failure".into()));
            }
            self.unmap_budget.fetch_sub(1, Ordering::SeqCst);
            self.inner.unmap_chunks(top, 1)?;
            self.mapped.store(top, Ordering::SeqCst);
        }
        Ok(())
    }
    fn mapped_chunks(&self) -> Option<usize> {
        self.reports.then(|| self.mapped.load(Ordering::SeqCst))
    }
}

fn flaky_pool(max_num_blocks: usize, unmap_budget: usize, reports: bool) -> (Pool, *const Flaky) {
    let backend = Box::new(Flaky {
        inner: HostChunks::new(max_num_blocks * BLOCK, CHUNK).unwrap(),
        mapped: AtomicUsize::new(0),
        unmap_budget: AtomicUsize::new(unmap_budget),
        reports,
        unmap_calls: AtomicUsize::new(0),
    });
    let raw: *const Flaky = &*backend;
    let pool = Pool::with_chunk_backend(layout(), size(max_num_blocks, 0), backend).unwrap();
    (pool, raw)
}

/// Every block is allocated once, written, checked and freed: all of them are usable.
fn use_every_block(p: &Pool) {
    let ids = p.alloc_many(p.num_blocks()).unwrap();
    ids.iter().for_each(|&id| fill(p, id));
    ids.iter().for_each(|&id| check_filled(p, id));
    p.free_many(&ids).unwrap();
}

#[test]
fn failed_unmap_leaves_the_pool_consistent_and_growable() {
    // The backend unmaps nothing and keeps no count: the slab must count every chunk as
    // still mapped, and the blocks on them stay in the pool.
    let (p, backend) = flaky_pool(64, 0, false);
    // SAFETY: the backend lives inside `p`, which is alive and never moves it.
    let backend = unsafe { &*backend };
    let ids = p.alloc_many(16).unwrap(); // 6 chunks
    p.free_many(&ids[4..]).unwrap();
    let err = p.shrink().unwrap_err();
    assert!(matches!(err, CoreError::Cuda(_)), "{err:?}");
    assert_eq!(
        (p.num_blocks(), p.mapped_bytes(), p.num_free(), p.num_used()),
        (16, 6 * CHUNK, 12, 4)
    );
    p.check_invariants().unwrap();
    p.free_many(&ids[..4]).unwrap();
    use_every_block(&p);
    // Growth after the failure maps from the right chunk (no mismatch, no panic).
    p.alloc_many(40).unwrap();
    assert_eq!(backend.mapped.load(Ordering::SeqCst) * CHUNK, p.mapped_bytes());
    p.check_invariants().unwrap();
}

#[test]
fn partly_failed_unmap_counts_what_is_still_mapped() {
    // The backend unmaps two of the five top chunks, then fails, and reports the rest.
    let (p, backend) = flaky_pool(64, 2, true);
    // SAFETY: as above.
    let backend = unsafe { &*backend };
    let ids = p.alloc_many(16).unwrap(); // 6 chunks
    p.free_many(&ids[1..]).unwrap();
    assert!(matches!(p.shrink(), Err(CoreError::Cuda(_))));
    assert_eq!(backend.mapped.load(Ordering::SeqCst), 4);
    assert_eq!((p.mapped_bytes(), p.num_blocks()), (4 * CHUNK, 10));
    assert_eq!((p.num_free(), p.num_used()), (9, 1));
    p.check_invariants().unwrap();
    p.free(ids[0]).unwrap();
    use_every_block(&p);
    // Growing maps from chunk 4 on, and the next shrink (now allowed) releases everything.
    p.alloc_many(30).map(|ids| p.free_many(&ids).unwrap()).unwrap();
    p.check_invariants().unwrap();
    backend.unmap_budget.store(usize::MAX, Ordering::SeqCst);
    assert!(p.shrink().unwrap() > 0);
    assert_eq!(
        (p.num_blocks(), p.mapped_bytes(), backend.mapped.load(Ordering::SeqCst)),
        (0, 0, 0)
    );
    p.check_invariants().unwrap();
}

#[test]
fn failed_alloc_at_the_maximum_neither_shrinks_nor_reorders() {
    let (p, backend) = flaky_pool(16, usize::MAX, true);
    // SAFETY: as above.
    let backend = unsafe { &*backend };
    let ids = p.alloc_many(16).unwrap();
    assert_eq!(p.num_blocks(), 16);
    // Free 2 then 14: 14 is on top of the LIFO list. A shrink would re-sort (2 on top).
    p.free(ids[2]).unwrap();
    p.free(ids[14]).unwrap();
    for _ in 0..3 {
        assert!(matches!(
            p.alloc_many(3),
            Err(CoreError::CannotGrow { requested: 3, free: 2, .. })
        ));
    }
    assert_eq!(backend.unmap_calls.load(Ordering::SeqCst), 0);
    assert_eq!(p.alloc().unwrap(), 14, "the free list was not drained and re-sorted");
    p.check_invariants().unwrap();
}

/// Allocations that must grow race with each other and with shrinks, on a backend whose
/// unmaps always fail: a caller that gets no blocks always gets `CannotGrow`, never the
/// backend's error from giving back what its call mapped, and the pool stays consistent.
#[test]
fn a_failed_give_back_never_replaces_cannot_grow() {
    let (p, _backend) = flaky_pool(48, 0, true);
    let p = Arc::new(p);
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let p = p.clone();
            std::thread::spawn(move || {
                for round in 0..200 {
                    match p.alloc_many(1 + (t * 7 + round) % 20) {
                        Ok(ids) => {
                            std::thread::yield_now();
                            p.free_many(&ids).unwrap();
                        }
                        Err(CoreError::CannotGrow { .. }) => {}
                        Err(e) => panic!("allocation failed with {e:?}"),
                    }
                    if round % 10 == 0 {
                        let _ = p.shrink();
                    }
                }
            })
        })
        .collect();
    workers.into_iter().for_each(|w| w.join().unwrap());
    p.check_invariants().unwrap();
    assert_eq!(p.num_used(), 0);
}

/// While a resize holds the free ids off the list, they still count as free: the high-water
/// mark and `num_used` never jump to `num_blocks` because a shrink or growth is under way.
/// Allocations and frees racing a grow/shrink loop, with a reader that checks `num_used`
/// throughout; returns the pool with the 10 base blocks still held.
fn resize_while_allocating() -> (Arc<Pool>, Vec<u32>) {
    let p = Arc::new(pool(256, 0));
    let base = p.alloc_many(10).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let resizer = {
        let (p, stop) = (p.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                p.grow(200).unwrap();
                p.shrink().unwrap();
            }
        })
    };
    let reader = {
        let (p, stop) = (p.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let used = p.num_used();
                assert!(used <= 11, "num_used {used} while at most 11 blocks are held");
            }
        })
    };
    for _ in 0..20_000 {
        let id = p.alloc().unwrap();
        p.free(id).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    resizer.join().unwrap();
    reader.join().unwrap();
    (p, base)
}

#[test]
fn resizes_do_not_inflate_num_used() {
    let (p, base) = resize_while_allocating();
    p.free_many(&base).unwrap();
    p.check_invariants().unwrap();
}

#[test]
fn resizes_do_not_inflate_high_water() {
    let (p, base) = resize_while_allocating();
    assert!(p.high_water() <= 11, "high_water {}", p.high_water());
    p.free_many(&base).unwrap();
    p.check_invariants().unwrap();
}

#[test]
fn shrink_keeps_what_a_live_view_covers() {
    let p = pool(64, 0);
    let ids = p.alloc_many(16).unwrap(); // 6 chunks
    let extent = p.pin_view_extent();
    assert_eq!(extent, 16);
    p.free_many(&ids).unwrap();
    assert_eq!(p.shrink().unwrap(), 0, "the view covers every mapped chunk");
    assert_eq!(p.num_blocks(), 16);
    p.check_invariants().unwrap();
    // Growth beyond the view can be given back, down to the view's extent.
    p.grow(40).unwrap();
    let grown = p.mapped_bytes();
    assert_eq!(p.shrink().unwrap(), grown - 6 * CHUNK);
    assert_eq!((p.mapped_bytes(), p.num_blocks()), (6 * CHUNK, 16));
    p.unpin_view_extent(extent);
    assert_eq!(p.shrink().unwrap(), 6 * CHUNK);
    assert_eq!((p.num_blocks(), p.max_view_extent()), (0, 0));
    p.check_invariants().unwrap();
}

#[test]
fn an_os_failure_while_growing_is_reported_as_such_not_as_cannot_grow() {
    // What `HostChunks` reports when `mprotect` fails for another reason than memory.
    let os_failure = CoreError::System {
        operation: format!("committing a chunk (mprotect) of {CHUNK} bytes"),
        errno: 13,
        message: "Permission denied (os error 13)".into(),
    };
    let (p, _) = failing_pool(16, 2, os_failure.clone());
    let ids = p.alloc_many(5).unwrap(); // 2 chunks hold 5 blocks
    let before = snapshot(&p);
    assert_eq!(p.alloc_many(4), Err(os_failure.clone()), "the allocation slow path");
    assert_eq!(snapshot(&p), before);
    assert_eq!(p.alloc(), Err(os_failure.clone()));
    assert_eq!(p.grow(10), Err(os_failure), "an explicit grow");
    assert_eq!(snapshot(&p), before);
    p.free_many(&ids).unwrap();
    p.check_invariants().unwrap();
}

#[test]
fn the_maximum_is_cannot_grow_with_its_reason() {
    let p = pool(5, 0);
    let ids = p.alloc_many(5).unwrap();
    let err = p.alloc().unwrap_err();
    assert!(
        matches!(&err, CoreError::CannotGrow { requested: 1, free: 0, num_blocks: 5, max_num_blocks: 5, reason } if reason == "1 more blocks are needed, max_num_blocks leaves room for 0 more (5 mapped)"),
        "{err:?}"
    );
    p.free_many(&ids).unwrap();
}
