//! Prefix caching across the groups of `HybridTables` (design: "Prefix caching" in
//! `hybrid.md`).
//!
//! Prompts are hashed in chunks of [`HASH_CHUNK_TOKENS`] tokens with the pool's prefix-cache
//! hasher (salt, LoRA id and extra keys in the root, as for uniform tables). A hit is a
//! length `h` in whole chunks, the same for every group; a page is cached under keys
//! `(group, page index, chain hash at a chunk boundary b)`:
//!
//! - a token page `k` (tokens `k*bs .. (k+1)*bs`) under every boundary `b` with
//!   `k*bs < b <= ceil16((k+1)*bs)`: the key at `b` says "this page holds the group's KV of
//!   the prefix's tokens `k*bs .. min((k+1)*bs, b)`". The largest `b` serves hits past the
//!   page (the page is shared); the others serve hits ending inside it (the page is copied,
//!   then the new tokens overwrite its tail);
//! - a state checkpoint's slot page `i` under `(group, i, chain hash at t)`.
//!
//! The pages themselves are cached blocks of the pool's prefix cache (its evictable list,
//! its ref counts, its counts), each under one tag unique to it (`prefix_cache/tagged.rs`);
//! a key here is valid while its page's tag is still cached there. The tables evict
//! themselves before each allocation, so they know every page that leaves the cache.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::error::CoreError;
use crate::hybrid::spec::{GroupKind, PageGeometry};
use crate::hybrid::spill::{CachedAt, HostIndex};
use crate::hybrid::tables::{GroupPages, GroupTables, HybridTables, PageCopy, RequestPages};
use crate::pool::Owner;
use crate::prefix_cache::{
    BlockHash, BlockHasher, CacheSnapshot, KvEvent, Medium, PrefixCache, SnapshotBlock,
};
use crate::tables::PromptKey;

/// Deliberate bugs the state machine test must catch (`internals` feature only: tests).
#[cfg(feature = "internals")]
pub mod mutation {
    use std::cell::Cell;

    /// A bug to switch on in this thread's hybrid tables.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Mutation {
        /// A hit ignores state groups: no checkpoint needed, the slot starts fresh.
        HitIgnoresStateCheckpoints,
        /// Window and chunk pages that leave the window go to the free list, uncached.
        WindowPagesReleasedUncached,
        /// Keys ignore the group, and a hit takes a page whatever group cached it.
        KeysIgnoreTheGroup,
        /// A page brought back from the host tier is copied from the host block after the
        /// right one (another cached page's bytes, or a stale one's).
        HostHitFromTheNextSlot,
    }

    thread_local! {
        static ACTIVE: Cell<Option<Mutation>> = const { Cell::new(None) };
    }

    /// Switches `mutation` on (or every one off) for this thread.
    pub fn set(mutation: Option<Mutation>) {
        ACTIVE.with(|m| m.set(mutation));
    }

    pub(crate) fn on(mutation: Mutation) -> bool {
        ACTIVE.with(|m| m.get() == Some(mutation))
    }
}

/// Tokens per hashed chunk: hits are whole chunks, whatever each group's page size.
pub const HASH_CHUNK_TOKENS: usize = crate::pool::PAGE_HASH_CHUNK_TOKENS;
const CHUNK: usize = HASH_CHUNK_TOKENS;

/// Separates the key derivation from the chunk hashes (16 bytes hashed, not 64).
const KEY_TAG: u32 = 0x6b76_6b79;

/// What [`HybridTables::add_request`] found and must have copied.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HybridAdd {
    /// Prompt tokens whose KV (and states) are cached: a multiple of
    /// [`HASH_CHUNK_TOKENS`]; the request computes from there.
    pub num_cached_tokens: usize,
    /// Pages to copy before the request's tokens are computed: each group's cached page that
    /// the hit ends inside (the new tokens overwrite its tail) and each state group's
    /// checkpoint slot (the resumed state).
    pub copies: Vec<PageCopy>,
    /// Pages of the hit that the call brought back from the prefix cache's host tier into
    /// fresh pages (copied by the call, ordered before the pool stream's later work; cached
    /// in the pool again): counted in `num_cached_tokens` like any hit, and among `copies`'
    /// sources where the hit ends inside them.
    pub swapped_in_pages: usize,
}

/// One group's cached pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GroupCacheStats {
    /// Pages cached under some key of this group (held by a table or evictable).
    pub cached_pages: usize,
    /// Of those, the ones no table holds: reusable by a hit, or evicted for new pages.
    pub evictable_pages: usize,
    /// Pages of this group the prefix cache's host tier holds (evicted from the pool,
    /// brought back by a hit); not counted in `cached_pages`.
    pub host_pages: usize,
}

/// A request's hash chain: enough to key the pages of the tokens it has not cached yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RequestHashes {
    root: BlockHash,
    lora_id: Option<u64>,
    /// Keys are registered for every boundary up to here (a multiple of the chunk).
    registered: usize,
    /// The chain hash at `registered` (`None` at 0).
    parent: Option<BlockHash>,
    /// Chain hashes at `registered + CHUNK`, `registered + 2 * CHUNK`, ...: hashed, not yet
    /// registered (their tokens have not all run).
    hashed: Vec<BlockHash>,
    /// The request's tokens from `registered` on.
    tokens: Vec<u32>,
}

