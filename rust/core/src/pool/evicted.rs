//! The hand-off of evicted blocks to a tier below memory (a disk tier in Python): blocks
//! leaving the pool's last in-memory tier are copied, with their hash, into a bounded stage
//! of host slots before their memory is reused; the tier below drains the stage when it
//! likes (design: `prefix_cache/prefix_cache.md`, "Below the last in-memory tier").
//!
//! Why a stage and not a callback: the core evicts inside an allocation, under the cache's
//! lock, often with the GIL released. Calling Python there would take the GIL under the
//! cache lock (a deadlock with any thread that holds the GIL and allocates) and put file I/O
//! on the allocator's path. Holding evicted blocks out of the free list until Python has
//! written them would make an allocation fail, or wait, on a slow or absent reader. A copy
//! into a stage of its own is neither: the capture is a memcpy under the cache lock (the
//! lock the eviction already holds), the block is reused right after, and a reader that
//! stops reading costs the oldest staged blocks, counted, never an allocation.
//!
//! A slot is `Free`, `Filled` (holds a block's bytes, on the FIFO of blocks to drain) or
//! `Taken` (handed to the reader by [`EvictionStage::take`], never rewritten until
//! [`EvictionStage::release`]). `free + filled + taken == num_slots`. Each `take` returns a
//! take id, recorded on its slots, and `release` refuses a slot not taken under the id it is
//! given: a second reader (another Python thread) cannot free slots whose bytes the first is
//! still writing to disk through NIXL from the stage's address, which a capture would then
//! overwrite under the hash already handed out. A taken slot that a
//! [`EvictionStage::checksums`] call is reading (it hashes with the stage's lock released,
//! the GIL too) counts that reader, and `release` refuses it until the read ends: the stage,
//! not the reader's good manners, keeps a capture from writing a slot being read. A capture into a full
//! stage overwrites the oldest `Filled` slot (the newest evictions were used most recently,
//! as the pool's LRU ranks them); when every slot is `Taken`, the new block is dropped.
//!
//! Lock order: cache -> host tier -> stage. The stage's lock is the innermost: nothing is
//! called under it, so the reader's calls, which take it alone, cannot deadlock an eviction.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard};

use crate::error::CoreError;
use crate::prefix_cache::BlockHash;

/// Slots start at this boundary, so that a file opened with O_DIRECT can be read and
/// written from them (4 KiB covers every logical block size seen).
pub const STAGE_ALIGN_BYTES: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    Filled,
    Taken,
}

/// Counters of the stage (cumulative) and its gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EvictionStageStats {
    pub num_slots: usize,
    /// Slots holding a block not yet taken, and slots the reader holds.
    pub num_filled: usize,
    pub num_taken: usize,
    /// Blocks copied into the stage.
    pub captured: u64,
    /// Blocks lost: a staged block overwritten before it was taken, or an evicted block that
    /// found every slot taken.
    pub dropped: u64,
    /// Blocks handed to the reader.
    pub taken: u64,
}

struct StageState {
    slots: Vec<Slot>,
    hashes: Vec<BlockHash>,
    /// Per slot, the `checksums` calls reading it now (non-zero only for `Taken` slots).
    readers: Vec<u32>,
    /// Per slot, the id of the `take` that holds it (0, never an id, when not `Taken`).
    owners: Vec<u64>,
    /// The id the next `take` returns (ids start at 1 and are never reused).
    next_take_id: u64,
    /// `Filled` slots, oldest first.
    filled: VecDeque<u32>,
    free: Vec<u32>,
    stats: EvictionStageStats,
}

/// The stage: `num_slots` blocks of host memory and the slots' states.
pub struct EvictionStage {
    base: NonNull<u8>,
    layout: Layout,
    block_bytes: usize,
    num_slots: usize,
    state: Mutex<StageState>,
}

// SAFETY: the stage owns its allocation; its bytes are written only under `state`'s lock
// (captures into `Free`/`Filled` slots), and read without the lock only by `checksums`, in
// `Taken` slots whose reader count it holds: `release` refuses such a slot, so it cannot
// become `Free` and be captured into during the read. No unsynchronised Rust-visible state.
// The reader's own I/O (NIXL) reads its taken slots through `base_ptr`, outside Rust, until
// it releases them; `release` takes the take id and refuses slots held under another, so
// only that reader can end the hold (an id is a plain number: this guards against another
// reader's mistake, not against code that forges ids).
unsafe impl Send for EvictionStage {}
// SAFETY: as above.
unsafe impl Sync for EvictionStage {}

