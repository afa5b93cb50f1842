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
//! Ids between two places (taken from a slot, not yet on the depot, or the reverse) and ids
//! the resize path holds off the list (parked) are counted in one word, `off_list`, raised
//! before they leave a place and lowered after they land. The word carries a version bumped
//! by every change, and a count of the free ids is accepted only if it did not change while
//! the places were read (see [`FreeIds::stable`]): then an id that stayed free throughout the
//! count was counted, at least once.

use crossbeam_utils::CachePadded;

use crate::error::CoreError;
use crate::free_list::FreeList;
use crate::sync::{AtomicU64, AtomicUsize, Ordering};
use crate::thread_cache::{current_slot, ThreadCaches, SLOTS};

/// What `take` did, for the high-water sample that follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Taken {
    /// The ids came from the caller's cache alone (nothing shared was touched).
    pub(crate) from_cache: bool,
    /// Ids the call left in the caller's cache. Only the owner adds to its cache, so until it
    /// adds again this is at least what the cache holds (others may take some meanwhile).
    pub(crate) cached: usize,
}

pub(crate) struct FreeIds {
    depot: FreeList,
    caches: ThreadCaches,
    /// `(version << 32) | free ids outside every place`: ids in transit between the depot
    /// and a cache, plus ids parked by the resize path (drained, or new ids of a growth not
    /// yet pushed). The version makes any change visible to a count even if the number comes
    /// back to the same value. One word, so a validated count loads one line twice.
    off_list: CachePadded<AtomicU64>,
    /// The parked ids among `off_list`: the resize path's own tally, written and read only
    /// under the pool's resize lock (and by the quiescent [`snapshot`](Self::snapshot)).
    parked: AtomicUsize,
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
            off_list: CachePadded::new(AtomicU64::new(0)),
            parked: AtomicUsize::new(0),
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

    /// Ids in the depot plus `cached` (the calling thread's cache, as [`Taken::cached`] bounds
    /// it) if no other cache can hold any: then that is every id in a place, counted high
    /// rather than low, with no slot scan. `None`, having read only the occupied mask, when
    /// other caches may hold ids. Exact only inside [`stable`](Self::stable).
    pub(crate) fn in_places_if_alone(&self, cached: usize) -> Option<usize> {
        let mine = current_slot().map_or(0, |s| 1u64 << s);
        (self.caches.occupied() & !mine == 0).then(|| self.depot.available() + cached)
    }

    /// Runs `read` (which counts ids in places) until `off_list` did not change around it,
    /// and returns its result with the ids that word counted.
    ///
    /// Why this is a sound count: a move raises `off_list` before its ids leave one place and
    /// lowers it after they land in the other, and the resize path parks ids (raises it)
    /// before they leave the depot and unparks them after they are back. If a read of the
    /// places missed ids (saw the place they left after they left, and the place they went to
    /// before they landed), it acquired the CAS that took them, which comes after the raise
    /// in the mover's program order, so the second load of the word sees the raise or a later
    /// value: a changed word, and `read` runs again. If both loads show the same word, any
    /// move or park under way is counted in it. So an id free throughout the count is counted
    /// (a move under way may count one twice: a count errs high, never low). Retries only when
    /// another call moved or parked ids meanwhile (lock-free). Acquire would do for all this;
    /// the word's loads and changes are SeqCst so that a load returns its latest change (same
    /// instructions as Acquire on x86-64), which also gives the loom models one value per load
    /// instead of every stale one (`free_list.md`, loom section).
    pub(crate) fn stable<R>(&self, mut read: impl FnMut() -> R) -> Stable<R> {
        loop {
            let before = self.off_list.load(Ordering::SeqCst);
            let result = read();
            if self.off_list.load(Ordering::SeqCst) == before {
                return Stable { read: result, off_list: head_count(before) };
            }
        }
    }

    /// Counts `n` more ids as outside every place (before they leave one); bumps the version.
    fn announce(&self, n: usize) {
        if n > 0 {
            self.off_list.fetch_add((1 << 32) + n as u64, Ordering::SeqCst);
        }
    }

    /// Counts `n` ids back in a place (after they landed); bumps the version.
    fn land(&self, n: usize) {
        if n > 0 {
            self.off_list.fetch_add((1u64 << 32).wrapping_sub(n as u64), Ordering::SeqCst);
        }
    }

    /// Counts `n` more ids as parked (the resize path, under its lock; before they leave the
    /// depot, or before new ids come into existence).
    pub(crate) fn park(&self, n: usize) {
        self.parked.fetch_add(n, Ordering::Relaxed);
        self.announce(n);
    }

    fn unpark(&self, n: usize) {
        self.parked.fetch_sub(n, Ordering::Relaxed);
        self.land(n);
    }

    /// Fills `out` with free ids, or takes none and returns how many were free.
    pub(crate) fn take(&self, out: &mut [u32]) -> Result<Taken, usize> {
        let slot = current_slot();
        if out.is_empty() {
            return Ok(Taken { from_cache: true, cached: slot.map_or(0, |s| self.caches.len(s)) });
        }
        if let Some(s) = slot {
            if let Some(left) = self.caches.take(s, out) {
                if left == 0 {
                    self.caches.mark_empty(s);
                }
                return Ok(Taken { from_cache: true, cached: left });
            }
        }
        self.take_slow(slot, out).map(|cached| Taken { from_cache: false, cached })
    }