impl RequestHashes {
    fn push_tokens(&mut self, hasher: &BlockHasher, new: &[u32]) {
        self.tokens.extend_from_slice(new);
        while (self.hashed.len() + 1) * CHUNK <= self.tokens.len() {
            let i = self.hashed.len();
            let parent = self.hashed.last().copied().or(self.parent).unwrap_or(self.root);
            self.hashed.push(hasher.block(&parent, &self.tokens[i * CHUNK..(i + 1) * CHUNK]));
        }
    }

    /// The last boundary whose chain hash is known.
    fn known(&self) -> usize {
        self.registered + self.hashed.len() * CHUNK
    }

    /// The chain hash at boundary `b`, `registered < b <= known()`.
    fn hash_at(&self, b: usize) -> BlockHash {
        self.hashed[(b - self.registered) / CHUNK - 1]
    }

    /// The chain hash at boundary `b` (`None` at 0 or where unknown).
    fn chain_hash(&self, b: usize) -> Option<BlockHash> {
        if b == self.registered {
            self.parent
        } else if b > self.registered && b <= self.known() && b % CHUNK == 0 {
            Some(self.hash_at(b))
        } else {
            None
        }
    }

    fn advance_to(&mut self, b: usize) {
        let n = (b - self.registered) / CHUNK;
        if n == 0 {
            return;
        }
        self.parent = Some(self.hashed[n - 1]);
        self.hashed.drain(..n);
        self.tokens.drain(..n * CHUNK);
        self.registered = b;
    }
}

/// A chunk hash a page reported as stored, with the parent its `BlockStored` named (the
/// chain hash 16 tokens earlier; `None` for a prompt's first chunk, a checkpoint and a page
/// that came back from the host tier, whose events name none): what a snapshot lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Reported {
    pub(super) hash: BlockHash,
    pub(super) parent: Option<BlockHash>,
}

/// A page the tables cached, under the pool's cache as `tag`.
#[derive(Debug, Clone)]
pub(super) struct CachedPage {
    pub(super) tag: BlockHash,
    pub(super) group: usize,
    /// Its keys in the index.
    pub(super) keys: Vec<BlockHash>,
    /// The chunk hashes reported as stored for it (those it ends: removed with it).
    pub(super) reported: Vec<Reported>,
    /// The other pages of its state checkpoint (evicted with it: a partial slot is useless).
    pub(super) siblings: Vec<u32>,
}

/// The keys of the cached pages of one `HybridTables`.
pub(super) struct PrefixIndex {
    pub(super) keys: FxHashMap<BlockHash, u32>,
    pub(super) pages: FxHashMap<u32, CachedPage>,
    /// The pages evicted to the prefix cache's host tier, when the pool has one
    /// (`spill.rs`). A key is in `keys` or in `host`, never both.
    pub(super) host: HostIndex,
    tag_seed: BlockHash,
    next_tag: u64,
}

impl PrefixIndex {
    pub(super) fn new(hasher: &BlockHasher) -> Self {
        PrefixIndex {
            keys: FxHashMap::default(),
            pages: FxHashMap::default(),
            host: HostIndex::default(),
            tag_seed: hasher.root(Some(b"kvpool.hybrid.page-tag"), None, b""),
            next_tag: 0,
        }
    }

    /// A tag never used before (a counter through the keyed hasher).
    pub(super) fn new_tag(&mut self, hasher: &BlockHasher) -> BlockHash {
        let counter = self.next_tag;
        self.next_tag += 1;
        hasher.block(&self.tag_seed, &[counter as u32, (counter >> 32) as u32])
    }

    /// Forgets `page` and every key pointing at it.
    pub(super) fn remove_page(&mut self, page: u32) -> Option<CachedPage> {
        let entry = self.pages.remove(&page)?;
        for key in &entry.keys {
            if self.keys.get(key) == Some(&page) {
                self.keys.remove(key);
            }
        }
        Some(entry)
    }
}

/// The key of page `page` (index in the group's page sequence, or in a state slot) of
/// `group` at the boundary whose chain hash is `chain`.
fn chunk_key(hasher: &BlockHasher, group: usize, page: usize, chain: &BlockHash) -> BlockHash {
    let page = page as u64;
    #[cfg(feature = "internals")]
    let group = if mutation::on(mutation::Mutation::KeysIgnoreTheGroup) { 0 } else { group };
    hasher.block(chain, &[KEY_TAG, group as u32, page as u32, (page >> 32) as u32])
}

/// The smallest multiple of the chunk at or above `n`.
fn ceil_chunk(n: usize) -> usize {
    n.div_ceil(CHUNK) * CHUNK
}

/// One group's part of a hit.
#[derive(Default)]
struct GroupHit {
    /// Table index in the new table -> cached page shared as it is.
    shared: Vec<(usize, CachedAt)>,
    /// Table index -> cached page copied into a fresh one.
    copied: Vec<(usize, CachedAt)>,
}

