//! Per-thread caches of free ids in front of the shared depot (design: `free_list.md`).
//!
//! Every allocator has [`SLOTS`] cache slots. A thread that touches any allocator leases a
//! process-wide slot number (the lowest one free) for as long as it lives; it is then the
//! only thread that *adds* ids to that slot, in every allocator. Any thread may *take* ids
//! from any slot (a steal on shortage, a drain before a resize): ids in a cache are free ids
//! that the whole pool can reach, never ids stranded in one thread. A thread that exits gives
//! its number back; its cached ids stay where they are, still free and reachable, and the
//! next thread to lease the number inherits them. Threads past [`SLOTS`] run uncached.
//!
//! A slot is `head = (tag << 32) | count` plus an array of `capacity` ids, `ids[count - 1]`
//! on top. The owner writes ids only at positions `>= count` (invisible to takers) and then
//! publishes them with a CAS on `head`; a taker reads `ids[count - k..count]` and CASes
//! `count` down. Every CAS bumps the tag, so a taker whose read raced with any other change
//! fails its CAS and reads again (the same argument as the depot's tagged head).

use crossbeam_utils::CachePadded;

use crate::sync::{AtomicU32, AtomicU64, Ordering};

/// Cache slots per allocator (and slot numbers a process leases out).
#[cfg(not(loom))]
pub(crate) const SLOTS: usize = 64;
/// Two slots under loom: the third thread of a model runs uncached, so both paths are checked.
#[cfg(loom)]
pub(crate) const SLOTS: usize = 2;

/// Most ids one slot caches. 512 holds two round trips of 256 blocks, so batches of up to
/// 256 blocks that a thread frees and allocates again never leave its cache.
#[cfg(not(loom))]
const MAX_CACHED: usize = 512;
#[cfg(loom)]
const MAX_CACHED: usize = 2;

/// Ids per cache line: slots are padded to whole lines so two slots never share one.
const IDS_PER_LINE: usize = 16;

fn pack(tag: u32, count: u32) -> u64 {
    ((tag as u64) << 32) | count as u64
}
fn count_of(head: u64) -> usize {
    head as u32 as usize
}
fn tag_of(head: u64) -> u32 {
    (head >> 32) as u32
}

/// The slot number the calling thread leased, or `None` if every number is taken (or the
/// thread is being torn down). Cheap: one thread-local read after the first call.
pub(crate) fn current_slot() -> Option<usize> {
    LEASE.try_with(|lease| lease.0).ok().flatten()
}

/// A leased slot number, returned to the registry when the thread exits.
struct Lease(Option<usize>);

impl Lease {
    fn claim() -> Lease {
        let all = if SLOTS == 64 { u64::MAX } else { (1u64 << SLOTS) - 1 };
        let mut leased = LEASED.load(Ordering::Acquire);
        loop {
            let free = all & !leased;
            if free == 0 {
                return Lease(None);
            }
            let slot = free.trailing_zeros();
            // AcqRel: the previous holder's writes to its slots (released when it gave the
            // number back) happen before ours.
            match LEASED.compare_exchange_weak(
                leased,
                leased | 1 << slot,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Lease(Some(slot as usize)),
                Err(seen) => leased = seen,
            }
        }
    }
}

/// Under loom every model execution starts afresh and the registry (a loom static) is gone
/// before the main thread's locals are dropped, so numbers are not given back there.
#[cfg(not(loom))]
impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(slot) = self.0 {
            LEASED.fetch_and(!(1u64 << slot), Ordering::AcqRel);
        }
    }
}

#[cfg(not(loom))]
static LEASED: AtomicU64 = AtomicU64::new(0);
#[cfg(loom)]
loom::lazy_static! {
    static ref LEASED: AtomicU64 = AtomicU64::new(0);
}

#[cfg(not(loom))]
std::thread_local! {
    static LEASE: Lease = Lease::claim();
}
#[cfg(loom)]
loom::thread_local! {
    static LEASE: Lease = Lease::claim();
}

pub(crate) struct ThreadCaches {
    heads: Box<[CachePadded<AtomicU64>]>,
    /// Slot `s` owns `ids[s * stride..s * stride + capacity]`.
    ids: Box<[AtomicU32]>,
    capacity: usize,
    stride: usize,
    /// Bit `s` is set while slot `s` may hold ids: its owner sets it before adding and clears
    /// it only after its own take left the slot empty (takers never clear it). So a clear bit
    /// means an empty slot; readers use it to skip idle slots.
    occupied: CachePadded<AtomicU64>,
}

