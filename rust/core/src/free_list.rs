//! A lock-free stack of free block ids that knows its own length (design: `free_list.md`).
//!
//! - `head` packs `(tag << 32) | top_id`; every successful CAS bumps the tag, so a head that
//!   was popped and pushed back between a load and a CAS never matches (no ABA).
//! - `next[id]` links the stack; `depth[id]` is the number of ids from `id` to the bottom.
//!   Both are written only while `id` is off the stack, and published by the push's CAS.
//! - The length is `depth[top]`, so one CAS on `head` is the whole of a pop or a push: a
//!   batch pop walks `n` links and swings `head` past them, or, when `depth[top] < n`,
//!   fails having changed nothing (all-or-nothing without a lock or a second counter).
//! - `next` and `depth` are stored relative to the list as it was created (XOR with the fresh
//!   value), so a new list is all zeroes: nothing is written at creation, and the arrays take
//!   memory only for the ids that are pushed (see `zeroed.rs`).

use crossbeam_utils::CachePadded;

use crate::error::CoreError;
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::zeroed::zeroed_atomic_u32s;

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
    /// `next[id] ^ fresh_next(id)` (see [`next_of`](Self::next_of)).
    next: Box<[AtomicU32]>,
    /// `depth[id] ^ fresh_depth(id)` (see [`depth_of`](Self::depth_of)).
    depth: Box<[AtomicU32]>,
    /// The list was created holding `0..fresh_len`, linked in order.
    fresh_len: u32,
}

impl FreeList {
    /// A list holding every id in `0..capacity`, lowest id on top (so allocation starts low).
    pub fn new_full(capacity: u32) -> Result<Self, CoreError> {
        Self::new_prefix(capacity, capacity)
    }

    /// A list with room for ids `0..capacity` holding `0..len`, lowest id on top. The ids
    /// `len..capacity` can be pushed later (a growable pool's unmapped blocks). Writes
    /// nothing per id; `OutOfMemory` if the arrays cannot be reserved.
    pub fn new_prefix(capacity: u32, len: u32) -> Result<Self, CoreError> {
        assert!(capacity < NIL, "capacity {capacity} collides with the NIL marker");
        assert!(len <= capacity, "{len} ids do not fit a list of capacity {capacity}");
        let next = zeroed_atomic_u32s(capacity as usize)?;
        let depth = zeroed_atomic_u32s(capacity as usize)?;
        let top = if len == 0 { NIL } else { 0 };
        Ok(FreeList {
            head: CachePadded::new(AtomicU64::new(pack(0, top))),
            next,
            depth,
            fresh_len: len,
        })
    }

    pub fn capacity(&self) -> usize {
        self.next.len()
    }

    /// `next[id]` as created: the fresh list links `0..fresh_len` in order.
    fn fresh_next(&self, id: u32) -> u32 {
        if id + 1 < self.fresh_len {
            id + 1
        } else {
            NIL
        }
    }

    /// The id below `id` on the stack (meaningful while `id` is on it).
    fn next_of(&self, id: u32, order: Ordering) -> u32 {
        self.next[id as usize].load(order) ^ self.fresh_next(id)
    }

    fn set_next(&self, id: u32, next: u32) {
        self.next[id as usize].store(next ^ self.fresh_next(id), Ordering::Relaxed);
    }

    /// Ids from `id` to the bottom, `id` included (meaningful while `id` is on the stack).
    fn depth_of(&self, id: u32, order: Ordering) -> u32 {
        self.depth[id as usize].load(order) ^ self.fresh_len.saturating_sub(id)
    }

    fn set_depth(&self, id: u32, depth: u32) {
        self.depth[id as usize].store(depth ^ self.fresh_len.saturating_sub(id), Ordering::Relaxed);
    }

    /// Ids on the list in the stack under `top` (read after an Acquire load of `head`).
    fn len_under(&self, top: u32) -> usize {
        if top == NIL {
            0
        } else {
            self.depth_of(top, Ordering::Relaxed) as usize
        }
    }

    /// Ids on the list now (a snapshot under concurrency).
    pub fn available(&self) -> usize {
        let (_, top) = unpack(self.head.load(Ordering::Acquire));
        self.len_under(top)
    }

    /// Pops `out.len()` ids into `out`, or none; on failure returns how many were free.
    pub fn pop_many(&self, out: &mut [u32]) -> Result<(), usize> {
        self.pop_up_to(out, out.len()).map(|_| ())
    }

