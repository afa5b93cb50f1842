//! `BlockAllocator`: the free ids (per-thread caches in front of a lock-free depot, see
//! `free_ids.rs`) plus one reference count per block (`ref_counts.rs`: 16-bit counts packed
//! four to an atomic word).
//!
//! A block is free iff its `ref_cnt` is 0, and then it is in the free ids exactly once (in
//! the depot or in one cache).
//! `ref_cnt` is the per-block state that makes a double free or a stray id an O(1) check
//! that fails before anything changes. No mutex anywhere: every method is safe to call
//! from many threads at once.
//!
//! A growable pool's allocator has room for `max_num_blocks` ids but only `num_blocks` of
//! them exist (are backed by memory); `num_blocks` changes only under the pool's resize
//! lock (`growth.rs`), and only ids below it are ever on the free list.

use crossbeam_utils::CachePadded;
use smallvec::SmallVec;

use crate::error::CoreError;
use crate::free_ids::{FreeIds, Taken};
use crate::ref_counts::{RefCounts, INLINE_IDS, MAX_SHARED};
use crate::sync::{AtomicUsize, Ordering};

pub struct BlockAllocator {
    free_ids: FreeIds,
    /// One count per id up to the capacity (`max_num_blocks`); ids `>= num_blocks` stay 0.
    /// Lazily committed (`zeroed.rs`): memory only for the ids that were ever allocated.
    ref_cnt: RefCounts,
    /// Ids `0..num_blocks` exist. Fixed unless the pool is growable.
    num_blocks: CachePadded<AtomicUsize>,
    high_water: CachePadded<AtomicUsize>,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize) -> Result<Self, CoreError> {
        if num_blocks == 0 {
            return Err(CoreError::InvalidArgument(format!(
                "num_blocks must be in 1..={}, got 0",
                crate::MAX_NUM_BLOCKS
            )));
        }
        Self::new_growable(num_blocks, num_blocks)
    }

    /// An allocator with room for `max_num_blocks` ids, of which `0..num_blocks` exist and
    /// are free. The others come into existence through [`set_num_blocks`](Self::set_num_blocks).
    pub fn new_growable(num_blocks: usize, max_num_blocks: usize) -> Result<Self, CoreError> {
        if max_num_blocks == 0
            || max_num_blocks > crate::MAX_NUM_BLOCKS
            || num_blocks > max_num_blocks
        {
            return Err(CoreError::InvalidArgument(format!(
                "need 0 <= num_blocks <= max_num_blocks, max_num_blocks in 1..={}; got {num_blocks} and {max_num_blocks}",
                crate::MAX_NUM_BLOCKS
            )));
        }
        Ok(BlockAllocator {
            free_ids: FreeIds::new(max_num_blocks as u32, num_blocks as u32)?,
            ref_cnt: RefCounts::new(max_num_blocks)?,
            num_blocks: CachePadded::new(AtomicUsize::new(num_blocks)),
            high_water: CachePadded::new(AtomicUsize::new(0)),
        })
    }

    /// Blocks that exist now (backed by memory).
    pub fn num_blocks(&self) -> usize {
        self.num_blocks.load(Ordering::Acquire)
    }
    /// The most blocks this allocator can ever hold (`num_blocks` unless growable).
    pub fn max_num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }
    /// Free blocks now (a snapshot under concurrency): those on the free list plus those a
    /// resize holds off it for a moment (parked), which it gives back.
    pub fn num_free(&self) -> usize {
        self.counts().1
    }
    pub fn num_used(&self) -> usize {
        self.counts().0
    }
    /// `(num_used, num_free)`: `num_blocks` and the free ids, counted as one
    /// [`counted`](Self::counted) read.
    fn counts(&self) -> (usize, usize) {
        let (num_blocks, free) =
            self.counted(|| Some(self.free_ids.in_places())).expect("a full count always counts");
        (num_blocks.saturating_sub(free), free.min(num_blocks))
    }

    /// `(num_blocks, free ids)` with the ids in places counted by `in_places` (`None`: it
    /// declined to count), inside [`FreeIds::stable`] so that no moving or parked id is
    /// missed. `num_blocks - free` never exceeds the blocks in use at some moment of the read:
    /// a resize changes `num_blocks` only while the ids it adds or drops are parked (a growth
    /// parks its new ids before raising it, a shrink lowers it before unparking the ids it
    /// drops), so a count that loaded the new value, or that could have loaded either value,
    /// saw the park in the versioned word of `stable` and counts those ids as free: whichever
    /// value it read, the result is at most the truth (exactly it for the larger one). An id
    /// counted twice while it moves also makes it lower, never higher.
    fn counted(&self, mut in_places: impl FnMut() -> Option<usize>) -> Option<(usize, usize)> {
        let count = self.free_ids.stable(|| (self.num_blocks(), in_places()));
        let (num_blocks, in_places) = count.read;
        in_places.map(|n| (num_blocks, n + count.off_list))
    }
    /// The most blocks ever in use at once: sampled after every allocation while one thread
    /// uses the allocator, after every allocation that reached the depot, and on every read
    /// (so it is never below `num_used`). While several threads' caches hold ids, an
    /// allocation served by a cache is not sampled (that would read every other thread's
    /// cache line), so a peak that came and went between samples can be missed.
    pub fn high_water(&self) -> usize {
        self.raise_high_water(self.num_used())
    }

    fn raise_high_water(&self, used: usize) -> usize {
        // A load first: the shared line is written only when the mark actually rises.
        let mark = self.high_water.load(Ordering::SeqCst);
        if used > mark {
            self.high_water.fetch_max(used, Ordering::SeqCst).max(used)
        } else {
            mark
        }
    }
    /// Current reference count of a block (0: free).
    pub fn ref_cnt(&self, block_id: u32) -> Result<u32, CoreError> {
        self.check_in_range(block_id)?;
        Ok(self.ref_cnt.get(block_id))
    }

    fn check_in_range(&self, block_id: u32) -> Result<(), CoreError> {
        let num_blocks = self.num_blocks();
        if block_id as usize >= num_blocks {
            return Err(CoreError::out_of_range_id(block_id, num_blocks));
        }
        Ok(())
    }

    /// Tests and benchmarks only: the pool's `alloc` is the one that grows.
    #[cfg(feature = "internals")]
    pub fn alloc(&self) -> Result<u32, CoreError> {
        let mut id = [0u32];
        self.alloc_into(&mut id)?;
        Ok(id[0])
    }

    /// Fills `out` with `out.len()` newly allocated ids (ref count 1), or fails with
    /// `OutOfBlocks` having taken none.
    pub fn alloc_into(&self, out: &mut [u32]) -> Result<(), CoreError> {
        let requested = out.len();
        let taken = self.free_ids.take(out).map_err(|free| CoreError::OutOfBlocks {
            requested,
            free,
            num_blocks: self.num_blocks(),
        })?;
        self.ref_cnt.set_first(out);
        self.sample_high_water(taken);
        Ok(())
    }

    /// The high-water sample after an allocation. Alone (no other cache holds ids), the exact
    /// count is cheap: the depot and our cache, whose length `take` already knows. After a
    /// call that reached the depot, every occupied cache is read. After one served by our
    /// cache while other caches hold ids, nothing is sampled (that would read every other
    /// thread's cache line). Either count is a `counted` read because a resize may drain our
    /// cache onto the depot or park ids meanwhile.
    fn sample_high_water(&self, taken: Taken) {
        let in_places = || match self.free_ids.in_places_if_alone(taken.cached) {
            Some(n) => Some(n),
            None if taken.from_cache => None,
            None => Some(self.free_ids.in_places()),
        };
        if let Some((num_blocks, free)) = self.counted(in_places) {
            self.raise_high_water(num_blocks.saturating_sub(free));
        }
    }

    /// Tests and benchmarks only: the pool's `alloc_many` is the one that grows.
    #[cfg(feature = "internals")]
    pub fn alloc_many(&self, count: usize) -> Result<Vec<u32>, CoreError> {
        if count > self.num_blocks() {
            // Can never succeed: refuse before sizing a buffer for it (a huge count would
            // otherwise abort the process in the allocation below).
            return Err(CoreError::OutOfBlocks {
                requested: count,
                free: self.num_free(),
                num_blocks: self.num_blocks(),
            });
        }
        let mut ids = vec![0u32; count];
        self.alloc_into(&mut ids)?;
        Ok(ids)
    }

    /// Drops one reference; the block returns to the free list when its count reaches 0.
    pub fn free(&self, block_id: u32) -> Result<(), CoreError> {
        self.check_in_range(block_id)?;
        match self.ref_cnt.drop_one(block_id) {
            None => Err(CoreError::DoubleFree { block_id }),
            Some(0) => {
                self.free_ids.put(&[block_id]);
                Ok(())
            }
            Some(_) => Ok(()),
        }
    }

    /// Drops one reference to each id. Validates all of them first (range, repeats, not
    /// allocated) and changes nothing if any is bad (see [`RefCounts::release_many`]).
    pub fn free_many(&self, block_ids: &[u32]) -> Result<(), CoreError> {
        if let [id] = block_ids {
            // The same checks and errors, without the batch bookkeeping.
            return self.free(*id);
        }
        let mut released: SmallVec<[u32; INLINE_IDS]> = SmallVec::new();
        let released = self.ref_cnt.release_many(block_ids, self.num_blocks(), &mut released)?;
        self.free_ids.put(released);
        Ok(())
    }

    /// Adds one reference to each id (a fork sharing blocks; an id may repeat). All must be
    /// allocated, with fewer than [`MAX_SHARED`] references each.
    pub fn share_many(&self, block_ids: &[u32]) -> Result<(), CoreError> {
        for &id in block_ids {
            self.check_in_range(id)?;
            match self.ref_cnt.get(id) {
                0 => return Err(not_allocated(id)),
                count @ MAX_SHARED.. => return Err(too_many_refs(id, count)),
                _ => {}
            }
        }
        for (done, &id) in block_ids.iter().enumerate() {
            if let Err(count) = self.ref_cnt.share(id) {
                // Freed under our feet by a racing caller, or an id repeated up to the limit:
                // drop the references we added, one by one (the prefix may repeat an id, so
                // it is not a valid `free_many`).
                let released: Vec<u32> = block_ids[..done]
                    .iter()
                    .copied()
                    .filter(|&undo| self.ref_cnt.drop_one(undo) == Some(0))
                    .collect();
                self.free_ids.put(&released);
                return Err(if count == 0 { not_allocated(id) } else { too_many_refs(id, count) });
            }
        }
        Ok(())
    }

    /// Rejects ids past the end and ids repeated within one call.
    pub fn check_distinct_and_in_range(&self, block_ids: &[u32]) -> Result<(), CoreError> {
        self.ref_cnt.check_batch(block_ids, self.num_blocks())
    }

    /// Reference count of any id below the capacity, existing or not (invariant checks).
    pub(crate) fn ref_cnt_unchecked(&self, block_id: usize) -> u32 {
        self.ref_cnt.get(block_id as u32)
    }

    /// Takes every cached id and as many ids off the depot as it holds at one moment, and
    /// parks them: they still count as free. Ids freed meanwhile may stay behind (in a cache,
    /// or on the depot under newer ones), so the result is not necessarily every free id: a
    /// caller treats the ids it did not get as live. Resize path only: the caller holds the
    /// pool's resize lock and gives the ids back (or drops them) with
    /// [`set_num_blocks`](Self::set_num_blocks).
    pub(crate) fn drain_free(&self) -> Vec<u32> {
        self.free_ids.drain()
    }

    /// Sets how many blocks exist and pushes `free_ids` (drained or new, all with ref count 0,
    /// all `< num_blocks`, none on the list), sorted so the lowest id is allocated first.
    /// Every parked id must be among `free_ids` or `>= num_blocks` (dropped); afterwards none
    /// is parked. Resize path only, under the pool's resize lock: a shrink must have drained
    /// every id `>= num_blocks` first, and a growth raises `num_blocks` before the new ids are
    /// pushed, so an id on the list is always in range.
    pub(crate) fn set_num_blocks(&self, num_blocks: usize, mut free_ids: Vec<u32>) {
        assert!(
            num_blocks <= self.max_num_blocks(),
            "{num_blocks} blocks exceed the capacity {}",
            self.max_num_blocks()
        );
        debug_assert!(free_ids.iter().all(|&id| (id as usize) < num_blocks));
        let old = self.num_blocks();
        // `num_blocks` changes only while ids are parked (see `counted`): new ids come into
        // existence parked (free, not yet on the list), and ids a shrink drops stay parked
        // until the lower `num_blocks` is stored. So the change is never read as blocks in use.
        self.free_ids.park(num_blocks.saturating_sub(old));
        self.num_blocks.store(num_blocks, Ordering::Release);
        free_ids.sort_unstable();
        self.free_ids.unpark_into_depot(&free_ids);
    }

    /// The pool invariants (`num_free + num_used == num_blocks`, free ids unique and below
    /// `num_blocks`, free iff ref count 0), checked exactly. Only meaningful while no other thread
    /// mutates the allocator.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.check_invariants_with_evictable(&[])
    }

    /// [`check_invariants`](Self::check_invariants) for a pool with a prefix cache: the
    /// `evictable` blocks have ref count 0 but are held off the free list by the cache.
    pub(crate) fn check_invariants_with_evictable(&self, evictable: &[u32]) -> Result<(), String> {
        let on_list = self.free_ids.snapshot()?;
        let num_blocks = self.num_blocks();
        if num_blocks > self.max_num_blocks() {
            return Err(format!(
                "num_blocks {num_blocks} > max_num_blocks {}",
                self.max_num_blocks()
            ));
        }
        let mut seen = vec![false; num_blocks];
        let mut held_by_cache = vec![false; num_blocks];
        for &id in evictable {
            match held_by_cache.get_mut(id as usize) {
                Some(held) => *held = true,
                None => return Err(format!("evictable block {id} >= num_blocks {num_blocks}")),
            }
        }
        for &id in &on_list {
            if id as usize >= num_blocks {
                return Err(format!(
                    "block {id} is on the free list but num_blocks is {num_blocks}"
                ));
            }
            if std::mem::replace(&mut seen[id as usize], true) {
                return Err(format!("block {id} is on the free list twice"));
            }
            if held_by_cache[id as usize] {
                return Err(format!("block {id} is both on the free list and evictable"));
            }
            let rc = self.ref_cnt.get(id);
            if rc != 0 {
                return Err(format!("block {id} is on the free list with ref_cnt {rc}"));
            }
        }
        for id in 0..self.max_num_blocks() {
            let rc = self.ref_cnt.get(id as u32);
            if id >= num_blocks {
                if rc != 0 {
                    return Err(format!("block {id} >= num_blocks {num_blocks} has ref_cnt {rc}"));
                }
            } else if !seen[id] && !held_by_cache[id] && rc == 0 {
                return Err(format!("block {id} has ref_cnt 0 but is not on the free list (lost)"));
            }
        }
        if on_list.len() != self.free_ids.available() || on_list.len() != self.num_free() {
            return Err(format!(
                "num_free {} != {} ids on the free list",
                self.num_free(),
                on_list.len()
            ));
        }
        if self.num_free() + self.num_used() != num_blocks {
            return Err("num_free + num_used != num_blocks".into());
        }
        let mark = self.high_water.load(Ordering::Relaxed);
        if mark > self.max_num_blocks() {
            return Err(format!("high_water {mark} > max_num_blocks {}", self.max_num_blocks()));
        }
        Ok(())
    }
}