    /// Returns how many ids it left in the caller's cache.
    ///
    /// Refuses only when a consistent count is short: then fewer than `n` ids were free at one
    /// instant (the count errs high, never low). When enough ids exist only counting those
    /// another call is moving or a resize holds parked, it yields until they land and tries
    /// again; it never refuses for ids in someone else's hands.
    fn take_slow(&self, slot: Option<usize>, out: &mut [u32]) -> Result<usize, usize> {
        let n = out.len();
        // A refill on the first pass only. Once the depot has fallen short the pool is nearly
        // empty: hoarding then would starve other callers, and a refill announced (counted
        // off the list, see `pop_with_refill`) that the depot cannot supply is ids that do not
        // exist, which would keep a caller near a refusal waiting for them to land.
        let mut refill = if slot.is_some() { self.caches.capacity() / 2 } else { 0 };
        let mut popped = vec![0u32; n + refill];
        let mut waits = 0;
        loop {
            if let Some(s) = slot {
                self.move_to_depot(s);
            }
            if let Some(cached) = self.pop_with_refill(slot, &mut popped[..n + refill], n, refill) {
                out.copy_from_slice(&popped[..n]);
                if let (Some(s), 0) = (slot, cached) {
                    self.caches.mark_empty(s);
                }
                return Ok(cached);
            }
            refill = 0;
            let mut stole = false;
            for other in (0..SLOTS).filter(|&other| Some(other) != slot) {
                stole |= self.move_to_depot(other);
            }
            if stole {
                continue;
            }
            let (settled, off_list) = self.consistent_count();
            if settled + off_list < n {
                if let Some(s) = slot {
                    self.caches.mark_if_empty(s);
                }
                return Err(settled + off_list);
            }
            if settled < n {
                // Enough ids exist only counting those off the list: a move lands them within
                // a few of the mover's own steps, and the resize path holds parked ids only
                // while it sorts and pushes them back, taking none itself. Waiting takes long
                // only while that thread is descheduled; refusing instead would claim fewer
                // free ids than there are (`free_list.md`, "Progress").
                wait_for_moves(waits);
                waits += 1;
            }
        }
    }

    /// Pops `n` ids plus up to `refill` more in one CAS; the extra ids go into the caller's
    /// (empty) cache. Returns how many went there, or `None`, having taken nothing, if the
    /// depot holds fewer than `n`.
    fn pop_with_refill(
        &self,
        slot: Option<usize>,
        popped: &mut [u32],
        n: usize,
        refill: usize,
    ) -> Option<usize> {
        // Counted before they leave the depot: the extra ids are in our hands until pushed.
        self.announce(refill);
        let result = self.depot.pop_up_to(popped, n);
        let mut cached = 0;
        if let (Ok(k), Some(s)) = (result, slot) {
            let extra = &popped[n..k];
            if self.caches.push(s, extra) {
                cached = extra.len();
            } else {
                // Only we add to our slot and we emptied it, so this is unreachable; stay
                // correct anyway.
                self.depot.push_chain(extra);
            }
        }
        self.land(refill);
        result.ok().map(|_| cached)
    }

    /// Moves the ids of `slot` onto the depot, top staying on top; false if there were none.
    fn move_to_depot(&self, slot: usize) -> bool {
        let count = self.caches.len(slot);
        if count == 0 {
            return false;
        }
        self.announce(count);
        let mut ids: Vec<u32> = Vec::new();
        let moved = self.caches.take_up_to(slot, count, &mut ids);
        self.depot.push_chain(&ids);
        self.land(count);
        moved > 0
    }

    /// `(free ids in depot and caches, ids off the list)` at one instant: every head word is
    /// loaded, then confirmed with a CAS that writes it back unchanged. Every word carries a
    /// tag or version bumped by each change, so a confirmed word held its loaded value from
    /// before the last load until its CAS, and all of them together held between the last
    /// load and the first CAS. (The CAS also rules out a stale load.) Retries only when
    /// another call changed something.
    fn consistent_count(&self) -> (usize, usize) {
        loop {
            let off_list = self.off_list.load(Ordering::SeqCst);
            let (depot_head, mut settled) = self.depot.head_and_len();
            let mut slot_heads = [0u64; SLOTS];
            for (slot, head) in slot_heads.iter_mut().enumerate() {
                *head = self.caches.head(slot);
                settled += head_count(*head);
            }
            // Every word is confirmed even after one failed: a CAS reads the latest value, so
            // the next pass loads nothing older than what this one confirmed against.
            let mut confirmed = confirm(&self.off_list, off_list);
            confirmed &= self.depot.confirm_head(depot_head);
            for (slot, &head) in slot_heads.iter().enumerate() {
                confirmed &= self.caches.confirm_head(slot, head);
            }
            if confirmed {
                return (settled, head_count(off_list));
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
        self.unpark(self.parked.load(Ordering::Relaxed));
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
        let parked = self.parked.load(Ordering::Acquire);
        if parked != 0 {
            return Err(format!("{parked} ids are parked outside a resize"));
        }
        let off_list = head_count(self.off_list.load(Ordering::Acquire));
        if off_list != 0 {
            return Err(format!("{off_list} ids are in transit outside any call"));
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
    atomic.compare_exchange(word, word, Ordering::SeqCst, Ordering::SeqCst).is_ok()
}

/// One wait for ids off the list to land (the `waits`-th of this call).
#[cfg(not(loom))]
fn wait_for_moves(_waits: usize) {
    std::thread::yield_now();
}

/// Under loom: a yield, and after the first two of a call, no more alternatives explored in
/// this execution. With two callers waiting on a third thread's move, loom's scheduler may
/// switch between the two waiters forever without running the mover (tokio-rs/loom#53: a
/// yield makes every switch free), so the model never ends. The rest of the execution runs on
/// loom's default schedule, which runs the thread that yielded least, the mover.
#[cfg(loom)]
fn wait_for_moves(waits: usize) {
    loom::thread::yield_now();
    if waits >= 1 {
        loom::skip_branch();
    }
}
