//! What the cache needs from a second tier that evicted blocks spill into. The pool owns
//! that tier (`pool/spill.rs`: a host pool and a copy engine) and the eviction stage below it
//! (`pool/evicted.rs`), joined as one target in `pool/lower.rs`, beside its cache, and hands
//! it to every cache call that may evict or hit; the cache knows nothing of pools or copies.

use super::events::EventQueue;
use super::hash::BlockHash;

/// A second tier of the cache. Every method is called with the cache's lock held, so the two
/// tiers change together.
pub trait SpillTarget {
    /// The second tier's blocks holding the longest prefix of `hashes`.
    fn lookup_run(&self, hashes: &[BlockHash]) -> Vec<u32>;
    /// Takes blocks found by `lookup_run` (under the same lock) out of the second tier's
    /// cache, so that no spill drops them before `swap_in` copies them.
    fn take(&self, tier_ids: &[u32], events: &mut EventQueue);
    /// Copies taken blocks into pool blocks `pool_ids` and lets them go; false if the copy
    /// failed (the content is lost and the caller computes those blocks instead).
    fn swap_in(&self, tier_ids: &[u32], pool_ids: &[u32]) -> bool;
    /// Keeps what it can of pool blocks the cache just evicted (`(id, hash)`, least recently
    /// used first), best effort.
    fn spill(&self, evicted: &[(u32, BlockHash)], events: &mut EventQueue);
    /// The hashes of every block it holds (a snapshot).
    fn cached_hashes(&self) -> Vec<BlockHash>;
    /// Drops everything it holds (a reset); returns how many blocks.
    fn clear(&self) -> usize;
}