/// Per group, the events of one registration: chunk hashes stored, with their tokens.
struct StoredRun {
    parent: Option<BlockHash>,
    hashes: Vec<BlockHash>,
    tokens: Vec<u32>,
}

impl HybridTables {
    /// Whether the pool caches prefixes (then [`add_request`](Self::add_request) can hit).
    pub fn caches_prefixes(&self) -> bool {
        self.index.is_some()
    }

    fn cache(&self) -> Option<&PrefixCache> {
        self.index.as_ref().and(self.pool.prefix_cache())
    }

    /// Adds a request with its prompt's token ids. With a prefix-caching pool, it starts
    /// from the longest cached prefix that every group can serve (never its last token:
    /// its logits must be computed): full and MLA groups share every page of the prefix,
    /// window and chunk groups the pages inside the window (chunk) of its first new token,
    /// and state groups resume from a checkpoint at the hit's end. The returned copies (the
    /// page each group's hit ends inside, each resumed state slot) must run before its
    /// tokens are computed. Without prefix caching this is [`add`](Self::add).
    pub fn add_request(
        &mut self,
        request_id: u64,
        token_ids: &[u32],
        key: &PromptKey<'_>,
    ) -> Result<HybridAdd, CoreError> {
        let num_tokens = token_ids.len();
        let pool = Arc::clone(&self.pool);
        let Some(cache) = pool.prefix_cache().filter(|_| self.index.is_some()) else {
            self.add(request_id, num_tokens)?;
            return Ok(HybridAdd::default());
        };
        self.check_new_id(request_id)?;
        let hasher = cache.hasher();
        let root = hasher.root(key.cache_salt, key.lora_id, key.extra_keys);
        let chain = hasher.chain(&root, token_ids, CHUNK);
        let (hit, group_hits) = self.find_hit(&chain, num_tokens)?;

        // Each group's new table: shared pages, copies and fresh pages.
        let mut groups = GroupTables::with_capacity(self.spec.num_groups());
        let mut num_fresh = 0;
        for (g, group_hit) in group_hits.iter().enumerate() {
            let live = self.spec.live_pages(g, num_tokens, hit)?;
            num_fresh += live.len() - group_hit.shared.len();
            let page_ids = vec![u32::MAX; live.len()].into();
            groups.push(GroupPages { first_page: live.start, page_ids });
        }
        let every_source = || group_hits.iter().flat_map(|h| h.shared.iter().chain(&h.copied));
        let acquired: Vec<u32> = every_source().filter_map(|(_, at)| at.pool_page()).collect();
        let from_host: Vec<(BlockHash, u32)> =
            every_source().filter_map(|(_, at)| at.host_block()).collect();
        // Capacity first, counting the hits that leave the evictable list and a fresh page
        // for each page brought back from the host tier: a refusal then changes nothing, the
        // eviction order included.
        let reviving = acquired.iter().filter(|&&p| self.pool.ref_cnt(p) == Ok(0)).count();
        self.check_room(num_fresh + from_host.len(), reviving)?;
        // Host hits leave the host tier before anything is evicted, so that no spill of this
        // call drops them; pool hits are taken before, so that no eviction takes them.
        let taken = self.take_host_pages(&from_host);
        self.pool.acquire_cached(&acquired, Owner::HybridTables);
        let pages = match self.alloc_pages(from_host.len() + num_fresh) {
            Ok(pages) => pages,
            Err(e) => {
                self.free_pages(&acquired).expect("releasing the hits just taken");
                self.restore_host_pages(&from_host, taken);
                return Err(e);
            }
        };
        let (revived, fresh) = pages.split_at(from_host.len());
        let Some(revived_at) = self.bring_back(&from_host, taken, revived) else {
            // A failed copy (a CUDA error): that content is gone from both tiers. Start over
            // from what is left (the next lookup cannot find it again).
            self.free_pages(&acquired).expect("releasing the hits just taken");
            self.free_pages(&pages).expect("returning pages just allocated");
            return self.add_request(request_id, token_ids, key);
        };
        let page_of = |at: &CachedAt| match *at {
            CachedAt::Pool(page) => page,
            CachedAt::Host { tag, .. } => revived_at[&tag],
        };
        // The copies' sources are read by the copies only: back to the cache.
        let sources: Vec<u32> =
            group_hits.iter().flat_map(|h| h.copied.iter().map(|(_, at)| page_of(at))).collect();
        self.free_pages(&sources).expect("releasing the copy sources just taken");

        let mut fresh = fresh.iter().copied();
        let mut copies = Vec::new();
        for (g, (pages, group_hit)) in groups.iter_mut().zip(&group_hits).enumerate() {
            pages.page_ids.edit(|ids| {
                for (i, at) in &group_hit.shared {
                    ids[*i] = page_of(at);
                }
                for id in ids.iter_mut().filter(|id| **id == u32::MAX) {
                    *id = fresh.next().expect("counted");
                }
            });
            for (i, at) in &group_hit.copied {
                copies.push(PageCopy { group: g, src: page_of(at), dst: pages.page_ids[*i] });
            }
        }
        let n = hit / CHUNK;
        let mut hashes = RequestHashes {
            root,
            lora_id: key.lora_id,
            registered: hit,
            parent: n.checked_sub(1).map(|i| chain[i]),
            hashed: chain[n..].to_vec(),
            tokens: token_ids[hit..].to_vec(),
        };
        // `chain` covers the whole chunks; `push_tokens` would hash the same ones again.
        debug_assert_eq!(hashes.known(), num_tokens / CHUNK * CHUNK);
        hashes.tokens.shrink_to_fit();
        cache.record_query(num_tokens, hit);
        self.requests.insert(
            request_id,
            RequestPages {
                num_tokens,
                next_query: hit,
                groups,
                hashes: Some(Box::new(hashes)),
                quiet_until: 0,
            },
        );
        Ok(HybridAdd { num_cached_tokens: hit, copies, swapped_in_pages: from_host.len() })
    }

