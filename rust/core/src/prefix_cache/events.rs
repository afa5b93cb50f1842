//! KV events for cache-aware routers, named as vLLM's KV event schema names them
//! (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`). Opt-in: while disabled nothing is
//! queued; when enabled, the caller drains the queue in order.
//!
//! No event carries a salt or the extra keys: a router sees hashes and tokens only.

use std::collections::VecDeque;

use super::hash::BlockHash;

/// Where a block is stored: vLLM's `medium` field. The Python layer names them ("GPU" for
/// a CUDA pool, "CPU" for a host pool and for the host tier).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    /// The pool's own memory.
    Pool,
    /// The prefix cache's second tier in host memory.
    HostTier,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive blocks of one request entered the cache. `parent_block_hash` is the hash
    /// of the block before the first one (None for a request's first block);
    /// `token_ids` are the tokens of all of them, `block_size` per block. Blocks spilled to
    /// the host tier are reported as vLLM's CPU offloading reports them: no parent, no tokens.
    BlockStored {
        /// The KV group the blocks belong to: 0 for a uniform pool's blocks; for hybrid
        /// tables, the index of the model's group (`ModelKvSpec::groups`) whose pages hold
        /// them. A router counts a prefix as cached only where every group holds it.
        group: u32,
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: usize,
        lora_id: Option<u64>,
        medium: Medium,
    },
    /// These blocks of group `group` (as in `BlockStored`) left one tier of the cache
    /// (evicted for reuse, or moved to the other).
    BlockRemoved { group: u32, block_hashes: Vec<BlockHash>, medium: Medium },
    /// Every cached block was dropped, on both tiers (a reset).
    AllBlocksCleared,
}

#[derive(Default)]
pub struct EventQueue {
    enabled: bool,
    queue: VecDeque<KvEvent>,
}

impl EventQueue {
    /// Starts (or stops, dropping what is queued) recording events.
    pub fn set_enabled(&mut self, enabled: bool) {
        self.enabled = enabled;
        if !enabled {
            self.queue.clear();
        }
    }
    pub fn enabled(&self) -> bool {
        self.enabled
    }
    pub fn push(&mut self, event: KvEvent) {
        if self.enabled {
            self.queue.push_back(event);
        }
    }
    /// Everything queued, oldest first; the queue is empty afterwards.
    pub fn drain(&mut self) -> Vec<KvEvent> {
        self.queue.drain(..).collect()
    }
    pub fn len(&self) -> usize {
        self.queue.len()
    }
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}