fn not_allocated(id: u32) -> CoreError {
    CoreError::InvalidBlock { value: id.to_string(), reason: "not allocated".into() }
}

fn too_many_refs(id: u32, count: u32) -> CoreError {
    CoreError::InvalidBlock {
        value: id.to_string(),
        reason: format!(
            "already has {count} references (a fork raises a count to at most {MAX_SHARED})"
        ),
    }
}

/// The prefix cache's view of the allocator: reference counts and the free list, used with
/// the cache's lock held (see `prefix_cache/mod.rs`).
impl crate::prefix_cache::BlockRefs for BlockAllocator {
    fn num_blocks(&self) -> usize {
        self.num_blocks()
    }
    fn num_free(&self) -> usize {
        self.free_ids.available()
    }
    fn ref_cnt(&self, id: u32) -> u32 {
        self.ref_cnt.get(id)
    }
    fn set_first_ref(&self, id: u32) {
        self.ref_cnt.set_first(&[id]);
    }
    fn add_ref(&self, id: u32) {
        self.ref_cnt.add_held(id);
    }
    fn drop_ref(&self, id: u32) -> Option<u32> {
        self.ref_cnt.drop_one(id)
    }
    fn pop_free(&self, out: &mut [u32]) -> Result<(), usize> {
        let taken = self.free_ids.take(out)?;
        self.ref_cnt.set_first(out);
        // The same cheap sample as `alloc_into` (a full count would scan every cache slot).
        self.sample_high_water(taken);
        Ok(())
    }
    fn push_free(&self, ids: &[u32]) {
        for &id in ids {
            self.ref_cnt.clear(id);
        }
        self.free_ids.put(ids);
    }
}
