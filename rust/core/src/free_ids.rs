//! `FreeIds`: every free id of an allocator, in per-thread caches in front of one shared
//! lock-free depot (design: `free_list.md`).
//!
//! - A thread allocates from and frees into its own cache slot: one CAS on a line no other
//!   thread writes, and a copy. Nothing shared is touched while its cache can serve.
//! - When the cache runs short, the slow path puts the cache on top of the depot (it is the
//!   top of the same logical LIFO stack) and pops what the call needs plus a refill in one
//!   CAS. When the depot is short too, it moves the other slots' ids onto the depot (steals)
//!   and tries again. A call fails only when a consistent count of depot and caches is short.
//! - A free that does not fit its cache goes to the depot as one chain (one CAS).
//!
//! Ids between two places (taken from a slot, not yet on the depot, or the reverse) are
//! counted in `in_transit`, raised before they leave and lowered after they land; ids the
//! resize path holds off the list are counted in `parked`. Both words carry a version bumped
//! by every change, and a count of the free ids is accepted only if neither word changed
//! while the places were read (see [`FreeIds::stable`]): then an id that stayed free
//! throughout the count was counted, at least once.

use crossbeam_utils::CachePadded;

use crate::error::CoreError;
use crate::free_list::FreeList;
use crate::sync::{AtomicU64, Ordering};
use crate::thread_cache::{current_slot, ThreadCaches, SLOTS};

/// How often a call that would fail only for ids that another call is moving waits for the
/// move to land before it reports the shortage it can see.
#[cfg(not(loom))]
const MAX_WAITS_FOR_MOVES: usize = 64;
/// Under loom a wait is a yield that lets the mover finish; two keep the models small.
#[cfg(loom)]
const MAX_WAITS_FOR_MOVES: usize = 2;

/// Where `take` found its ids: a high-water sample is cheap only after the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Taken {
    FromCache,
    FromDepot,
}

pub(crate) struct FreeIds {
    depot: FreeList,
    caches: ThreadCaches,
    /// `(version << 32) | ids in transit` between the depot and a cache; the version makes
    /// any change visible to a count even if the number comes back to the same value.
    in_transit: CachePadded<AtomicU64>,
    /// `(version << 32) | ids parked`: free ids the resize path holds off the list (drained,
    /// or new ids of a growth not yet pushed). Written only under the pool's resize lock; 0
    /// outside a resize.
    parked: CachePadded<AtomicU64>,
}

/// What [`FreeIds::stable`] read: the caller's result, and the free ids outside every place
/// (moving or parked) while it ran.
pub(crate) struct Stable<R> {
    pub(crate) read: R,
    pub(crate) off_list: usize,
}

impl FreeIds {
    /// Room for ids `0..capacity`, holding `0..len` in the depot, lowest id on top.
    pub(crate) fn new(capacity: u32, len: u32) -> Result<Self, CoreError> {
        Ok(FreeIds {
            depot: FreeList::new_prefix(capacity, len)?,
            caches: ThreadCaches::new(capacity as usize),
            in_transit: CachePadded::new(AtomicU64::new(0)),
            parked: CachePadded::new(AtomicU64::new(0)),
        })
    }

    /// Free ids now: depot, caches, ids in transit and parked ids (a snapshot under
    /// concurrency, see [`stable`](Self::stable)).
    pub(crate) fn available(&self) -> usize {
        let count = self.stable(|| self.in_places());
        count.read + count.off_list
    }

    /// Ids in the depot and the caches, read one place at a time: exact only inside
    /// [`stable`](Self::stable) (a move between two reads could hide its ids from both).
    pub(crate) fn in_places(&self) -> usize {
        self.caches.total() + self.depot.available()
    }

    /// Ids in the depot and the calling thread's cache if no other cache can hold any (then
    /// that is every id in a place, with no slot scan); `None` when other caches may hold ids.
    /// Exact only inside [`stable`](Self::stable).
    pub(crate) fn in_places_if_alone(&self) -> Option<usize> {
        let slot = current_slot();
        let mine = slot.map_or(0, |s| 1u64 << s);
        let depot = self.depot.available();
        let cached = slot.map_or(0, |s| self.caches.len(s));
        (self.caches.occupied() & !mine == 0).then_some(depot + cached)
    }

