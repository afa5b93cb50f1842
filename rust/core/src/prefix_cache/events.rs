//! KV events for cache-aware routers, named as vLLM's KV event schema names them
//! (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`). Opt-in: while disabled nothing is
//! queued; when enabled, the caller drains the queue in order.
//!
//! No event carries a salt or the extra keys: a router sees hashes and tokens only.

use std::collections::VecDeque;

use super::hash::BlockHash;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive blocks of one request entered the cache. `parent_block_hash` is the hash
    /// of the block before the first one (None for a request's first block);
    /// `token_ids` are the tokens of all of them, `block_size` per block.
    BlockStored {
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: usize,
        lora_id: Option<u64>,
    },
    /// These blocks left the cache (evicted for reuse).
    BlockRemoved { block_hashes: Vec<BlockHash> },
    /// Every cached block was dropped (a reset).
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
}