    /// Pops as many ids as the list holds, up to `out.len()` and at least `min`, into the
    /// front of `out`; returns how many. If fewer than `min` are free it pops none and
    /// returns how many were free.
    pub fn pop_up_to(&self, out: &mut [u32], min: usize) -> Result<usize, usize> {
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let (tag, top) = unpack(head);
            let free = self.len_under(top);
            if free < min {
                // Confirm with a CAS that writes the same head back: if it succeeds, the list
                // held `free` ids at that instant (this failure's linearisation point), since
                // `depth[top]` cannot change while `top` stays on the stack.
                match self.head.compare_exchange(head, head, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Err(free),
                    Err(seen) => {
                        head = seen;
                        continue;
                    }
                }
            }
            // Walk `n` links from the top. A concurrent pop/push can make the links we read
            // stale; then the tagged head has changed and the CAS below fails.
            let n = free.min(out.len());
            if n == 0 {
                return Ok(0);
            }
            let mut id = top;
            let mut complete = true;
            for slot in out[..n].iter_mut() {
                if id == NIL {
                    complete = false;
                    break;
                }
                *slot = id;
                id = self.next_of(id, Ordering::Relaxed);
            }
            if !complete {
                #[cfg(loom)]
                loom::thread::yield_now();
                head = self.head.load(Ordering::Acquire);
                continue;
            }
            match self.head.compare_exchange_weak(
                head,
                pack(tag.wrapping_add(1), id),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(n),
                Err(seen) => head = seen,
            }
        }
    }

    /// The head word, `(tag << 32) | top`, and the length under it, for the allocator's
    /// consistent count; [`confirm_head`](Self::confirm_head) checks the word later.
    pub fn head_and_len(&self) -> (u64, usize) {
        let head = self.head.load(Ordering::Acquire);
        (head, self.len_under(unpack(head).1))
    }

    /// True iff `head` still holds `word`: a CAS that writes it back (so it cannot be fooled
    /// by a stale load). Tags make a match mean that no pop or push came in between.
    pub fn confirm_head(&self, word: u64) -> bool {
        self.head.compare_exchange(word, word, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Pushes `ids` (all currently off the stack, each once) as one chain with one CAS.
    /// `ids[0]` ends on top.
    pub fn push_chain(&self, ids: &[u32]) {
        let (Some(&first), Some(&last)) = (ids.first(), ids.last()) else {
            return;
        };
        // Link the chain privately: nobody reads `next` of an id that is off the stack
        // except a stale walker, whose CAS will fail.
        for pair in ids.windows(2) {
            self.set_next(pair[0], pair[1]);
        }
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let (tag, top) = unpack(head);
            let below = self.len_under(top) as u32;
            self.set_next(last, top);
            let len = ids.len() as u32;
            for (k, &id) in ids.iter().enumerate() {
                self.set_depth(id, below + len - k as u32);
            }
            // Release publishes the links and depths written above to whoever acquires this head.
            match self.head.compare_exchange_weak(
                head,
                pack(tag.wrapping_add(1), first),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return,
                Err(seen) => head = seen,
            }
        }
    }

    /// The ids on the stack, top first. Only meaningful while no other thread mutates the
    /// list; returns `Err` with a description if the links or depths are corrupt.
    pub fn snapshot(&self) -> Result<Vec<u32>, String> {
        let (_, mut id) = unpack(self.head.load(Ordering::Acquire));
        let expected = self.len_under(id);
        let mut ids = Vec::new();
        while id != NIL {
            if id as usize >= self.capacity() {
                return Err(format!("free list holds id {id} >= capacity {}", self.capacity()));
            }
            if ids.len() > self.capacity() {
                return Err("free list has a cycle".into());
            }
            let depth = self.depth_of(id, Ordering::Acquire) as usize;
            if depth != expected - ids.len() {
                return Err(format!(
                    "block {id} has depth {depth}, {} ids lie under it",
                    expected - ids.len()
                ));
            }
            ids.push(id);
            id = self.next_of(id, Ordering::Acquire);
        }
        if ids.len() != expected {
            return Err(format!(
                "the top's depth says {expected} ids, the links hold {}",
                ids.len()
            ));
        }
        Ok(ids)
    }
}