impl ThreadCaches {
    /// Caches for an allocator of `max_ids` ids: each slot holds up to `min(512, max_ids)`.
    pub(crate) fn new(max_ids: usize) -> Self {
        let capacity = MAX_CACHED.min(max_ids);
        let stride = capacity.div_ceil(IDS_PER_LINE) * IDS_PER_LINE;
        ThreadCaches {
            heads: (0..SLOTS).map(|_| CachePadded::new(AtomicU64::new(0))).collect(),
            ids: (0..SLOTS * stride).map(|_| AtomicU32::new(0)).collect(),
            capacity,
            stride,
            occupied: CachePadded::new(AtomicU64::new(0)),
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    fn id(&self, slot: usize, index: usize) -> &AtomicU32 {
        &self.ids[slot * self.stride + index]
    }

    /// `(tag << 32) | count` of a slot, for the consistent count.
    pub(crate) fn head(&self, slot: usize) -> u64 {
        self.heads[slot].load(Ordering::Acquire)
    }

    /// True iff slot `slot` still holds `word` (a CAS writing it back; the tag makes a match
    /// mean nothing was added or taken in between).
    pub(crate) fn confirm_head(&self, slot: usize, word: u64) -> bool {
        self.heads[slot].compare_exchange(word, word, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    pub(crate) fn len(&self, slot: usize) -> usize {
        count_of(self.head(slot))
    }

    /// Slots that may hold ids (bit per slot).
    pub(crate) fn occupied(&self) -> u64 {
        self.occupied.load(Ordering::Acquire)
    }

    /// Ids in every slot now (a snapshot under concurrency).
    pub(crate) fn total(&self) -> usize {
        let mut bits = self.occupied();
        let mut total = 0;
        while bits != 0 {
            total += self.len(bits.trailing_zeros() as usize);
            bits &= bits - 1;
        }
        total
    }

    /// Takes `out.len()` ids from the top of `slot` (top first) and returns how many it left
    /// there, or, if it holds fewer, takes none. Any thread.
    pub(crate) fn take(&self, slot: usize, out: &mut [u32]) -> Option<usize> {
        let mut head = self.heads[slot].load(Ordering::Acquire);
        loop {
            let count = count_of(head);
            if count < out.len() {
                return None;
            }
            for (k, id) in out.iter_mut().enumerate() {
                *id = self.id(slot, count - 1 - k).load(Ordering::Relaxed);
            }
            // Success proves `head` did not move since the load, so the ids read are the
            // ones below `count` (an owner rewrites a position only after a CAS moved the
            // count below it). AcqRel: Release orders our reads before the owner's reuse
            // of those positions.
            let new = pack(tag_of(head).wrapping_add(1), (count - out.len()) as u32);
            match self.heads[slot].compare_exchange_weak(
                head,
                new,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(count - out.len()),
                Err(seen) => head = seen,
            }
        }
    }

    /// Takes up to `max` ids from the top of `slot` into `out` (cleared first, top first);
    /// returns how many. Any thread.
    pub(crate) fn take_up_to(&self, slot: usize, max: usize, out: &mut Vec<u32>) -> usize {
        let mut head = self.heads[slot].load(Ordering::Acquire);
        loop {
            let count = count_of(head);
            let k = count.min(max);
            out.clear();
            out.extend((0..k).map(|i| self.id(slot, count - 1 - i).load(Ordering::Relaxed)));
            let new = pack(tag_of(head).wrapping_add(1), (count - k) as u32);
            match self.heads[slot].compare_exchange_weak(
                head,
                new,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return k,
                Err(seen) => head = seen,
            }
        }
    }

    /// Adds `ids` to `slot` with `ids[0]` on top, or returns false (nothing added) if they do
    /// not fit. Only the thread that leased `slot` may call it.
    pub(crate) fn push(&self, slot: usize, ids: &[u32]) -> bool {
        let mut head = self.heads[slot].load(Ordering::Acquire);
        if count_of(head) + ids.len() > self.capacity {
            return false;
        }
        let bit = 1u64 << slot;
        if self.occupied() & bit == 0 {
            // Before the ids appear, so a reader that skips clear bits misses nothing.
            self.occupied.fetch_or(bit, Ordering::AcqRel);
        }
        loop {
            // Takers only lower the count, so the ids still fit after a failed CAS.
            let count = count_of(head);
            for (k, &id) in ids.iter().enumerate() {
                self.id(slot, count + ids.len() - 1 - k).store(id, Ordering::Relaxed);
            }
            // Release publishes the ids written above to whoever acquires this head.
            let new = pack(tag_of(head).wrapping_add(1), (count + ids.len()) as u32);
            match self.heads[slot].compare_exchange_weak(
                head,
                new,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(seen) => head = seen,
            }
        }
    }

    /// Clears `slot`'s occupied bit if it is empty. Only the owner may call it: nobody else
    /// adds to the slot, so it cannot refill between the check and the clear.
    pub(crate) fn mark_if_empty(&self, slot: usize) {
        if self.len(slot) == 0 {
            self.mark_empty(slot);
        }
    }

    /// Clears `slot`'s occupied bit. Only the owner, right after its own take or move left
    /// the slot empty: nobody else adds to it, so it is still empty.
    pub(crate) fn mark_empty(&self, slot: usize) {
        self.occupied.fetch_and(!(1u64 << slot), Ordering::AcqRel);
    }

    /// The ids of every slot, top first per slot. Only meaningful while no other thread
    /// touches the caches.
    pub(crate) fn snapshot(&self) -> Result<Vec<u32>, String> {
        let mut all = Vec::new();
        for slot in 0..SLOTS {
            let count = self.len(slot);
            if count > self.capacity {
                return Err(format!(
                    "cache slot {slot} holds {count} ids, more than its capacity {}",
                    self.capacity
                ));
            }
            if count > 0 && self.occupied() & (1 << slot) == 0 {
                return Err(format!("cache slot {slot} holds {count} ids but is marked empty"));
            }
            all.extend((0..count).rev().map(|i| self.id(slot, i).load(Ordering::Acquire)));
        }
        Ok(all)
    }
}