impl EvictionStage {
    /// A stage of `num_slots` blocks of `block_bytes` (zeroed host memory, aligned to
    /// [`STAGE_ALIGN_BYTES`]). `num_slots` of 0, or a size past the address space, is
    /// `InvalidArgument`; a failed allocation `OutOfMemory`.
    pub fn new(num_slots: usize, block_bytes: usize) -> Result<Self, CoreError> {
        if num_slots == 0 || num_slots > crate::MAX_NUM_BLOCKS {
            return Err(CoreError::InvalidArgument(format!(
                "an eviction stage needs 1..={} slots, got {num_slots}",
                crate::MAX_NUM_BLOCKS
            )));
        }
        let bytes = num_slots.checked_mul(block_bytes).filter(|&b| b > 0).ok_or_else(|| {
            CoreError::InvalidArgument(format!(
                "{num_slots} slots of {block_bytes} bytes do not make a stage"
            ))
        })?;
        let layout = Layout::from_size_align(bytes, STAGE_ALIGN_BYTES)
            .map_err(|e| CoreError::InvalidArgument(format!("an eviction stage: {e}")))?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { alloc_zeroed(layout) };
        let base = NonNull::new(raw).ok_or_else(|| CoreError::OutOfMemory {
            requested_bytes: bytes,
            device: "host".into(),
        })?;
        let state = StageState {
            slots: vec![Slot::Free; num_slots],
            hashes: vec![BlockHash([0; 32]); num_slots],
            readers: vec![0; num_slots],
            owners: vec![0; num_slots],
            next_take_id: 1,
            filled: VecDeque::with_capacity(num_slots),
            free: (0..num_slots as u32).rev().collect(),
            stats: EvictionStageStats { num_slots, ..Default::default() },
        };
        Ok(EvictionStage { base, layout, block_bytes, num_slots, state: Mutex::new(state) })
    }

