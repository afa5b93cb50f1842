//! Cached pages of `HybridTables` on the prefix cache's host tier (design: "Host tier for
//! cached pages" in `hybrid.md`).
//!
//! The tier is the uniform one (`pool/spill.rs`: its slab, allocator, LRU and copy engine,
//! owned by the pool); these tables drive it themselves, as they drive the pool's cache.
//! A page they evict spills under the tag it had in the pool's cache; `HostIndex` keeps,
//! per tag, the page's group, keys, reported chunk hashes and checkpoint siblings, and maps
//! each key to its tag. A key lives on one tier: in the pool index's `keys` or here. A hit
//! on a host page takes it off the tier before the call evicts anything, copies it into a
//! fresh pool page and caches that page again under the same keys; from there it is a pool
//! hit like any other. An entry whose tag the tier no longer holds (a reset cleared it) is
//! stale: never served, dropped at the next spill.

use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::hybrid::prefix::{CachedPage, Reported};
use crate::hybrid::tables::HybridTables;
use crate::pool::SpillTier;
use crate::prefix_cache::{BlockHash, KvEvent, Medium};

/// Where a hit's page is cached: a pool page, or a host-tier block (with the tag it is
/// cached under there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CachedAt {
    Pool(u32),
    Host { tag: BlockHash, host_id: u32 },
}

impl CachedAt {
    pub(super) fn pool_page(&self) -> Option<u32> {
        match *self {
            CachedAt::Pool(page) => Some(page),
            CachedAt::Host { .. } => None,
        }
    }
    pub(super) fn host_block(&self) -> Option<(BlockHash, u32)> {
        match *self {
            CachedAt::Pool(_) => None,
            CachedAt::Host { tag, host_id } => Some((tag, host_id)),
        }
    }
}

/// A cached page of one group on the host tier.
#[derive(Debug, Clone)]
pub(super) struct HostPage {
    group: usize,
    keys: Vec<BlockHash>,
    /// The chunk hashes reported as stored for it (reported removed when it leaves), each
    /// without a parent: the host tier's `BlockStored` names none.
    reported: Vec<Reported>,
    /// The tags of the other pages of its state checkpoint (all on the host tier, or it is
    /// dropped: a partial slot serves nothing).
    siblings: Vec<BlockHash>,
}

/// The tables' pages on the host tier, by tag, and their keys.
#[derive(Debug, Default)]
pub(super) struct HostIndex {
    keys: FxHashMap<BlockHash, BlockHash>,
    pages: FxHashMap<BlockHash, HostPage>,
}

impl HostIndex {
    fn insert(&mut self, tag: BlockHash, page: HostPage) {
        for key in &page.keys {
            if let Some(old) = self.keys.insert(*key, tag) {
                if old != tag {
                    if let Some(entry) = self.pages.get_mut(&old) {
                        entry.keys.retain(|k| k != key);
                    }
                }
            }
        }
        self.pages.insert(tag, page);
    }

    fn remove(&mut self, tag: &BlockHash) -> Option<HostPage> {
        let page = self.pages.remove(tag)?;
        for key in &page.keys {
            if self.keys.get(key) == Some(tag) {
                self.keys.remove(key);
            }
        }
        Some(page)
    }

    /// The reported chunks of every page the tier still holds, with its group.
    pub(super) fn live_reported<'a>(
        &'a self,
        tier: &'a SpillTier,
    ) -> impl Iterator<Item = (usize, &'a Reported)> + 'a {
        self.pages
            .iter()
            .filter(|(tag, _)| tier.host_block(tag).is_some())
            .flat_map(|(_, page)| page.reported.iter().map(|r| (page.group, r)))
    }

    /// Drops the entries the tier no longer holds (all of them after a reset).
    fn prune_stale(&mut self, tier: &SpillTier) {
        if self.pages.len() > tier.num_cached() {
            let stale: Vec<BlockHash> =
                self.pages.keys().filter(|tag| tier.host_block(tag).is_none()).copied().collect();
            for tag in stale {
                self.remove(&tag);
            }
        }
    }
}

/// Appends `hashes` of `group` to per-group runs (one event per run).
fn push_run(runs: &mut Vec<(usize, Vec<BlockHash>)>, group: usize, reported: &[Reported]) {
    if reported.is_empty() {
        return;
    }
    let hashes = reported.iter().map(|r| r.hash);
    match runs.last_mut() {
        Some((g, run)) if *g == group => run.extend(hashes),
        _ => runs.push((group, hashes.collect())),
    }
}