    /// Declares that every token of `request_id` has run (its step finished): caches the
    /// pages of its whole chunks now rather than at its next call. Call it before
    /// [`free`](Self::free) to keep the pages of a request that ends without another call.
    pub fn cache_computed(&mut self, request_id: u64) -> Result<(), CoreError> {
        let num_tokens = self.request(request_id)?.num_tokens;
        self.cache_ran(request_id, num_tokens);
        Ok(())
    }

    /// Checkpoints every state group of `request_id` after its `num_tokens` tokens, which
    /// have all run (so its pages are cached too, as [`cache_computed`](Self::cache_computed)):
    /// a later request whose prompt matches up to here resumes from it. `num_tokens` must be
    /// a positive multiple of [`HASH_CHUNK_TOKENS`] and the request's tokens known (added
    /// and appended with ids). Returns the copies from the live slots into the checkpoint
    /// pages: they must run before the request's next tokens are computed (they read the
    /// state the next step overwrites). The checkpoint pages are cached and evictable at
    /// once; any later call may hand them out again, so run the copies before the kernels of
    /// any later call. A checkpoint already cached there is kept (no copies).
    pub fn checkpoint(&mut self, request_id: u64) -> Result<Vec<PageCopy>, CoreError> {
        let request = self.request(request_id)?;
        let t = request.num_tokens;
        if self.index.is_none() {
            return Err(CoreError::InvalidArgument(
                "state checkpoints need a pool with prefix caching".into(),
            ));
        }
        let known = request.hashes.as_deref().map_or(0, RequestHashes::known);
        if t == 0 || t % CHUNK != 0 || known < t {
            return Err(CoreError::InvalidArgument(format!(
                "request {request_id}: a checkpoint needs a positive multiple of \
                 {CHUNK} tokens, all known (added with add_request, appended with \
                 append_tokens); it has {t} tokens, {known} of them hashed in whole chunks"
            )));
        }
        let hashes = request.hashes.as_ref().expect("checked above");
        let at = hashes.chain_hash(t).expect("t is a known boundary");
        let lora_id = hashes.lora_id;
        let slots: Vec<Vec<u32>> = request.groups.iter().map(|g| g.page_ids.to_vec()).collect();
        let pool = Arc::clone(&self.pool);
        let hasher = pool.prefix_cache().expect("checked above").hasher();
        let mut wanted: Vec<(usize, Vec<BlockHash>)> = Vec::new();
        for g in 0..self.spec.num_groups() {
            let PageGeometry::State { pages_per_slot, .. } = *self.spec.geometry(g)? else {
                continue;
            };
            let keys: Vec<BlockHash> =
                (0..pages_per_slot).map(|i| chunk_key(hasher, g, i, &at)).collect();
            if keys.iter().all(|key| self.servable(key, g).is_some()) {
                continue;
            }
            wanted.push((g, keys));
        }
        let num_pages = wanted.iter().map(|(_, keys)| keys.len()).sum();
        // Refused before anything changes, the cache included.
        self.check_room(num_pages, 0)?;
        self.cache_ran(request_id, t);
        let fresh = self.alloc_pages(num_pages)?;
        let mut copies = Vec::with_capacity(fresh.len());
        let mut next = 0;
        for (g, keys) in &wanted {
            let slot = &fresh[next..next + keys.len()];
            next += keys.len();
            for (i, (key, &dst)) in keys.iter().zip(slot).enumerate() {
                copies.push(PageCopy { group: *g, src: slots[*g][i], dst });
                let siblings = slot.iter().copied().filter(|&p| p != dst).collect();
                let reported =
                    if i == 0 { vec![Reported { hash: at, parent: None }] } else { Vec::new() };
                self.index_key(*key, dst, *g, reported, siblings);
            }
            pool.prefix_cache().expect("checked above").push_event(KvEvent::BlockStored {
                group: *g as u32,
                block_hashes: vec![at],
                parent_block_hash: None,
                token_ids: Vec::new(),
                block_size: CHUNK,
                lora_id,
                medium: Medium::Pool,
            });
        }
        // Nobody holds a checkpoint: it is evictable (most recently used) from now on.
        self.free_pages(&fresh).expect("releasing the checkpoint pages just taken");
        Ok(copies)
    }