    fn lock(&self) -> MutexGuard<'_, StageState> {
        // Every critical section leaves the state consistent before anything can panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn base_ptr(&self) -> u64 {
        self.base.as_ptr() as u64
    }
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Copies the blocks `evicted` (`(id, hash)`, least recently used first) of the host
    /// memory at `src_base` into slots. Called by an eviction under the cache's lock, before
    /// the blocks are reused.
    ///
    /// # Safety
    /// Every `id` names a block of `block_bytes` at `src_base + id * block_bytes` in host
    /// memory that stays readable, and that nobody writes, until the call returns.
    pub(crate) unsafe fn capture(&self, src_base: u64, evicted: &[(u32, BlockHash)]) {
        let mut st = self.lock();
        for &(id, hash) in evicted {
            let Some(slot) = st.free.pop().or_else(|| {
                let oldest = st.filled.pop_front()?;
                st.stats.dropped += 1; // overwritten before the reader took it
                Some(oldest)
            }) else {
                st.stats.dropped += 1; // every slot is the reader's
                continue;
            };
            let src = (src_base as usize + id as usize * self.block_bytes) as *const u8;
            // SAFETY: the source block is readable and unchanged (the caller's contract); the
            // slot is inside the stage's allocation (slot < num_slots) and not `Taken`, so no
            // reader looks at it; the two regions are distinct allocations.
            unsafe {
                std::ptr::copy_nonoverlapping(src, self.slot_ptr(slot), self.block_bytes);
            }
            st.slots[slot as usize] = Slot::Filled;
            st.hashes[slot as usize] = hash;
            st.filled.push_back(slot);
            st.stats.captured += 1;
        }
    }

    fn slot_ptr(&self, slot: u32) -> *mut u8 {
        debug_assert!((slot as usize) < self.num_slots);
        // SAFETY: slot < num_slots, so the offset stays inside the allocation.
        unsafe { self.base.as_ptr().add(slot as usize * self.block_bytes) }
    }

    /// Hands the reader up to `max` staged blocks, oldest first, as `(slot, hash)`, with a
    /// new take id: their bytes stay in those slots, unchanged, until
    /// [`release`](Self::release) under that id.
    pub fn take(&self, max: usize) -> (u64, Vec<(u32, BlockHash)>) {
        let mut st = self.lock();
        let take_id = st.next_take_id;
        st.next_take_id += 1;
        let n = st.filled.len().min(max);
        let slots: Vec<u32> = st.filled.drain(..n).collect();
        let out: Vec<(u32, BlockHash)> = slots
            .into_iter()
            .map(|slot| {
                st.slots[slot as usize] = Slot::Taken;
                st.owners[slot as usize] = take_id;
                (slot, st.hashes[slot as usize])
            })
            .collect();
        st.stats.taken += out.len() as u64;
        (take_id, out)
    }

    /// Gives slots taken under `take_id` back for reuse. A slot that is not taken, taken
    /// under another id (another reader may still be writing it out), named twice, or being
    /// read by a [`checksums`](Self::checksums) call on another thread is `InvalidArgument`
    /// and nothing changes.
    pub fn release(&self, take_id: u64, slots: &[u32]) -> Result<(), CoreError> {
        let mut st = self.lock();
        let mut seen = std::collections::HashSet::with_capacity(slots.len());
        for &slot in slots {
            if st.slots.get(slot as usize) != Some(&Slot::Taken) || !seen.insert(slot) {
                return Err(CoreError::InvalidArgument(format!(
                    "slot {slot} of the eviction stage is not taken (or is named twice)"
                )));
            }
            if st.owners[slot as usize] != take_id {
                return Err(CoreError::InvalidArgument(format!(
                    "slot {slot} of the eviction stage was not taken under take id {take_id}: \
                     only the reader that took it may release it"
                )));
            }
            if st.readers[slot as usize] != 0 {
                return Err(CoreError::InvalidArgument(format!(
                    "slot {slot} of the eviction stage is being checksummed: release it after"
                )));
            }
        }
        for &slot in slots {
            st.slots[slot as usize] = Slot::Free;
            st.owners[slot as usize] = 0;
            st.free.push(slot);
        }
        Ok(())
    }

    /// Drops every staged block not yet taken (a reset: their KV is stale); returns how many.
    pub(crate) fn clear(&self) -> usize {
        let mut st = self.lock();
        let slots: Vec<u32> = st.filled.drain(..).collect();
        for &slot in &slots {
            st.slots[slot as usize] = Slot::Free;
            st.free.push(slot);
        }
        slots.len()
    }

    /// The CRC-32C of each taken slot's bytes, hashed with the stage's lock released. A slot
    /// not taken is `InvalidArgument` (nothing read); while the call reads them, the slots
    /// cannot be released (see [`release`](Self::release)).
    pub fn checksums(&self, slots: &[u32]) -> Result<Vec<u32>, CoreError> {
        self.read_taken(slots, crate::pool::crc::crc32c)
    }

    /// `read` of each taken slot's bytes, in order, with the lock released: the slots'
    /// reader counts, raised under the lock first, keep them `Taken` (so never captured
    /// into) until they are lowered after the last read, also if `read` panics.
    fn read_taken<R>(&self, slots: &[u32], read: impl Fn(&[u8]) -> R) -> Result<Vec<R>, CoreError> {
        {
            let mut st = self.lock();
            if let Some(&slot) =
                slots.iter().find(|&&s| st.slots.get(s as usize) != Some(&Slot::Taken))
            {
                return Err(CoreError::InvalidArgument(format!(
                    "slot {slot} of the eviction stage is not taken"
                )));
            }
            for &slot in slots {
                st.readers[slot as usize] += 1;
            }
        }
        struct Readers<'a>(&'a EvictionStage, &'a [u32]);
        impl Drop for Readers<'_> {
            fn drop(&mut self) {
                let mut st = self.0.lock();
                for &slot in self.1 {
                    st.readers[slot as usize] -= 1;
                }
            }
        }
        let _readers = Readers(self, slots);
        Ok(slots
            .iter()
            .map(|&slot| {
                // SAFETY: the slot is inside the allocation (slot < num_slots, checked above)
                // and `Taken` with a reader counted, which `release` refuses: it stays `Taken`
                // until `_readers` drops, so no capture writes it during this borrow.
                let bytes = unsafe {
                    std::slice::from_raw_parts(self.slot_ptr(slot) as *const u8, self.block_bytes)
                };
                read(bytes)
            })
            .collect())
    }

    pub fn stats(&self) -> EvictionStageStats {
        let st = self.lock();
        let mut stats = st.stats;
        stats.num_filled = st.filled.len();
        stats.num_taken = st.slots.iter().filter(|&&s| s == Slot::Taken).count();
        stats
    }

    /// `free + filled + taken == num_slots`, each slot in exactly the list its state says.
    pub fn check_invariants(&self) -> Result<(), String> {
        let st = self.lock();
        let count = |want: Slot| st.slots.iter().filter(|&&s| s == want).count();
        let (free, filled, taken) = (count(Slot::Free), count(Slot::Filled), count(Slot::Taken));
        if free != st.free.len() || filled != st.filled.len() {
            return Err(format!(
                "eviction stage: {free} free / {filled} filled slots, lists of {} / {}",
                st.free.len(),
                st.filled.len()
            ));
        }
        if free + filled + taken != self.num_slots {
            return Err(format!(
                "eviction stage: {free} free + {filled} filled + {taken} taken != {} slots",
                self.num_slots
            ));
        }
        if let Some(slot) =
            (0..self.num_slots).find(|&s| st.readers[s] != 0 && st.slots[s] != Slot::Taken)
        {
            return Err(format!("eviction stage: slot {slot} is read but not taken"));
        }
        if let Some(slot) =
            (0..self.num_slots).find(|&s| (st.owners[s] != 0) != (st.slots[s] == Slot::Taken))
        {
            return Err(format!("eviction stage: slot {slot} has an owner iff not taken"));
        }
        if st.free.iter().any(|&s| st.slots[s as usize] != Slot::Free)
            || st.filled.iter().any(|&s| st.slots[s as usize] != Slot::Filled)
        {
            return Err("eviction stage: a listed slot is in another state".into());
        }
        Ok(())
    }
}