/// `reported` as the host tier's events name it: without parents.
fn without_parents(reported: Vec<Reported>) -> Vec<Reported> {
    reported.into_iter().map(|r| Reported { hash: r.hash, parent: None }).collect()
}

impl HybridTables {
    /// The host-tier block cached under `key` for `group`, if the tier still holds it.
    pub(super) fn host_page(&self, key: &BlockHash, group: usize) -> Option<CachedAt> {
        let tier = self.pool.prefix_host_tier()?;
        let host = &self.index.as_ref()?.host;
        let tag = *host.keys.get(key)?;
        let entry = host.pages.get(&tag)?;
        #[cfg(feature = "internals")]
        let group =
            if super::prefix::mutation::on(super::prefix::mutation::Mutation::KeysIgnoreTheGroup) {
                entry.group
            } else {
                group
            };
        if entry.group != group {
            return None;
        }
        let host_id = tier.host_block(&tag)?;
        Some(CachedAt::Host { tag, host_id })
    }

    /// Takes the host blocks of a hit off the tier (no spill can drop them now) and out of
    /// the index; returns their entries, in order.
    pub(super) fn take_host_pages(&mut self, from_host: &[(BlockHash, u32)]) -> Vec<HostPage> {
        if from_host.is_empty() {
            return Vec::new();
        }
        let pool = Arc::clone(&self.pool);
        let tier = pool.prefix_host_tier().expect("host hits come from the host tier");
        let host_ids: Vec<u32> = from_host.iter().map(|&(_, id)| id).collect();
        tier.take_blocks(&host_ids);
        let host = &mut self.index.as_mut().expect("caching").host;
        from_host.iter().map(|(tag, _)| host.remove(tag).expect("a host hit is indexed")).collect()
    }

    /// Undoes [`take_host_pages`](Self::take_host_pages) (the call failed before copying).
    pub(super) fn restore_host_pages(
        &mut self,
        from_host: &[(BlockHash, u32)],
        taken: Vec<HostPage>,
    ) {
        if from_host.is_empty() {
            return;
        }
        let pool = Arc::clone(&self.pool);
        let tier = pool.prefix_host_tier().expect("host hits come from the host tier");
        let (tags, host_ids): (Vec<BlockHash>, Vec<u32>) = from_host.iter().copied().unzip();
        tier.restore(&host_ids, &tags);
        let host = &mut self.index.as_mut().expect("caching").host;
        for (tag, page) in tags.into_iter().zip(taken) {
            host.insert(tag, page);
        }
    }

    /// Copies the taken host blocks into `revived` (fresh pool pages, one each) and caches
    /// those under the keys they had, reporting the move per group (`BlockRemoved` from the
    /// host tier, `BlockStored` in the pool). Returns each tag's new page, or `None` if the
    /// copy failed (a CUDA error): the content is then gone from both tiers.
    pub(super) fn bring_back(
        &mut self,
        from_host: &[(BlockHash, u32)],
        taken: Vec<HostPage>,
        revived: &[u32],
    ) -> Option<FxHashMap<BlockHash, u32>> {
        if from_host.is_empty() {
            return Some(FxHashMap::default());
        }
        let pool = Arc::clone(&self.pool);
        let tier = pool.prefix_host_tier().expect("host hits come from the host tier");
        let cache = pool.prefix_cache().expect("caching");
        let host_ids: Vec<u32> = from_host.iter().map(|&(_, id)| id).collect();
        #[cfg(feature = "internals")]
        let copied = if super::prefix::mutation::on(
            super::prefix::mutation::Mutation::HostHitFromTheNextSlot,
        ) {
            let n = tier.num_blocks() as u32;
            let wrong: Vec<u32> = host_ids.iter().map(|&id| (id + 1) % n).collect();
            tier.copy_in(&wrong, revived)
        } else {
            tier.copy_in(&host_ids, revived)
        };
        #[cfg(not(feature = "internals"))]
        let copied = tier.copy_in(&host_ids, revived);
        tier.free_taken(&host_ids);
        let mut removed = Vec::new();
        for page in &taken {
            push_run(&mut removed, page.group, &page.reported);
        }
        for (group, block_hashes) in removed {
            cache.push_event(KvEvent::BlockRemoved {
                group: group as u32,
                block_hashes,
                medium: Medium::HostTier,
            });
        }
        if !copied {
            return None;
        }
        let page_of: FxHashMap<BlockHash, u32> =
            from_host.iter().map(|&(tag, _)| tag).zip(revived.iter().copied()).collect();
        let mut stored = Vec::new();
        for (host, &page) in taken.into_iter().zip(revived) {
            push_run(&mut stored, host.group, &host.reported);
            let siblings = host.siblings.iter().filter_map(|t| page_of.get(t).copied()).collect();
            self.recache(page, host, siblings);
        }
        for (group, block_hashes) in stored {
            cache.push_event(KvEvent::BlockStored {
                group: group as u32,
                block_hashes,
                parent_block_hash: None,
                token_ids: Vec::new(),
                block_size: super::HASH_CHUNK_TOKENS,
                lora_id: None,
                medium: Medium::Pool,
            });
        }
        Some(page_of)
    }

