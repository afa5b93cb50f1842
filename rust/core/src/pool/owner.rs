//! Who holds each allocated block: the plain pool API (`Pool::alloc`, `free`, ...), block
//! tables, or a hybrid model's tables (`HybridTables`, and the hybrid host tier's pages). A
//! block is freed or shared only through the API that allocated it, so a block a
//! request's table holds cannot be freed through `Pool::free` (it would then be handed out
//! again while the table still points at it). One byte per id, set on every allocation and
//! checked in O(1) before anything changes.

// Plain std atomics, not the loom facade: the tag is not part of the lock-free protocol the
// loom models check (it is written only by the thread that just popped the block).
use std::sync::atomic::{AtomicU8, Ordering};

use crate::error::CoreError;
use crate::zeroed::zeroed_slice;

/// The API a block was allocated through. `Pool` is 0, so fresh (zeroed) tags read as it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Owner {
    Pool = 0,
    Tables = 1,
    HybridTables = 2,
}

impl Owner {
    /// How to free a block of this owner, for error messages.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Owner::Pool => {
                "allocated through the pool (Pool.alloc / alloc_many); free it with Pool.free"
            }
            Owner::Tables => {
                "held by block tables; it is freed with its request (BlockTables.free)"
            }
            Owner::HybridTables => {
                "held by hybrid tables (one group's page of a request); it is freed with its \
                 request (HybridTables.free)"
            }
        }
    }
}

/// One tag per id up to the pool's capacity. The tags of ids never allocated stay untouched
/// zero pages, so a growable pool's reservation costs no memory here until used.
pub(crate) struct Owners(Box<[AtomicU8]>);

impl Owners {
    pub(crate) fn new(capacity: usize) -> Result<Self, CoreError> {
        zeroed_slice(capacity).map(Owners)
    }

    /// Tags freshly allocated ids (ours alone: just popped off the free list).
    pub(crate) fn set(&self, ids: &[u32], owner: Owner) {
        for &id in ids {
            self.0[id as usize].store(owner as u8, Ordering::Relaxed);
        }
    }

    pub(crate) fn get(&self, id: u32) -> Owner {
        match self.0[id as usize].load(Ordering::Relaxed) {
            0 => Owner::Pool,
            1 => Owner::Tables,
            // Only `set` writes a tag, and only an `Owner`'s value.
            _ => Owner::HybridTables,
        }
    }
}
