//! A lock-free stack of free block ids with a reservation counter (design: `free_list.md`).
//!
//! - `head` packs `(tag << 32) | top_id`; every successful CAS bumps the tag, so a head that
//!   was popped and pushed back between a load and a CAS never matches (no ABA).
//! - `next[id]` links the stack; it is written only while `id` is off the stack.
//! - `available` counts ids that are on the stack and not yet reserved. It is raised only
//!   after a push and lowered before a pop, so `available <= stack length` always holds and
//!   a pop after a successful reservation never finds the stack short: `pop_many` is
//!   all-or-nothing without a lock.

use crossbeam_utils::CachePadded;

use crate::sync::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// End-of-stack marker in `head` and `next`.
const NIL: u32 = u32::MAX;

fn pack(tag: u32, id: u32) -> u64 {
    ((tag as u64) << 32) | id as u64
}
fn unpack(head: u64) -> (u32, u32) {
    ((head >> 32) as u32, head as u32)
}

pub struct FreeList {
    head: CachePadded<AtomicU64>,
    available: CachePadded<AtomicUsize>,
    next: Box<[AtomicU32]>,
}

impl FreeList {
    /// A list holding every id in `0..capacity`, lowest id on top (so allocation starts low).
    pub fn new_full(capacity: u32) -> Self {
        Self::new_prefix(capacity, capacity)
    }

    /// A list with room for ids `0..capacity` holding `0..len`, lowest id on top. The ids
    /// `len..capacity` can be pushed later (a growable pool's unmapped blocks).
    pub fn new_prefix(capacity: u32, len: u32) -> Self {
        assert!(capacity < NIL, "capacity {capacity} collides with the NIL marker");
        assert!(len <= capacity, "{len} ids do not fit a list of capacity {capacity}");
        let next = (0..capacity)
            .map(|id| AtomicU32::new(if id + 1 < len { id + 1 } else { NIL }))
            .collect();
        let top = if len == 0 { NIL } else { 0 };
        FreeList {
            head: CachePadded::new(AtomicU64::new(pack(0, top))),
            available: CachePadded::new(AtomicUsize::new(len as usize)),
            next,
        }
    }

    /// Reserves and pops every id that is available now (ids pushed meanwhile stay on the
    /// list). Concurrent reservations fail while the ids are out, so callers that may see
    /// this must retry under the lock that the drainer holds (see `growth.rs`).
    pub fn drain(&self) -> Vec<u32> {
        loop {
            let count = self.available();
            if self.reserve(count).is_ok() {
                let mut ids = vec![0u32; count];
                self.pop_reserved(&mut ids);
                return ids;
            }
        }
    }

    pub fn capacity(&self) -> usize {
        self.next.len()
    }

    /// Ids that can be reserved right now.
    pub fn available(&self) -> usize {
        self.available.load(Ordering::Acquire)
    }

    /// Takes `count` units of `available`, or reports how many there were. Acquire pairs with
    /// the Release in `push_chain`, so the pushed links are visible to the pops that follow.
    pub fn reserve(&self, count: usize) -> Result<(), usize> {
        let mut current = self.available.load(Ordering::Acquire);
        loop {
            if current < count {
                return Err(current);
            }
            match self.available.compare_exchange_weak(
                current,
                current - count,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(seen) => current = seen,
            }
        }
    }

    /// Pops `out.len()` ids into `out`. The caller must hold a reservation of that many
    /// (from [`reserve`](Self::reserve)); then the stack always holds enough and this
    /// only retries on contention.
    pub fn pop_reserved(&self, out: &mut [u32]) {
        if out.is_empty() {
            return;
        }
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let (tag, top) = unpack(head);
            // Walk `out.len()` links from the top. A concurrent pop/push can make the links we
            // read stale; then the tagged head has changed and the CAS below fails.
            let mut id = top;
            let mut complete = true;
            for slot in out.iter_mut() {
                if id == NIL {
                    complete = false;
                    break;
                }
                *slot = id;
                id = self.next[id as usize].load(Ordering::Relaxed);
            }
            if complete {
                match self.head.compare_exchange_weak(
                    head,
                    pack(tag.wrapping_add(1), id),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => return,
                    Err(seen) => head = seen,
                }
            } else {
                // A stale walk ran off the end; the reservation guarantees the real stack is
                // long enough, so reload and walk again.
                #[cfg(loom)]
                loom::thread::yield_now();
                head = self.head.load(Ordering::Acquire);
            }
        }
    }

    /// Pushes `ids` (all currently off the stack, each once) as one chain with one CAS,
    /// then makes them available. `ids[0]` ends on top.
    pub fn push_chain(&self, ids: &[u32]) {
        let (Some(&first), Some(&last)) = (ids.first(), ids.last()) else {
            return;
        };
        // Link the chain privately: nobody reads `next` of an id that is off the stack
        // except a stale walker, whose CAS will fail.
        for pair in ids.windows(2) {
            self.next[pair[0] as usize].store(pair[1], Ordering::Relaxed);
        }
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let (tag, top) = unpack(head);
            self.next[last as usize].store(top, Ordering::Relaxed);
            // Release publishes the links written above to whoever acquires this head.
            match self.head.compare_exchange_weak(
                head,
                pack(tag.wrapping_add(1), first),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(seen) => head = seen,
            }
        }
        self.available.fetch_add(ids.len(), Ordering::AcqRel);
    }

    /// The ids on the stack, top first. Only meaningful while no other thread mutates the
    /// list; returns `Err` with a description if the links are corrupt (a cycle, an id out of
    /// range).
    pub fn snapshot(&self) -> Result<Vec<u32>, String> {
        let (_, mut id) = unpack(self.head.load(Ordering::Acquire));
        let mut ids = Vec::new();
        while id != NIL {
            if id as usize >= self.capacity() {
                return Err(format!("free list holds id {id} >= capacity {}", self.capacity()));
            }
            if ids.len() > self.capacity() {
                return Err("free list has a cycle".into());
            }
            ids.push(id);
            id = self.next[id as usize].load(Ordering::Acquire);
        }
        Ok(ids)
    }
}