    /// Caches `page` (just filled from the host tier, referenced by the call) in the pool's
    /// cache under a new tag, with the keys, hashes and checkpoint siblings `host` had.
    fn recache(&mut self, page: u32, host: HostPage, siblings: Vec<u32>) {
        let cache = self.pool.prefix_cache().expect("caching");
        let index = self.index.as_mut().expect("caching");
        index.remove_page(page);
        let tag = index.new_tag(cache.hasher());
        let inserted = cache.insert_block(page, tag);
        debug_assert!(inserted, "a fresh tag is not cached");
        for key in &host.keys {
            if let Some(old) = index.keys.insert(*key, page) {
                if let Some(entry) = index.pages.get_mut(&old).filter(|_| old != page) {
                    entry.keys.retain(|k| k != key);
                }
            }
        }
        let entry = CachedPage {
            tag,
            group: host.group,
            keys: host.keys,
            reported: host.reported,
            siblings,
        };
        index.pages.insert(page, entry);
    }

    /// With a host tier: copies the pages just evicted from the pool (`gone`: still holding
    /// their content, not yet handed out again) to the tier under their tags, and reports
    /// per group what the tier dropped to make room (`BlockRemoved`) and what it now holds
    /// (`BlockStored`, medium host tier). A page that serves no key is not kept; nor is a
    /// checkpoint the tier cannot hold whole.
    pub(super) fn spill_pages(&mut self, gone: Vec<(u32, CachedPage)>) {
        let pool = Arc::clone(&self.pool);
        let Some(tier) = pool.prefix_host_tier() else { return };
        let index = self.index.as_mut().expect("caching");
        let host = &mut index.host;
        host.prune_stale(tier);
        let tag_of: FxHashMap<u32, BlockHash> = gone.iter().map(|(p, e)| (*p, e.tag)).collect();
        let gone: Vec<(u32, CachedPage)> =
            gone.into_iter().filter(|(_, e)| !e.keys.is_empty()).collect();
        if gone.is_empty() {
            return;
        }
        let blocks: Vec<(u32, BlockHash)> = gone.iter().map(|(p, e)| (*p, e.tag)).collect();
        // No eviction stage: it takes uniform host pools' blocks only (a pool of hybrid pages
        // cannot attach one), so what this spill drops leaves memory uncaptured.
        let outcome = tier.spill_blocks(&blocks, None);
        let mut removed = Vec::new();
        // Checkpoint pages whose slot is no longer whole on the tier.
        let mut partial: Vec<BlockHash> = Vec::new();
        for tag in &outcome.dropped {
            if let Some(page) = host.remove(tag) {
                partial.extend(&page.siblings);
                push_run(&mut removed, page.group, &page.reported);
            }
        }
        let stored: FxHashSet<BlockHash> = outcome.stored.iter().copied().collect();
        let mut new_tags = Vec::new();
        for (_, entry) in gone {
            if !stored.contains(&entry.tag) {
                continue;
            }
            let siblings: Vec<BlockHash> =
                entry.siblings.iter().filter_map(|p| tag_of.get(p).copied()).collect();
            let whole = siblings.len() == entry.siblings.len()
                && siblings.iter().all(|t| stored.contains(t));
            if !whole {
                partial.push(entry.tag);
            }
            new_tags.push(entry.tag);
            let page = HostPage {
                group: entry.group,
                keys: entry.keys,
                reported: without_parents(entry.reported),
                siblings,
            };
            host.insert(entry.tag, page);
        }
        let mut discarded = Vec::new();
        while let Some(tag) = partial.pop() {
            let Some(page) = host.remove(&tag) else { continue };
            partial.extend(&page.siblings);
            discarded.push(tag);
            if !stored.contains(&tag) {
                push_run(&mut removed, page.group, &page.reported);
            }
        }
        tier.discard(&discarded);
        let cache = pool.prefix_cache().expect("caching");
        for (group, block_hashes) in removed {
            cache.push_event(KvEvent::BlockRemoved {
                group: group as u32,
                block_hashes,
                medium: Medium::HostTier,
            });
        }
        let mut kept = Vec::new();
        for tag in &new_tags {
            if let Some(page) = host.pages.get(tag) {
                push_run(&mut kept, page.group, &page.reported);
            }
        }
        for (group, block_hashes) in kept {
            cache.push_event(KvEvent::BlockStored {
                group: group as u32,
                block_hashes,
                parent_block_hash: None,
                token_ids: Vec::new(),
                block_size: super::HASH_CHUNK_TOKENS,
                lora_id: None,
                medium: Medium::HostTier,
            });
        }
    }