    /// Runs `read` (which counts ids in places) until neither `parked` nor `in_transit`
    /// changed around it, and returns its result with the ids those two words counted.
    ///
    /// Why this is a sound count: a move raises `in_transit` before its ids leave one place
    /// and lowers it after they land in the other, and the resize path parks ids before they
    /// leave the depot and unparks them after they are back. If a read of the places missed
    /// ids (saw the place they left after they left, and the place they went to before they
    /// landed), it acquired the CAS that took them, which comes after the raise in the
    /// mover's program order, so the second load of the word sees the raise or a later value:
    /// a changed word, and `read` runs again. If both loads show the same word, any move or
    /// park under way is counted in it. So an id free throughout the count is counted (a move
    /// under way may count one twice: a count errs high, never low). Retries only when another
    /// call moved or parked ids meanwhile (lock-free).
    pub(crate) fn stable<R>(&self, mut read: impl FnMut() -> R) -> Stable<R> {
        loop {
            let parked = self.parked.load(Ordering::Acquire);
            let transit = self.in_transit.load(Ordering::Acquire);
            let result = read();
            if self.in_transit.load(Ordering::Acquire) == transit && self.parked.load(Ordering::Acquire) == parked {
                return Stable { read: result, off_list: head_count(transit) + head_count(parked) };
            }
        }
    }

    fn moving(&self) -> usize {
        head_count(self.in_transit.load(Ordering::Acquire))
    }

    fn add_in_transit(&self, n: usize) {
        if n > 0 {
            self.in_transit.fetch_add((1 << 32) + n as u64, Ordering::AcqRel);
        }
    }

    fn remove_in_transit(&self, n: usize) {
        if n > 0 {
            self.in_transit.fetch_add((1u64 << 32).wrapping_sub(n as u64), Ordering::AcqRel);
        }
    }

    /// Counts `n` more ids as parked (the resize path, under its lock; before they leave the
    /// depot, or before new ids come into existence).
    pub(crate) fn park(&self, n: usize) {
        self.parked.fetch_add((1 << 32) + n as u64, Ordering::AcqRel);
    }

    fn unpark(&self, n: usize) {
        self.parked.fetch_add((1u64 << 32).wrapping_sub(n as u64), Ordering::AcqRel);
    }

    /// Ids parked now (the resize path's own count).
    fn num_parked(&self) -> usize {
        head_count(self.parked.load(Ordering::Acquire))
    }

    /// Fills `out` with free ids, or takes none and returns how many were free.
    pub(crate) fn take(&self, out: &mut [u32]) -> Result<Taken, usize> {
        if out.is_empty() {
            return Ok(Taken::FromCache);
        }
        let slot = current_slot();
        if let Some(s) = slot {
            if self.caches.take(s, out) {
                self.caches.mark_if_empty(s);
                return Ok(Taken::FromCache);
            }
        }
        self.take_slow(slot, out).map(|()| Taken::FromDepot)
    }

    fn take_slow(&self, slot: Option<usize>, out: &mut [u32]) -> Result<(), usize> {
        let n = out.len();
        let refill = if slot.is_some() { self.caches.capacity() / 2 } else { 0 };
        let mut popped = vec![0u32; n + refill];
        let mut waits = 0;
        loop {
            if let Some(s) = slot {
                self.move_to_depot(s);
            }
            if self.pop_with_refill(slot, &mut popped, n, refill) {
                out.copy_from_slice(&popped[..n]);
                if let Some(s) = slot {
                    self.caches.mark_if_empty(s);
                }
                return Ok(());
            }
            let mut stole = false;
            for other in (0..SLOTS).filter(|&other| Some(other) != slot) {
                stole |= self.move_to_depot(other);
            }
            if stole {
                continue;
            }
            let (settled, moving) = self.consistent_count();
            if settled + moving < n || settled < n && waits == MAX_WAITS_FOR_MOVES {
                if let Some(s) = slot {
                    self.caches.mark_if_empty(s);
                }
                return Err(if settled + moving < n { settled + moving } else { settled });
            }
            if settled < n {
                // Enough ids exist only counting those another call is moving: let it land
                // them (a few instructions unless that thread is descheduled mid-move).
                waits += 1;
                yield_now();
            }
        }
    }

    /// Pops `n` ids plus up to `refill` more in one CAS; the extra ids go into the caller's
    /// (empty) cache. False, having taken nothing, if the depot holds fewer than `n`.
    fn pop_with_refill(&self, slot: Option<usize>, popped: &mut [u32], n: usize, refill: usize) -> bool {
        // Counted before they leave the depot: the extra ids are in our hands until pushed.
        self.add_in_transit(refill);
        let result = self.depot.pop_up_to(popped, n);
        if let (Ok(k), Some(s)) = (result, slot) {
            let extra = &popped[n..k];
            let fits = self.caches.push(s, extra);
            if !fits {
                // Only we add to our slot and we emptied it, so this is unreachable; stay
                // correct anyway.
                self.depot.push_chain(extra);
            }
        }
        self.remove_in_transit(refill);
        result.is_ok()
    }