/// A stage bound to the pool whose evictions it captures.
pub(crate) struct AttachedStage {
    pub(crate) stage: EvictionStage,
    /// The pool's host slab: blocks evicted from the pool itself are read from here. Only
    /// host pools take a stage (`Pool::attach_eviction_stage`): a CUDA pool's blocks, and
    /// its host tier's, are written by asynchronous copies that a capture would have to wait
    /// for under the cache's lock.
    pool_base: u64,
}

impl AttachedStage {
    pub(crate) fn new(stage: EvictionStage, pool_base: u64) -> Self {
        AttachedStage { stage, pool_base }
    }

    /// Captures blocks the pool itself just evicted (`(id, hash)`), before they are reused.
    pub(crate) fn capture_pool_blocks(&self, evicted: &[(u32, BlockHash)]) {
        if evicted.is_empty() {
            return;
        }
        // SAFETY: the ids are blocks of the pool's host slab at `pool_base` that the cache
        // just evicted under its lock: nobody references them, and they are handed out only
        // after this returns (`PrefixCache::evict_into`, `evict_above`, the host tier's spill).
        unsafe { self.stage.capture(self.pool_base, evicted) }
    }
}

impl Drop for EvictionStage {
    fn drop(&mut self) {
        // SAFETY: `base` came from `alloc_zeroed(self.layout)` and is freed only here, once.
        unsafe { dealloc(self.base.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taken_slots_are_never_rewritten_and_a_bad_release_changes_nothing() {
        let stage = EvictionStage::new(2, 8).unwrap();
        assert_eq!(stage.base_ptr() % STAGE_ALIGN_BYTES as u64, 0);
        let src: Vec<u8> = (0..4).flat_map(|b| [b as u8; 8]).collect();
        let h = |i: u8| BlockHash([i; 32]);
        // SAFETY: blocks 0..4 of 8 bytes each lie in `src`, unchanged during the calls.
        unsafe { stage.capture(src.as_ptr() as u64, &[(1, h(1)), (2, h(2))]) };
        let (first_id, taken) = stage.take(1);
        assert_eq!(taken, [(taken[0].0, h(1))]);
        assert_eq!(stage.checksums(&[taken[0].0]).unwrap(), [crate::pool::crc::crc32c(&[1; 8])]);
        // Two more into a stage whose one slot left is filled: it is overwritten, then the
        // next block finds every slot taken or just filled and drops the oldest filled one.
        // SAFETY: as above.
        unsafe { stage.capture(src.as_ptr() as u64, &[(3, h(3))]) };
        assert_eq!(stage.stats().dropped, 1, "block 2, overwritten before it was taken");
        let (rest_id, rest) = stage.take(usize::MAX);
        assert_eq!(rest.iter().map(|t| t.1).collect::<Vec<_>>(), [h(3)]);
        // SAFETY: as above.
        unsafe { stage.capture(src.as_ptr() as u64, &[(0, h(0))]) };
        assert_eq!(stage.stats().dropped, 2, "every slot taken: the new block is dropped");
        assert_eq!(stage.checksums(&[taken[0].0]).unwrap(), [crate::pool::crc::crc32c(&[1; 8])]);
        let before = stage.stats();
        assert!(stage.release(first_id, &[taken[0].0, taken[0].0]).is_err(), "named twice");
        assert!(stage.release(first_id, &[taken[0].0, 7]).is_err(), "not a slot");
        assert!(stage.release(first_id, &[taken[0].0, rest[0].0]).is_err(), "rest: another take");
        assert_eq!(stage.stats(), before);
        stage.check_invariants().unwrap();
        stage.release(first_id, &[taken[0].0]).unwrap();
        stage.release(rest_id, &[rest[0].0]).unwrap();
        assert!(stage.checksums(&[rest[0].0]).is_err(), "released: not the reader's now");
        assert_eq!(stage.stats().num_taken, 0);
        stage.check_invariants().unwrap();
    }

    /// A release from another thread while `checksums` reads a slot (with the lock released,
    /// as the binding does with the GIL released) is refused, so the capture that follows
    /// cannot write the slot under the reader; once the read is over it succeeds.
    #[test]
    fn a_slot_being_checksummed_cannot_be_released_from_another_thread() {
        use std::sync::mpsc;
        let stage = EvictionStage::new(1, 8).unwrap();
        let src = [7u8; 16];
        let h = BlockHash([7; 32]);
        // SAFETY: blocks 0..2 of 8 bytes lie in `src`, unchanged during the call.
        unsafe { stage.capture(src.as_ptr() as u64, &[(0, h)]) };
        let (take_id, taken) = stage.take(1);
        let slot = taken[0].0;
        let (to_other, other_rx) = mpsc::channel::<()>();
        let (to_reader, reader_rx) = mpsc::channel::<(bool, u64)>();
        std::thread::scope(|scope| {
            let (stage, src) = (&stage, &src);
            let other = scope.spawn(move || {
                other_rx.recv().unwrap(); // the reader is inside its read
                let released = stage.release(take_id, &[slot]).is_ok();
                // SAFETY: as above.
                unsafe { stage.capture(src.as_ptr() as u64 + 8, &[(1, BlockHash([8; 32]))]) };
                to_reader.send((released, stage.stats().dropped)).unwrap();
            });
            let sums = stage
                .read_taken(&[slot], |bytes| {
                    to_other.send(()).unwrap();
                    let (released, dropped) = reader_rx.recv().unwrap();
                    assert!(!released, "a slot being read was released");
                    assert_eq!(dropped, 1, "the capture found every slot taken");
                    crate::pool::crc::crc32c(bytes)
                })
                .unwrap();
            other.join().unwrap();
            assert_eq!(sums, [crate::pool::crc::crc32c(&[7; 8])], "the bytes were not rewritten");
        });
        stage.check_invariants().unwrap();
        stage.release(take_id, &[slot]).unwrap();
        assert_eq!(stage.stats().num_taken, 0);
        stage.check_invariants().unwrap();
    }

    /// A second reader's release of slots the first took (as two Python threads draining one
    /// stage would do while the first writes its slots to disk) is refused and changes
    /// nothing, so the next capture cannot overwrite a slot being written; the taker's own
    /// release is accepted.
    #[test]
    fn only_the_taker_can_release_its_slots() {
        use std::sync::mpsc;
        let stage = EvictionStage::new(2, 8).unwrap();
        let src: Vec<u8> = (0..3).flat_map(|b| [b as u8; 8]).collect();
        let h = |i: u8| BlockHash([i; 32]);
        // SAFETY: blocks 0..3 of 8 bytes each lie in `src`, unchanged during the calls.
        unsafe { stage.capture(src.as_ptr() as u64, &[(0, h(0)), (1, h(1))]) };
        let (to_other, other_rx) = mpsc::channel::<Vec<u32>>();
        let (to_owner, owner_rx) = mpsc::channel::<bool>();
        std::thread::scope(|scope| {
            let (stage, src) = (&stage, &src);
            let other = scope.spawn(move || {
                let (other_id, none) = stage.take(usize::MAX); // the first reader took them all
                assert!(none.is_empty());
                let foreign = other_rx.recv().unwrap();
                let before = stage.stats();
                let released = stage.release(other_id, &foreign).is_ok();
                assert_eq!(stage.stats(), before, "a refused release changes nothing");
                // SAFETY: as above.
                unsafe { stage.capture(src.as_ptr() as u64, &[(2, h(2))]) };
                to_owner.send(released).unwrap();
            });
            let (owner_id, taken) = stage.take(usize::MAX);
            let slots: Vec<u32> = taken.iter().map(|t| t.0).collect();
            to_other.send(slots.clone()).unwrap();
            assert!(!owner_rx.recv().unwrap(), "another reader released the owner's slots");
            other.join().unwrap();
            assert_eq!(stage.stats().dropped, 1, "every slot stayed taken: block 2 dropped");
            let sums = stage.checksums(&slots).unwrap();
            assert_eq!(sums, [0u8, 1].map(|b| crate::pool::crc::crc32c(&[b; 8])), "unchanged");
            stage.release(owner_id, &slots).unwrap();
        });
        assert_eq!(stage.stats().num_taken, 0);
        stage.check_invariants().unwrap();
    }
}