    /// Every group's cached pages (empty without prefix caching).
    pub fn cache_stats(&self) -> Vec<GroupCacheStats> {
        let Some(index) = &self.index else { return Vec::new() };
        let mut stats = vec![GroupCacheStats::default(); self.spec.num_groups()];
        for (&page, entry) in &index.pages {
            if self.tag_is_live(page, &entry.tag) {
                stats[entry.group].cached_pages += 1;
                stats[entry.group].evictable_pages += (self.pool.ref_cnt(page) == Ok(0)) as usize;
            }
        }
        for (group, host_pages) in self.host_pages_per_group().into_iter().enumerate() {
            stats[group].host_pages = host_pages;
        }
        stats
    }

    /// Every chunk the tables have cached, per group and on both tiers, as the KV events
    /// report them: one [`SnapshotBlock`] per chunk hash a `BlockStored` named and no
    /// `BlockRemoved` took back, with that event's group, medium and parent, and the `seq`
    /// of the newest event the snapshot reflects (block size [`HASH_CHUNK_TOKENS`]). Read
    /// under the pool's cache lock, which numbers the events, so a router that loads it and
    /// applies the events with a greater `seq` holds what the tables hold. `None` without
    /// prefix caching. (The pool's own snapshot cannot say this: it sees one tag a page.)
    pub fn kv_cache_snapshot(&self) -> Option<CacheSnapshot> {
        let index = self.index.as_ref()?;
        let cache = self.pool.prefix_cache()?;
        let tier = self.pool.prefix_host_tier();
        let mut snapshot = cache.read_consistent(|seq, cached_block| {
            let mut blocks = Vec::new();
            for (&page, entry) in &index.pages {
                if cached_block(&entry.tag) != Some(page) {
                    continue; // Stale: the pool's cache was reset since.
                }
                blocks.extend(entry.reported.iter().map(|r| SnapshotBlock {
                    hash: r.hash,
                    parent: r.parent,
                    medium: Medium::Pool,
                    group: entry.group as u32,
                }));
            }
            if let Some(tier) = tier {
                blocks.extend(index.host.live_reported(tier).map(|(group, r)| SnapshotBlock {
                    hash: r.hash,
                    parent: r.parent,
                    medium: Medium::HostTier,
                    group: group as u32,
                }));
            }
            CacheSnapshot { seq, block_size: CHUNK, blocks }
        });
        // One order whatever the maps' (tests compare snapshots).
        snapshot.blocks.sort_unstable_by_key(|b| (b.group, b.medium == Medium::HostTier, b.hash.0));
        Some(snapshot)
    }

    /// The group a cached page is cached under (`None` if it is not cached).
    pub fn cached_page_group(&self, page: u32) -> Option<usize> {
        let entry = self.index.as_ref()?.pages.get(&page)?;
        self.tag_is_live(page, &entry.tag).then_some(entry.group)
    }

    pub(super) fn tag_is_live(&self, page: u32, tag: &BlockHash) -> bool {
        self.pool.prefix_cache().and_then(|c| c.cached_block(tag)) == Some(page)
    }

    /// Where `key` of `group` is cached: a pool page that can take one more reference, or
    /// else a host-tier block.
    fn servable(&self, key: &BlockHash, group: usize) -> Option<CachedAt> {
        match self.live_page(key, group) {
            Some(page) => Some(CachedAt::Pool(page)),
            None => self.host_page(key, group),
        }
    }

    /// The page cached under `key` for `group`, if it is still cached and can take one
    /// more reference.
    fn live_page(&self, key: &BlockHash, group: usize) -> Option<u32> {
        let index = self.index.as_ref()?;
        let &page = index.keys.get(key)?;
        let entry = index.pages.get(&page)?;
        #[cfg(feature = "internals")]
        let group =
            if mutation::on(mutation::Mutation::KeysIgnoreTheGroup) { entry.group } else { group };
        (entry.group == group
            && self.tag_is_live(page, &entry.tag)
            && self.pool.ref_cnt(page).is_ok_and(|rc| rc < crate::MAX_REF_CNT))
        .then_some(page)
    }

    /// The longest hit (in tokens, whole chunks, below `num_tokens`) every group can serve,
    /// and what each group takes for it. `chain[i]` is the chain hash at `(i + 1) * CHUNK`.
    fn find_hit(
        &self,
        chain: &[BlockHash],
        num_tokens: usize,
    ) -> Result<(usize, Vec<GroupHit>), CoreError> {
        let no_hit = || (0..self.spec.num_groups()).map(|_| GroupHit::default()).collect();
        let max_hit = (num_tokens.saturating_sub(1) / CHUNK * CHUNK).min(chain.len() * CHUNK);
        let hasher = self.cache().expect("caching").hasher();
        let hash_at = |b: usize| &chain[b / CHUNK - 1];
        // Full and MLA groups need every page below the hit: their leading run of cached
        // pages bounds it, found once.
        let mut upper = max_hit;
        for (g, group) in self.spec.groups().iter().enumerate() {
            if !matches!(group.kind, GroupKind::Full(_) | GroupKind::MlaLatent { .. }) {
                continue;
            }
            let bs = self.spec.geometry(g)?.block_size().expect("a token group");
            let mut run = 0;
            while ceil_chunk((run + 1) * bs) <= max_hit
                && self
                    .servable(&chunk_key(hasher, g, run, hash_at(ceil_chunk((run + 1) * bs))), g)
                    .is_some()
            {
                run += 1;
            }
            upper = upper.min((run + 1) * bs - 1);
        }
        let mut h = upper / CHUNK * CHUNK;
        while h > 0 {
            let hits: Option<Vec<GroupHit>> =
                (0..self.spec.num_groups()).map(|g| self.group_hit(g, h, hash_at)).collect();
            if let Some(hits) = hits {
                return Ok((h, hits));
            }
            h -= CHUNK;
        }
        Ok((0, no_hit()))
    }