    /// Moves the ids of `slot` onto the depot, top staying on top; false if there were none.
    fn move_to_depot(&self, slot: usize) -> bool {
        let count = self.caches.len(slot);
        if count == 0 {
            return false;
        }
        self.add_in_transit(count);
        let mut ids: Vec<u32> = Vec::new();
        let moved = self.caches.take_up_to(slot, count, &mut ids);
        self.depot.push_chain(&ids);
        self.remove_in_transit(count);
        moved > 0
    }

    /// `(free ids in depot and caches, ids in transit)` at one instant: every head word is
    /// loaded, then confirmed with a CAS that writes it back unchanged. Every word carries a
    /// tag or version bumped by each change, so a confirmed word held its loaded value from
    /// before the last load until its CAS, and all of them together held between the last
    /// load and the first CAS. (The CAS also rules out a stale load.) Retries only when
    /// another call changed something.
    fn consistent_count(&self) -> (usize, usize) {
        loop {
            let transit = self.in_transit.load(Ordering::Acquire);
            let (depot_head, mut settled) = self.depot.head_and_len();
            let mut slot_heads = [0u64; SLOTS];
            for (slot, head) in slot_heads.iter_mut().enumerate() {
                *head = self.caches.head(slot);
                settled += head_count(*head);
            }
            let confirmed = confirm(&self.in_transit, transit)
                && self.depot.confirm_head(depot_head)
                && slot_heads.iter().enumerate().all(|(slot, &head)| self.caches.confirm_head(slot, head));
            if confirmed {
                return (settled, head_count(transit));
            }
        }
    }

    /// Returns `ids` (off every list, each once) to the free ids, `ids[0]` first out next.
    pub(crate) fn put(&self, ids: &[u32]) {
        if ids.is_empty() {
            return;
        }
        match current_slot() {
            Some(s) if self.caches.push(s, ids) => {}
            _ => self.depot.push_chain(ids),
        }
    }

    /// Pushes `ids` (every parked id that still exists) onto the depot, `ids[0]` on top, then
    /// unparks every parked id: those pushed, and those dropped because a shrink removed
    /// them. The resize path only, under its lock.
    pub(crate) fn unpark_into_depot(&self, ids: &[u32]) {
        // Pushed before they are unparked: counted twice for an instant, never missed.
        self.depot.push_chain(ids);
        self.unpark(self.num_parked());
    }

    /// Moves every cache onto the depot, then takes as many ids as the depot holds at one
    /// moment, parking them before they leave. Ids freed meanwhile may stay behind (in a
    /// cache or under newer ids): callers treat ids they did not get as live. The resize path
    /// only, under its lock; [`unpark_into_depot`](Self::unpark_into_depot) ends the park.
    pub(crate) fn drain(&self) -> Vec<u32> {
        for slot in 0..SLOTS {
            self.move_to_depot(slot);
        }
        loop {
            let n = self.depot.available();
            self.park(n);
            let mut ids = vec![0u32; n];
            if self.depot.pop_many(&mut ids).is_ok() {
                return ids;
            }
            // Someone allocated meanwhile: fewer ids are there now. Try again.
            self.unpark(n);
        }
    }

    /// Every free id (depot top first, then each cache top first). Only meaningful while no
    /// other thread touches the allocator.
    pub(crate) fn snapshot(&self) -> Result<Vec<u32>, String> {
        let moving = self.moving();
        if moving != 0 {
            return Err(format!("{moving} ids are in transit outside any call"));
        }
        let parked = self.num_parked();
        if parked != 0 {
            return Err(format!("{parked} ids are parked outside a resize"));
        }
        let mut ids = self.depot.snapshot()?;
        ids.extend(self.caches.snapshot()?);
        Ok(ids)
    }
}

/// The count in a `(tag << 32) | count` word.
fn head_count(word: u64) -> usize {
    word as u32 as usize
}

/// A CAS that writes `word` back: true iff `atomic` still holds it (and holds nothing newer).
fn confirm(atomic: &AtomicU64, word: u64) -> bool {
    atomic.compare_exchange(word, word, Ordering::AcqRel, Ordering::Acquire).is_ok()
}

#[cfg(not(loom))]
fn yield_now() {
    std::thread::yield_now();
}
#[cfg(loom)]
fn yield_now() {
    loom::thread::yield_now();
}
