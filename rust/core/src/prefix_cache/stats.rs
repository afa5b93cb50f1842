//! Prefix-cache counters, in vLLM's units (queries and hits count tokens).

/// A snapshot of the counters (cumulative since the pool was made) and gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Blocks with a hash (referenced or evictable).
    pub num_cached_blocks: usize,
    /// Cached blocks nobody references: reusable by a hit, or evicted for new blocks.
    pub num_evictable_blocks: usize,
    /// Requests that looked up their prompt.
    pub requests: u64,
    /// Prompt tokens looked up (vLLM's `prefix_cache_queries`).
    pub queries: u64,
    /// Prompt tokens found cached (vLLM's `prefix_cache_hits`).
    pub hits: u64,
    /// Blocks that entered the cache.
    pub stored_blocks: u64,
    /// Cached blocks evicted to make room.
    pub evictions: u64,
    /// Successful resets.
    pub resets: u64,
    /// Host tier (0 without one): its blocks, those holding a spilled block now, blocks
    /// spilled into it, blocks it dropped to make room, blocks copied back on a hit.
    pub host_num_blocks: usize,
    pub host_num_cached_blocks: usize,
    pub host_stored_blocks: u64,
    pub host_evictions: u64,
    pub swapped_in_blocks: u64,
}

impl PrefixCacheStats {
    /// Hits over queries, in tokens (0 before the first query).
    pub fn hit_rate(&self) -> f64 {
        if self.queries == 0 {
            0.0
        } else {
            self.hits as f64 / self.queries as f64
        }
    }
}
