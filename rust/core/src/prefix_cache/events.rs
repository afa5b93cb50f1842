//! KV events for cache-aware routers, named as vLLM's KV event schema names them
//! (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`). Opt-in: while disabled nothing is
//! queued; when enabled, the caller drains the queue in order.
//!
//! No event carries a salt or the extra keys: a router sees hashes and tokens only.

use std::collections::VecDeque;

use super::hash::BlockHash;

/// Where a block is stored: vLLM's `medium` field. The Python layer names them ("GPU" for
/// a CUDA pool, "CPU" for a host pool and for the host tier, "disk" for the disk tier).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    /// The pool's own memory.
    Pool,
    /// The prefix cache's second tier in host memory.
    HostTier,
    /// A tier outside the core, below memory (the Python disk tier): its events are not the
    /// core's own but appended to the core's queue by that tier
    /// ([`PrefixCache::record_external_event`](super::PrefixCache::record_external_event)).
    Disk,
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

/// Events queued before the oldest is dropped, unless the caller sets another capacity.
/// A decode step of a few hundred requests queues a few hundred events; a consumer that
/// drains every step never comes near it.
pub const DEFAULT_MAX_QUEUED_EVENTS: usize = 10_000;

/// An event with its place in the cache's history: `seq` counts every event the cache ever
/// numbered, from 1, dropped or not, so a gap in `seq` is a gap in what the reader saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequencedEvent {
    pub seq: u64,
    pub event: KvEvent,
}

/// What one drain hands over.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EventBatch {
    /// This drain's number: 1 for the first, one more for each drain after it.
    pub batch_seq: u64,
    /// The events queued since the last drain, oldest first.
    pub events: Vec<SequencedEvent>,
    /// Events dropped since the last drain because the queue was full (the oldest go
    /// first). Non-zero: the reader missed part of the history and must re-read the cache's
    /// snapshot before applying these events.
    pub dropped: u64,
    /// The `seq` of the newest event numbered so far (0 before the first); a snapshot
    /// taken now is consistent with it.
    pub last_seq: u64,
}

/// The queue of KV events: opt-in, bounded. Past `capacity` events the oldest is dropped
/// and counted, and the next drain reports the count (a "resync needed" marker): memory
/// stays bounded when a consumer stops reading, and the consumer learns what it lost.
/// Dropping the newest instead would keep a stale history and still force a resync;
/// blocking the cache on a slow reader would stall every allocation.
pub struct EventQueue {
    enabled: bool,
    queue: VecDeque<SequencedEvent>,
    capacity: usize,
    /// The `seq` the next event gets.
    next_seq: u64,
    dropped: u64,
    batches: u64,
}

impl Default for EventQueue {
    fn default() -> Self {
        EventQueue {
            enabled: false,
            queue: VecDeque::new(),
            capacity: DEFAULT_MAX_QUEUED_EVENTS,
            next_seq: 1,
            dropped: 0,
            batches: 0,
        }
    }
}

impl EventQueue {
    /// Starts (or stops, dropping what is queued and the dropped count) recording events.
    /// Sequence numbers are never reused: they continue across a stop and a start.
    pub fn set_enabled(&mut self, enabled: bool) {
        self.enabled = enabled;
        if !enabled {
            self.queue = VecDeque::new();
            self.dropped = 0;
        }
    }
    pub fn enabled(&self) -> bool {
        self.enabled
    }
    /// Sets the most events kept (at least 1); a queue longer than that drops its oldest now.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        self.trim();
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn push(&mut self, event: KvEvent) {
        if self.enabled {
            let seq = self.next_seq;
            self.next_seq += 1;
            self.queue.push_back(SequencedEvent { seq, event });
            self.trim();
        }
    }
    fn trim(&mut self) {
        while self.queue.len() > self.capacity {
            self.queue.pop_front();
            self.dropped += 1;
        }
    }
    /// The `seq` of the newest event numbered so far (0 before the first).
    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }
    /// Everything queued, oldest first, with what was dropped since the last drain; the
    /// queue is empty afterwards (and its memory returned once it held many events).
    pub fn drain_batch(&mut self) -> EventBatch {
        self.batches += 1;
        let events = if self.queue.capacity() > 4 * self.queue.len().max(64) {
            std::mem::take(&mut self.queue).into()
        } else {
            self.queue.drain(..).collect()
        };
        EventBatch {
            batch_seq: self.batches,
            events,
            dropped: std::mem::take(&mut self.dropped),
            last_seq: self.last_seq(),
        }
    }
    /// The events of [`drain_batch`](Self::drain_batch) without their numbers.
    pub fn drain(&mut self) -> Vec<KvEvent> {
        self.drain_batch().events.into_iter().map(|e| e.event).collect()
    }
    pub fn len(&self) -> usize {
        self.queue.len()
    }
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_drops_its_oldest_and_the_next_drain_says_how_many() {
        let mut q = EventQueue::default();
        q.push(KvEvent::AllBlocksCleared);
        assert!(q.is_empty(), "nothing is queued while disabled");
        assert_eq!(q.last_seq(), 0);
        q.set_enabled(true);
        q.set_capacity(3);
        for _ in 0..5 {
            q.push(KvEvent::AllBlocksCleared);
        }
        assert_eq!(q.len(), 3);
        let batch = q.drain_batch();
        assert_eq!(batch.dropped, 2);
        assert_eq!(batch.last_seq, 5);
        assert_eq!(batch.batch_seq, 1);
        assert_eq!(batch.events.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![3, 4, 5]);
        let next = q.drain_batch();
        assert_eq!((next.dropped, next.events.len(), next.batch_seq), (0, 0, 2));
        q.set_enabled(false);
        q.set_enabled(true);
        q.push(KvEvent::AllBlocksCleared);
        assert_eq!(q.drain_batch().events[0].seq, 6, "numbers are never reused");
    }
}
