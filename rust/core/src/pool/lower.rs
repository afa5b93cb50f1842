//! Everything below the pool's cache, as the cache sees it: the optional host tier
//! (`spill.rs`) and the optional eviction stage (`evicted.rs`) that hands blocks leaving the
//! last in-memory tier to a tier below memory. The cache gets one `SpillTarget`; without
//! either part it gets none, and evicting costs what it always cost.

use std::sync::OnceLock;

use super::evicted::AttachedStage;
use super::spill::SpillTier;
use crate::prefix_cache::events::EventQueue;
use crate::prefix_cache::{BlockHash, SpillTarget};

#[derive(Default)]
pub(crate) struct LowerTiers {
    pub(crate) host: Option<SpillTier>,
    /// Attached at most once, while the pool is shared (`Pool::attach_eviction_stage`): a
    /// `OnceLock`, so an eviction reads it with one atomic load and no lock.
    pub(crate) stage: OnceLock<AttachedStage>,
}

impl LowerTiers {
    /// The target the cache calls, or None when there is nothing below the pool.
    pub(crate) fn target(&self) -> Option<&dyn SpillTarget> {
        (self.host.is_some() || self.stage.get().is_some()).then_some(self as &dyn SpillTarget)
    }
}

impl SpillTarget for LowerTiers {
    fn lookup_run(&self, hashes: &[BlockHash]) -> Vec<u32> {
        self.host.as_ref().map_or_else(Vec::new, |h| h.lookup_run(hashes))
    }

    fn take(&self, tier_ids: &[u32], events: &mut EventQueue) {
        if let Some(host) = &self.host {
            host.take(tier_ids, events);
        }
    }

    fn swap_in(&self, tier_ids: &[u32], pool_ids: &[u32]) -> bool {
        self.host.as_ref().is_none_or(|h| h.swap_in(tier_ids, pool_ids))
    }

    /// Into the host tier if there is one (what it drops, and what it cannot take, goes to
    /// the stage); else straight to the stage.
    fn spill(&self, evicted: &[(u32, BlockHash)], events: &mut EventQueue) {
        let stage = self.stage.get();
        match &self.host {
            Some(host) => host.spill(evicted, events, stage),
            None => {
                if let Some(stage) = stage {
                    stage.capture_pool_blocks(evicted);
                }
            }
        }
    }

    fn cached_hashes(&self) -> Vec<BlockHash> {
        self.host.as_ref().map_or_else(Vec::new, SpillTier::cached_hashes)
    }

    /// A reset: the host tier's blocks and the staged ones are stale alike.
    fn clear(&self) -> usize {
        if let Some(stage) = self.stage.get() {
            stage.stage.clear();
        }
        self.host.as_ref().map_or(0, SpillTier::clear)
    }
}