    /// What group `g` takes to serve a hit of `h` tokens, or `None` if it cannot.
    fn group_hit<'c>(
        &self,
        g: usize,
        h: usize,
        hash_at: impl Fn(usize) -> &'c BlockHash,
    ) -> Option<GroupHit> {
        let hasher = self.cache()?.hasher();
        let mut hit = GroupHit::default();
        match *self.spec.geometry(g).ok()? {
            PageGeometry::State { pages_per_slot, .. } => {
                #[cfg(feature = "internals")]
                if mutation::on(mutation::Mutation::HitIgnoresStateCheckpoints) {
                    return Some(hit);
                }
                for i in 0..pages_per_slot {
                    let page = self.servable(&chunk_key(hasher, g, i, hash_at(h)), g)?;
                    hit.copied.push((i, page));
                }
            }
            PageGeometry::Tokens { block_size: bs, .. } => {
                // The pages holding a token some query from `h` on sees, below `h`.
                let needed = self.spec.live_pages(g, h, h).ok()?;
                for (i, k) in needed.enumerate() {
                    let end = (k + 1) * bs;
                    if end <= h {
                        let key = chunk_key(hasher, g, k, hash_at(ceil_chunk(end)));
                        hit.shared.push((i, self.servable(&key, g)?));
                    } else {
                        let key = chunk_key(hasher, g, k, hash_at(h));
                        hit.copied.push((i, self.servable(&key, g)?));
                    }
                }
            }
        }
        Some(hit)
    }

    /// Refuses `count` new pages unless the free and the evictable pages (less `reviving`
    /// evictable pages the call is about to take) cover them.
    /// A growable pool is not refused here: its allocation grows when evicting is not enough.
    pub(super) fn check_room(&self, count: usize, reviving: usize) -> Result<(), CoreError> {
        if self.pool.is_growable() {
            return Ok(());
        }
        let free = self.pool.num_free();
        let evictable = self.pool.num_evictable() - reviving;
        if count > free + evictable {
            return Err(CoreError::OutOfBlocks {
                requested: count,
                free: free + evictable,
                num_blocks: self.pool.num_blocks(),
            });
        }
        Ok(())
    }

    /// Before `count` pages are allocated (every allocation for these tables' pool: the
    /// tables' own `alloc_pages` and a hybrid host tier's swap-in): with prefix caching, the
    /// tables evict (least recently used first) what the free list lacks themselves, so that
    /// they know each page leaving the cache: its keys go and its removal is reported per
    /// group. The pool's own eviction would drop the pages' tags without either. Refuses,
    /// changing nothing, when the free and evictable pages cannot cover `count` (a growable
    /// pool is not refused: its allocation grows).
    pub(super) fn make_room(&mut self, count: usize) -> Result<(), CoreError> {
        if self.index.is_some() {
            self.check_room(count, 0)?;
            let short = count.saturating_sub(self.pool.num_free()).min(self.pool.num_evictable());
            if short > 0 {
                let evicted = self.pool.evict_to_free(short);
                self.forget_evicted(evicted);
            }
        }
        Ok(())
    }

    /// Shrinks a growable pool ([`Pool::shrink`](crate::pool::Pool::shrink)); returns the
    /// bytes released. With prefix caching the tables first evict, themselves, the evictable
    /// pages a shrink can release (above every page in use and every live view's extent):
    /// their keys go and their removal is reported per group, as for any eviction of theirs.
    /// `Pool::shrink` alone leaves the pages these tables cached where they are (it would
    /// drop their tags without their keys or per-group events), so it releases less.
    pub fn shrink(&mut self) -> Result<usize, CoreError> {
        if self.index.is_some() && self.pool.is_growable() {
            let pool = &self.pool;
            let in_use = |p: u32| pool.ref_cnt(p).is_ok_and(|rc| rc > 0);
            let live_end =
                (0..pool.num_blocks() as u32).rev().find(|&p| in_use(p)).map_or(0, |p| p + 1);
            let above = (live_end as usize).max(pool.max_view_extent());
            let index = self.index.as_ref().expect("caching");
            let mut releasable: Vec<u32> = index
                .pages
                .iter()
                .filter(|&(&page, entry)| {
                    page as usize >= above
                        && self.tag_is_live(page, &entry.tag)
                        && pool.ref_cnt(page) == Ok(0)
                })
                .map(|(&page, _)| page)
                .collect();
            releasable.sort_unstable();
            let evicted = self.pool.evict_blocks_to_free(&releasable);
            self.forget_evicted(evicted);
        }
        self.pool.shrink()
    }

    /// Drops the keys of pages the pool's cache just let go (with the other pages of their
    /// checkpoints) and reports them.
    fn forget_evicted(&mut self, mut evicted: Vec<(u32, BlockHash)>) {
        let mut removed: Vec<(usize, Vec<BlockHash>)> = Vec::new();
        // The pages evicted, still holding their content (on the free list, not yet handed out).
        let mut gone: Vec<(u32, CachedPage)> = Vec::new();
        while !evicted.is_empty() {
            let mut siblings = Vec::new();
            let index = self.index.as_mut().expect("caching");
            for (page, tag) in evicted {
                if index.pages.get(&page).is_none_or(|e| e.tag != tag) {
                    continue;
                }
                let entry = index.remove_page(page).expect("present");
                siblings.extend(&entry.siblings);
                if !entry.reported.is_empty() {
                    match removed.last_mut() {
                        Some((group, hashes)) if *group == entry.group => {
                            hashes.extend(entry.reported.iter().map(|r| r.hash))
                        }
                        _ => removed
                            .push((entry.group, entry.reported.iter().map(|r| r.hash).collect())),
                    }
                }
                gone.push((page, entry));
            }
            siblings.retain(|p| index.pages.contains_key(p));
            evicted = self.pool.evict_blocks_to_free(&siblings);
        }
        let cache = self.cache().expect("caching");
        for (group, block_hashes) in removed {
            cache.push_event(KvEvent::BlockRemoved {
                group: group as u32,
                block_hashes,
                medium: Medium::Pool,
            });
        }
        // With a host tier, they spill there before anything can reuse them.
        self.spill_pages(gone);
    }

    /// The `WindowPagesReleasedUncached` mutation: takes the window and chunk pages an
    /// append just released out of the cache at once.
    #[cfg(feature = "internals")]
    pub(super) fn mutation_uncache_released(&mut self, released: &[u32]) {
        if self.index.is_some() && mutation::on(mutation::Mutation::WindowPagesReleasedUncached) {
            let evicted = self.pool.evict_blocks_to_free(released);
            self.forget_evicted(evicted);
        }
    }

    /// Caches `page` of `group` under `key` (replacing a stale entry), tagging the page in
    /// the pool's cache if it is not cached yet.
    fn index_key(
        &mut self,
        key: BlockHash,
        page: u32,
        group: usize,
        reported: Vec<Reported>,
        siblings: Vec<u32>,
    ) {
        let live = self.index.as_ref().and_then(|i| i.pages.get(&page)).map(|e| e.tag);
        let live = live.filter(|tag| self.tag_is_live(page, tag));
        let cache = self.pool.prefix_cache().expect("caching");
        let index = self.index.as_mut().expect("caching");
        if live.is_none() {
            index.remove_page(page);
            let tag = index.new_tag(cache.hasher());
            if !cache.insert_block(page, tag) {
                return;
            }
            index.pages.insert(
                page,
                CachedPage { tag, group, keys: Vec::new(), reported: Vec::new(), siblings },
            );
        }
        if let Some(old) = index.keys.insert(key, page) {
            if old != page {
                if let Some(entry) = index.pages.get_mut(&old) {
                    entry.keys.retain(|k| *k != key);
                }
            }
        }
        let entry = index.pages.get_mut(&page).expect("inserted above");
        entry.keys.push(key);
        entry.reported.extend(reported);
    }

    /// Caches the pages of `request_id`'s tokens below `ran` (all run), boundary by
    /// boundary, before anything releases them. A key some page serves already is left to
    /// it. Queues one `BlockStored` per group for the chunks whose last token a page of it
    /// now holds.
    pub(super) fn cache_ran(&mut self, request_id: u64, ran: usize) {
        let Some(cache) = self.cache() else { return };
        let events = cache.events_enabled();
        let Some(request) = self.requests.get(&request_id) else { return };
        let Some(hashes) = &request.hashes else { return };
        let upto = ran.min(hashes.known()) / CHUNK * CHUNK;
        if upto <= hashes.registered {
            return;
        }
        let hasher = cache.hasher();
        let mut wanted = Vec::new();
        let mut runs: Vec<Option<StoredRun>> = (0..self.spec.num_groups()).map(|_| None).collect();
        for b in (hashes.registered + CHUNK..=upto).step_by(CHUNK) {
            let at = hashes.hash_at(b);
            for (g, pages) in request.groups.iter().enumerate() {
                let Some(bs) = self.spec.geometry(g).ok().and_then(|geo| geo.block_size()) else {
                    continue;
                };
                let last = (b - 1) / bs;
                for k in (b - CHUNK) / bs..=last {
                    let Some(&page) =
                        k.checked_sub(pages.first_page).and_then(|i| pages.page_ids.get(i))
                    else {
                        continue;
                    };
                    let key = chunk_key(hasher, g, k, &at);
                    // First wins, on either tier: a key the host tier serves stays there.
                    if self.servable(&key, g).is_some() {
                        continue;
                    }
                    let ends = k == last;
                    let parent = hashes.chain_hash(b - CHUNK);
                    wanted.push((key, page, g, ends.then_some(Reported { hash: at, parent })));
                    if ends && events {
                        let run = runs[g].get_or_insert_with(|| StoredRun {
                            parent: hashes.chain_hash(b - CHUNK),
                            hashes: Vec::new(),
                            tokens: Vec::new(),
                        });
                        run.hashes.push(at);
                        let from = b - CHUNK - hashes.registered;
                        run.tokens.extend_from_slice(&hashes.tokens[from..from + CHUNK]);
                    }
                }
            }
        }
        let lora_id = hashes.lora_id;
        for (key, page, g, reported) in wanted {
            self.index_key(key, page, g, reported.into_iter().collect(), Vec::new());
        }
        let request = self.requests.get_mut(&request_id).expect("present");
        request.hashes.as_mut().expect("present").advance_to(upto);
        let cache = self.pool.prefix_cache().expect("caching");
        for (g, run) in runs.into_iter().enumerate() {
            let Some(run) = run else { continue };
            cache.push_event(KvEvent::BlockStored {
                group: g as u32,
                block_hashes: run.hashes,
                parent_block_hash: run.parent,
                token_ids: run.tokens,
                block_size: CHUNK,
                lora_id,
                medium: Medium::Pool,
            });
        }
    }

    /// After an append committed: extends the request's hash chain with `token_ids`, or
    /// stops caching its later pages when they are unknown.
    pub(super) fn hash_appended(&mut self, request_id: u64, token_ids: Option<&[u32]>) {
        let Some(cache) = self.pool.prefix_cache() else { return };
        let Some(request) = self.requests.get_mut(&request_id) else { return };
        match (token_ids, request.hashes.as_mut()) {
            (Some(ids), Some(hashes)) => hashes.push_tokens(cache.hasher(), ids),
            (None, Some(_)) => request.hashes = None,
            _ => {}
        }
    }

    /// The prefix index's equations (see `check_invariants`); `group_of` maps each page a
    /// table holds to its group.
    pub(super) fn check_prefix_invariants(
        &self,
        group_of: &FxHashMap<u32, usize>,
    ) -> Result<(), String> {
        let Some(index) = &self.index else { return Ok(()) };
        let pool = &self.pool;
        let cache = pool.prefix_cache().ok_or("the index outlived the pool's cache")?;
        let mut live = 0;
        let mut evictable = vec![0usize; self.spec.num_groups()];
        let mut used = vec![0usize; self.spec.num_groups()];
        for &group in group_of.values() {
            used[group] += 1;
        }
        for (&page, entry) in &index.pages {
            if !self.tag_is_live(page, &entry.tag) {
                continue; // Stale (the pool's cache was reset): pruned when the page comes back.
            }
            live += 1;
            // Cached, held or evictable, a page keeps the tag of the allocation that filled
            // it (`Pool::acquire_cached`): the tables'.
            if pool.owner(page) != Owner::HybridTables {
                return Err(format!("cached page {page} is tagged {:?}", pool.owner(page)));
            }
            let rc = pool.ref_cnt(page).map_err(|e| e.to_string())?;
            match group_of.get(&page) {
                Some(&held) if held != entry.group => {
                    return Err(format!(
                        "page {page} is cached for group {} but held by group {held}",
                        entry.group
                    ))
                }
                Some(_) => {}
                None if rc == 0 => evictable[entry.group] += 1,
                None => return Err(format!("cached page {page} has {rc} references, no table")),
            }
            for key in &entry.keys {
                if index.keys.get(key) != Some(&page) {
                    return Err(format!("page {page} lists a key that maps elsewhere"));
                }
            }
            for sibling in &entry.siblings {
                if !index.pages.contains_key(sibling) {
                    return Err(format!("checkpoint page {page} lost its sibling {sibling}"));
                }
            }
        }
        for (key, page) in &index.keys {
            let listed = index.pages.get(page).is_some_and(|e| e.keys.contains(key));
            if !listed {
                return Err(format!("a key maps to page {page}, which does not list it"));
            }
        }
        let stats = cache.stats();
        if live != stats.num_cached_blocks {
            return Err(format!(
                "the tables cached {live} pages, the pool's cache holds {}",
                stats.num_cached_blocks
            ));
        }
        let total_evictable: usize = evictable.iter().sum();
        if total_evictable != pool.num_evictable() {
            return Err(format!(
                "{total_evictable} cached pages are unheld, the pool has {} evictable",
                pool.num_evictable()
            ));
        }
        // Conservation: every page is free, or belongs to one group (used or evictable).
        let per_group: usize = used.iter().zip(&evictable).map(|(u, e)| u + e).sum();
        if pool.num_free() + per_group != pool.num_blocks() {
            return Err(format!(
                "free {} + per group (used + evictable) {per_group} != {} pages",
                pool.num_free(),
                pool.num_blocks()
            ));
        }
        self.check_host_invariants()
    }
}
