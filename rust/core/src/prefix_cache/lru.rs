//! The evictable set: cached blocks nobody references, least recently used first.
//!
//! An intrusive doubly-linked list over block ids (`prev[id]`, `next[id]`), so push, remove
//! (a hit reviving a block) and pop (an eviction) are O(1) and never allocate. The arrays
//! cover the ids that exist: they grow (fallibly) with a growable pool's mapped blocks.

use crate::error::CoreError;
use crate::zeroed::try_grow;

const NIL: u32 = u32::MAX;

pub struct EvictableList {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    /// Least recently used: evicted first.
    head: u32,
    /// Most recently used.
    tail: u32,
    len: usize,
}

impl EvictableList {
    /// An empty list over ids `0..num_blocks`.
    pub fn new(num_blocks: usize) -> Result<Self, CoreError> {
        let mut list = EvictableList {
            prev: Vec::new(),
            next: Vec::new(),
            linked: Vec::new(),
            head: NIL,
            tail: NIL,
            len: 0,
        };
        list.grow_to(num_blocks)?;
        Ok(list)
    }

    /// Makes room for ids below `num_blocks` (never shrinks); `OutOfMemory` leaves the list
    /// usable for the ids it covered.
    pub fn grow_to(&mut self, num_blocks: usize) -> Result<(), CoreError> {
        try_grow(&mut self.prev, num_blocks, NIL)?;
        try_grow(&mut self.next, num_blocks, NIL)?;
        try_grow(&mut self.linked, num_blocks, false)
    }
    /// The ids it covers.
    pub fn num_ids(&self) -> usize {
        self.linked.len()
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn contains(&self, id: u32) -> bool {
        self.linked[id as usize]
    }

    /// Makes `id` (not in the list) the most recently used.
    pub fn push_back(&mut self, id: u32) {
        let i = id as usize;
        debug_assert!(!self.linked[i], "block {id} is evictable twice");
        self.linked[i] = true;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        match self.tail {
            NIL => self.head = id,
            tail => self.next[tail as usize] = id,
        }
        self.tail = id;
        self.len += 1;
    }

    /// Takes `id` out of the list; false if it was not in it.
    pub fn remove(&mut self, id: u32) -> bool {
        let i = id as usize;
        if !self.linked[i] {
            return false;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        match p {
            NIL => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.tail = p,
            n => self.prev[n as usize] = p,
        }
        self.linked[i] = false;
        self.len -= 1;
        true
    }

    /// Takes the least recently used block out of the list.
    pub fn pop_front(&mut self) -> Option<u32> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.remove(id);
        Some(id)
    }

    /// The ids from least to most recently used (invariant checks and tests).
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut id = self.head;
        std::iter::from_fn(move || {
            if id == NIL {
                return None;
            }
            let current = id;
            id = self.next[id as usize];
            Some(current)
        })
        .take(self.len + 1)
    }

    /// The links agree with `len`, `linked` and each other.
    pub fn check(&self) -> Result<(), String> {
        let order: Vec<u32> = self.iter().collect();
        if order.len() != self.len {
            return Err(format!(
                "evictable list walks {} ids, its length is {}",
                order.len(),
                self.len
            ));
        }
        if self.linked.iter().filter(|&&l| l).count() != self.len {
            return Err("evictable list: linked flags disagree with its length".into());
        }
        let mut before = NIL;
        for &id in &order {
            if !self.linked[id as usize] || self.prev[id as usize] != before {
                return Err(format!("evictable list: block {id} is badly linked"));
            }
            before = id;
        }
        if self.tail != before {
            return Err("evictable list: tail is not the last id".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_order_remove_and_pop() {
        let mut l = EvictableList::new(8).unwrap();
        for id in [3, 1, 4, 5] {
            l.push_back(id);
        }
        l.check().unwrap();
        assert!(l.remove(4));
        assert!(!l.remove(4));
        assert!(l.remove(3), "head");
        assert!(l.remove(5), "tail");
        l.check().unwrap();
        l.push_back(6);
        l.push_back(3);
        assert_eq!(l.iter().collect::<Vec<_>>(), [1, 6, 3]);
        assert_eq!(l.pop_front(), Some(1));
        assert_eq!(l.pop_front(), Some(6));
        assert_eq!(l.pop_front(), Some(3));
        assert_eq!(l.pop_front(), None);
        assert!(l.is_empty());
        l.check().unwrap();
    }
}