    /// Per group, the pages the host tier holds for these tables (stale entries not counted).
    pub(super) fn host_pages_per_group(&self) -> Vec<usize> {
        let mut counts = vec![0; self.spec.num_groups()];
        let (Some(index), Some(tier)) = (&self.index, self.pool.prefix_host_tier()) else {
            return counts;
        };
        for (tag, page) in &index.host.pages {
            if tier.host_block(tag).is_some() {
                counts[page.group] += 1;
            }
        }
        counts
    }

    /// The host tier's equations (see `check_invariants`):
    ///
    /// ```text
    /// every host block the tier holds is one live host page of one group, and back
    /// host_free + sum over groups g of host_g == host_blocks
    /// a live host page's keys map to it; none of them is a live pool page's key
    /// a host checkpoint page's siblings are live host pages of its group (a whole slot)
    /// ```
    pub(super) fn check_host_invariants(&self) -> Result<(), String> {
        let Some(index) = &self.index else { return Ok(()) };
        let Some(tier) = self.pool.prefix_host_tier() else {
            return match index.host.pages.is_empty() {
                true => Ok(()),
                false => Err("host pages indexed, but the pool has no host tier".into()),
            };
        };
        let host = &index.host;
        let num_groups = self.spec.num_groups();
        let mut live = 0;
        for (tag, page) in &host.pages {
            if tier.host_block(tag).is_none() {
                continue; // Stale (the tier was reset): never served, dropped at the next spill.
            }
            live += 1;
            if page.group >= num_groups {
                return Err(format!("a host page of group {} (of {num_groups})", page.group));
            }
            for key in &page.keys {
                if host.keys.get(key) != Some(tag) {
                    return Err("a host page lists a key that maps elsewhere".into());
                }
                let on_pool = index.keys.get(key).is_some_and(|&p| {
                    index.pages.get(&p).is_some_and(|e| self.tag_is_live(p, &e.tag))
                });
                if on_pool {
                    return Err("a key is cached on both tiers".into());
                }
            }
            for sibling in &page.siblings {
                let whole = host.pages.get(sibling).is_some_and(|s| s.group == page.group)
                    && tier.host_block(sibling).is_some();
                if !whole {
                    return Err("a checkpoint on the host tier lost one of its pages".into());
                }
            }
        }
        for (key, tag) in &host.keys {
            if !host.pages.get(tag).is_some_and(|p| p.keys.contains(key)) {
                return Err("a host key maps to a page that does not list it".into());
            }
        }
        if live != tier.num_cached() {
            return Err(format!(
                "the host tier holds {} blocks, the tables {live} host pages",
                tier.num_cached()
            ));
        }
        let per_group: usize = self.host_pages_per_group().iter().sum();
        if tier.num_free() + per_group != tier.num_blocks() {
            return Err(format!(
                "host: free {} + per group {per_group} != {} blocks",
                tier.num_free(),
                tier.num_blocks()
            ));
        }
        Ok(())
    }
}
