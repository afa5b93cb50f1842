//! `HybridTables`: per request and per group, the pages a request holds in one pool.
//!
//! Every mutating call validates, plans every group's change, takes all the new pages in
//! one all-or-nothing `alloc_many`, drops the released ones in one all-or-nothing
//! `free_many` (returning the new pages if that fails), and only then commits: a failed
//! call changes nothing in any group.

use std::ops::Range;
use std::sync::Arc;

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::error::CoreError;
use crate::hybrid::prefix::{PrefixIndex, RequestHashes};
use crate::hybrid::request_map::{PageIds, RequestMap};
use crate::hybrid::spec::{LiveRule, Lookback, ModelKvSpec};
use crate::hybrid::swap::{HeldPages, RequestPage, SwappedIds};
use crate::pool::{Owner, Pool};

/// One request's pages of one group: page `first_page + i` of the group's page sequence
/// is `page_ids[i]` (for a state group, `first_page` is 0 and the ids are its slot).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct GroupPages {
    pub(super) first_page: usize,
    pub(super) page_ids: PageIds,
}

/// Groups a request keeps inline, without an allocation of their own (a step reads them
/// all, `request_map.rs`): every model of `hybrid.md`'s waste table has one or two; a
/// layout with more keeps them on the heap.
const INLINE_GROUPS: usize = 2;

/// A request's table of each group, in the spec's order.
pub(super) type GroupTables = SmallVec<[GroupPages; INLINE_GROUPS]>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RequestPages {
    pub(super) num_tokens: usize,
    /// The first position whose query has not run yet: the call that brought the request
    /// to `num_tokens` started there. Window groups keep what its query and later ones see.
    pub(super) next_query: usize,
    pub(super) groups: GroupTables,
    /// The hash chain of its tokens, while they are all known and the pool caches
    /// prefixes (`prefix.rs`). It holds no page (a checkpoint's pages are the cache's, held
    /// by no request), so a swap moves it as it is (`swap.rs`). Boxed: a decode step never
    /// reads it, and inline it would spread each request over more cache lines.
    pub(super) hashes: Option<Box<RequestHashes>>,
    /// While the pool caches no prefixes: appends that keep the request at or below this
    /// many tokens only move its counters (no group's live pages change, none is copied),
    /// as computed by [`quiet_until`] when `append_many` last left it. 0 (no such append)
    /// wherever its pages change otherwise, or another request may come to share them:
    /// [`commit`], `fork` (parent and child), a swap, a new request.
    pub(super) quiet_until: usize,
}

/// A copy-on-write page copy (whole page) that must run before the call's tokens are
/// written: `dst` replaces the shared `src` in `group`'s table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCopy {
    pub group: usize,
    pub src: u32,
    pub dst: u32,
}

/// One request's table of one group, as decode metadata needs it: the token at position
/// `p` (for `first_live_token <= p < num_tokens`) is at offset `p % block_size` of page
/// `page_ids[p / block_size - first_page]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupTable<'a> {
    pub first_page: usize,
    pub page_ids: &'a [u32],
    pub num_tokens: usize,
    /// Tokens per page (`None` for a state group).
    pub block_size: Option<usize>,
}

impl GroupTable<'_> {
    /// The slot (`page_id * block_size + offset`) of token `position`, if this table holds
    /// its page.
    pub fn slot(&self, position: usize) -> Option<i64> {
        let block_size = self.block_size?;
        let index = (position / block_size).checked_sub(self.first_page)?;
        let page = *self.page_ids.get(index)?;
        Some(page as i64 * block_size as i64 + (position % block_size) as i64)
    }
}

/// Block tables of a hybrid model over one pool: each request has one table per group.
/// The tables are meant to be the pool's only user (`check_invariants` counts on it).
pub struct HybridTables {
    pub(super) pool: Arc<Pool>,
    pub(super) spec: ModelKvSpec,
    pub(super) requests: RequestMap,
    /// The keys of the cached pages, when the pool caches prefixes (`prefix.rs`).
    pub(super) index: Option<PrefixIndex>,
    /// Ids a host tier holds swapped out (`swap.rs` keeps it): not in `requests`, but not
    /// free for `add` or `fork` either, or a swap-in would find its id taken. Shared with
    /// every host tier of these tables, so that a tier dropped with requests still swapped
    /// out takes their ids out of it (the tables are not at hand in its `Drop`).
    pub(super) swapped_out: SwappedIds,
}

/// One group's change in a planned call: which of its old pages it keeps, how many new
/// pages it takes at the end, and which kept pages are shared and must be copied. Plain
/// numbers (no buffer of its own), so a step plans every request into one flat list.
#[derive(Debug, Clone, PartialEq, Eq)]
struct GroupPlan {
    /// The page index of the new table's first entry.
    first_page: usize,
    /// Indices into the old `page_ids` of the pages kept (the new table's front); the
    /// others are released.
    kept: Range<usize>,
    num_new: usize,
    /// Indices into the new table of kept pages replaced by fresh copies: a whole state
    /// slot, or a token group's partly filled page, or none.
    copies: Range<usize>,
}

impl GroupPlan {
    fn num_fresh(&self) -> usize {
        self.num_new + self.copies.len()
    }

    /// Whether the plan leaves `pages` as they are: only the request's counters move.
    fn is_unchanged(&self, pages: &GroupPages) -> bool {
        self.first_page == pages.first_page
            && self.kept == (0..pages.page_ids.len())
            && self.num_fresh() == 0
    }

    fn released<'a>(&self, pages: &'a GroupPages) -> impl Iterator<Item = u32> + 'a {
        let ids = &pages.page_ids;
        ids[..self.kept.start].iter().chain(&ids[self.kept.end..]).copied()
    }

    /// The shared pages the copies replace (the other holders keep them).
    fn copied<'a>(&self, pages: &'a GroupPages) -> &'a [u32] {
        let start = self.kept.start;
        &pages.page_ids[start + self.copies.start..start + self.copies.end]
    }
}

/// The references a batch's earlier appends drop from pages that were shared when the call
/// began (released, or copied away from), per page id: a later request of the same batch
/// plans against `ref_cnt - drops`, the count its append would see had the earlier ones
/// run before it. Only pages shared at the start are listed, so a step without forks keeps
/// it empty.
type PlannedDrops = FxHashMap<u32, u32>;

/// One request of a planned `append_many`: its row in the tables, its counters after the
/// call and its groups' plans in the step's flat plan list (none when only its counters
/// move).
struct PlannedAppend {
    row: usize,
    next_query: usize,
    num_tokens: usize,
    plans: Range<usize>,
}

impl HybridTables {
    /// Tables for `spec` over `pool`, whose blocks must be the spec's pages, with room for
    /// at least one request of one token (every state slot included).
    pub fn new(pool: Arc<Pool>, spec: ModelKvSpec) -> Result<Self, CoreError> {
        let block_bytes = pool.block_bytes();
        if block_bytes != spec.page_bytes() {
            return Err(CoreError::InvalidLayout(format!(
                "the pool's blocks are {block_bytes} bytes, the model's pages {}",
                spec.page_bytes()
            )));
        }
        let smallest = spec.pages_to_add(1);
        if smallest > pool.max_num_blocks() {
            return Err(CoreError::InvalidLayout(format!(
                "one request of one token needs {smallest} pages (state slots included), the pool \
                 holds at most {}",
                pool.max_num_blocks()
            )));
        }
        let index = pool.prefix_cache().map(|cache| PrefixIndex::new(cache.hasher()));
        Ok(HybridTables {
            pool,
            spec,
            requests: RequestMap::default(),
            index,
            swapped_out: SwappedIds::default(),
        })
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }
    pub fn spec(&self) -> &ModelKvSpec {
        &self.spec
    }
    pub fn len(&self) -> usize {
        self.requests.len()
    }
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }
    pub fn contains(&self, request_id: u64) -> bool {
        self.requests.contains_key(&request_id)
    }

    pub fn num_tokens(&self, request_id: u64) -> Result<usize, CoreError> {
        Ok(self.request(request_id)?.num_tokens)
    }

    /// `request_id`'s table of group `group`.
    pub fn table(&self, request_id: u64, group: usize) -> Result<GroupTable<'_>, CoreError> {
        let geometry = self.spec.geometry(group)?;
        let request = self.request(request_id)?;
        let pages = &request.groups[group];
        Ok(GroupTable {
            first_page: pages.first_page,
            page_ids: &pages.page_ids,
            num_tokens: request.num_tokens,
            block_size: geometry.block_size(),
        })
    }

    /// Refuses an id the tables hold, or one a host tier holds swapped out.
    pub(super) fn check_new_id(&self, request_id: u64) -> Result<(), CoreError> {
        if self.requests.contains_key(&request_id) || self.swapped_out.contains(request_id) {
            return Err(CoreError::DuplicateRequest { request_id });
        }
        Ok(())
    }

    /// Adds a request of `num_tokens` tokens: every group's pages for them (window groups
    /// keep all, since all their queries are still to run) and every state slot.
    pub fn add(&mut self, request_id: u64, num_tokens: usize) -> Result<(), CoreError> {
        self.add_at(request_id, num_tokens, 0)
    }

    /// Adds a request of `num_tokens` tokens whose queries below `next_query` have run
    /// (`next_query <= num_tokens`): every group's pages for what the queries from
    /// `next_query` on see, and every state slot, the pages a request in that position holds
    /// ([`request_pages`](Self::request_pages) lists them). The receiving end of a transfer
    /// adds the request this way and then copies its pages in; `add` is `add_at(.., 0)`.
    /// Its pages are not cached (its tokens are not known here).
    pub fn add_at(
        &mut self,
        request_id: u64,
        num_tokens: usize,
        next_query: usize,
    ) -> Result<(), CoreError> {
        self.check_new_id(request_id)?;
        if next_query > num_tokens {
            return Err(CoreError::InvalidArgument(format!(
                "request {request_id}: next_query {next_query} is past its {num_tokens} tokens"
            )));
        }
        let empty = RequestPages {
            num_tokens: 0,
            next_query: 0,
            groups: smallvec::smallvec![GroupPages::default(); self.spec.num_groups()],
            hashes: None,
            quiet_until: 0,
        };
        let mut plans = Vec::with_capacity(self.spec.num_groups());
        self.plan(&empty, num_tokens, next_query, &PlannedDrops::default(), &mut plans)?;
        let fresh = self.alloc_pages(total_fresh(&plans))?;
        let mut request = empty;
        request.num_tokens = num_tokens;
        request.next_query = next_query;
        commit(&mut request, &plans, &fresh);
        self.requests.insert(request_id, request);
        Ok(())
    }

    /// Appends `count` tokens to `request_id`, whose earlier queries have all run: window
    /// and chunk groups release the pages no query from the first new token on can see. A
    /// shared page the new tokens write (a partly filled last page, a state slot) is copied
    /// first: the returned copies must run before the tokens are written.
    ///
    /// With a prefix-caching pool, this request's later pages are not cached (their tokens
    /// are unknown); [`append_tokens`](Self::append_tokens) keeps caching them.
    pub fn append(&mut self, request_id: u64, count: usize) -> Result<Vec<PageCopy>, CoreError> {
        self.append_impl(request_id, count, None)
    }

    /// [`append`](Self::append) of `token_ids`: with a prefix-caching pool, the pages they
    /// fill are cached once they have run (at the request's next call).
    pub fn append_tokens(
        &mut self,
        request_id: u64,
        token_ids: &[u32],
    ) -> Result<Vec<PageCopy>, CoreError> {
        self.append_impl(request_id, token_ids.len(), Some(token_ids))
    }

    fn append_impl(
        &mut self,
        request_id: u64,
        count: usize,
        token_ids: Option<&[u32]>,
    ) -> Result<Vec<PageCopy>, CoreError> {
        let request = self.request(request_id)?;
        let num_tokens = request.num_tokens.checked_add(count).ok_or_else(|| {
            CoreError::InvalidArgument(format!(
                "request {request_id}: {} + {count} tokens overflow",
                request.num_tokens
            ))
        })?;
        let next_query = request.num_tokens;
        let mut plans = Vec::with_capacity(self.spec.num_groups());
        self.plan(request, num_tokens, next_query, &PlannedDrops::default(), &mut plans)?;
        if self.index.is_some() {
            // Refused before anything changes, the cache included.
            self.check_room(total_fresh(&plans), 0)?;
        }
        // Every token so far has run: cache its pages before the window lets any go.
        self.cache_ran(request_id, next_query);
        let request = self.request(request_id)?;
        // A copied page is released too: the other holders keep it.
        let released: Vec<u32> = plans
            .iter()
            .zip(&request.groups)
            .flat_map(|(plan, pages)| {
                plan.released(pages).chain(plan.copied(pages).iter().copied())
            })
            .collect();
        let fresh = self.alloc_pages(total_fresh(&plans))?;
        if let Err(e) = self.free_pages(&released) {
            // Ours alone (just allocated), so they go straight back.
            self.free_pages(&fresh).expect("returning pages just allocated");
            return Err(e);
        }
        #[cfg(feature = "internals")]
        let window_released: Vec<u32> = plans
            .iter()
            .zip(&self.requests[&request_id].groups)
            .enumerate()
            .filter(|&(g, _)| {
                matches!(
                    self.spec.groups()[g].kind,
                    crate::hybrid::GroupKind::SlidingWindow { .. }
                        | crate::hybrid::GroupKind::ChunkedLocal { .. }
                )
            })
            .flat_map(|(_, (plan, pages))| plan.released(pages).collect::<Vec<_>>())
            .collect();
        let request = self.requests.get_mut(&request_id).expect("checked above");
        let mut copies = Vec::new();
        copy_list(request, &plans, &fresh, &mut copies);
        request.num_tokens = num_tokens;
        request.next_query = next_query;
        commit(request, &plans, &fresh);
        self.hash_appended(request_id, token_ids);
        #[cfg(feature = "internals")]
        self.mutation_uncache_released(&window_released);
        Ok(copies)
    }

    /// Appends `counts[i]` tokens to `request_ids[i]` for every `i` (distinct ids), or to
    /// none of them: [`append`](Self::append) for a whole decode step, taking every new page
    /// in one allocation and dropping every released one in one free. `token_ids`, when
    /// given, are all requests' new ids concatenated in call order (as
    /// [`append_tokens`](Self::append_tokens) takes them); without, the requests' later
    /// pages are not cached. The returned copies (in call order, each request's in group
    /// order) must run before the tokens are written.
    ///
    /// A batch that succeeds is the same `append`s one after another in call order: each
    /// request is planned against the reference counts the earlier ones leave, so of a
    /// parent and a child forked from it (sharing a partly filled page or a state slot) the
    /// first listed copies the shared pages and the second, then their only holder, writes
    /// in place, as it would appended second. The tables end as those appends leave them,
    /// up to which free page ids the new pages got. It is refused, changing nothing, when
    /// the new pages all of them take exceed the free (and evictable) pages at the start:
    /// the pages an earlier request releases are not handed to a later one within the
    /// call, so a batch may be refused where appends one at a time would reuse them.
    pub fn append_many(
        &mut self,
        request_ids: &[u64],
        counts: &[usize],
        token_ids: Option<&[u32]>,
    ) -> Result<Vec<PageCopy>, CoreError> {
        if request_ids.len() != counts.len() {
            return Err(CoreError::InvalidArgument(format!(
                "{} request ids but {} counts",
                request_ids.len(),
                counts.len()
            )));
        }
        let total_tokens = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c));
        if let Some(ids) = token_ids {
            if total_tokens != Some(ids.len()) {
                let total = total_tokens.map_or_else(|| "more".to_string(), |t| t.to_string());
                return Err(CoreError::InvalidArgument(format!(
                    "{} token ids for {total} tokens (sum of counts): give one id per appended \
                     token",
                    ids.len()
                )));
            }
        }
        // Distinct ids: a strictly increasing list (a scheduler's usual order) shows it in
        // one pass; any other is sorted.
        if !request_ids.windows(2).all(|w| w[0] < w[1]) {
            let mut sorted = request_ids.to_vec();
            sorted.sort_unstable();
            if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                return Err(CoreError::InvalidArgument(format!(
                    "request {} appears twice in one append_many",
                    w[0]
                )));
            }
        }
        // Plan every request against the tables as they are, into one flat list: first
        // every lookup (a tight loop, so that their cache misses overlap), then each
        // request's plans. A decode step mostly crosses no page boundary in any group: such
        // a request gets no plans, and only its counters move at commit. The pages the
        // plans release (a copied page too: the other holders keep it) are listed here,
        // while the request is at hand.
        let mut found = Vec::with_capacity(request_ids.len());
        for (&request_id, &count) in request_ids.iter().zip(counts) {
            let row = self.row_of(request_id)?;
            let request = self.requests.row(row);
            let num_tokens = request.num_tokens.checked_add(count).ok_or_else(|| {
                CoreError::InvalidArgument(format!(
                    "request {request_id}: {} + {count} tokens overflow",
                    request.num_tokens
                ))
            })?;
            found.push((row, num_tokens));
        }
        let mut planned = Vec::with_capacity(request_ids.len());
        let mut plans = Vec::new();
        let mut released = Vec::new();
        let mut drops = PlannedDrops::default();
        let mut total = 0usize;
        for (row, num_tokens) in found {
            let request = self.requests.row(row);
            let start = plans.len();
            // The decode fast path: most requests cross no page boundary in any group, and
            // the request's own `quiet_until` says so without looking at its pages.
            let quiet = request.num_tokens < num_tokens && num_tokens <= request.quiet_until;
            if !quiet && !self.only_counters_move(request, num_tokens, &drops)? {
                let next_query = request.num_tokens;
                let changes = self.plan(request, num_tokens, next_query, &drops, &mut plans)?;
                debug_assert!(changes, "only_counters_move said some group changes");
                let mine = &plans[start..];
                total = total.saturating_add(total_fresh(mine));
                let first_released = released.len();
                for (plan, pages) in mine.iter().zip(&request.groups) {
                    released.extend(plan.released(pages));
                    released.extend_from_slice(plan.copied(pages));
                }
                // What the later requests see of the pages this one lets go.
                for &page in &released[first_released..] {
                    if self.pool.ref_cnt(page)? > 1 {
                        *drops.entry(page).or_default() += 1;
                    }
                }
            }
            let plans = start..plans.len();
            planned.push(PlannedAppend { row, next_query: request.num_tokens, num_tokens, plans });
        }
        if self.index.is_some() {
            self.check_room(total, 0)?;
            for (&request_id, request) in request_ids.iter().zip(&planned) {
                self.cache_ran(request_id, request.next_query);
            }
        }
        // Requests sharing a page (forks) release it once each: one free per repeat, since a
        // free takes each id once.
        released.sort_unstable();
        let mut rounds: Vec<Vec<u32>> = Vec::new();
        for run in released.chunk_by(|a, b| a == b) {
            for (k, &id) in run.iter().enumerate() {
                if rounds.len() == k {
                    rounds.push(Vec::new());
                }
                rounds[k].push(id);
            }
        }
        let fresh = self.alloc_pages(total)?;
        if let Some(first) = rounds.first() {
            if let Err(e) = self.free_pages(first) {
                self.free_pages(&fresh).expect("returning pages just allocated");
                return Err(e);
            }
        }
        for round in rounds.iter().skip(1) {
            // The first round's ids were ours and valid; these are further references to them.
            self.free_pages(round).expect("references the tables hold");
        }
        let caching = self.pool.prefix_cache().is_some();
        let mut copies = Vec::new();
        let mut fresh_at = 0;
        let mut offset = 0;
        for (&request_id, done) in request_ids.iter().zip(&planned) {
            // Still its row: nothing since the lookup added or removed a request.
            let request = self.requests.row_mut(done.row);
            let still_quiet = done.num_tokens <= request.quiet_until;
            request.num_tokens = done.num_tokens;
            request.next_query = done.next_query;
            let mine = &plans[done.plans.clone()];
            if !mine.is_empty() {
                let taken = total_fresh(mine);
                let fresh = &fresh[fresh_at..fresh_at + taken];
                fresh_at += taken;
                copy_list(request, mine, fresh, &mut copies);
                commit(request, mine, fresh);
            }
            // The release and copies of every request have run: its pages' reference
            // counts are the ones its next call sees. A caching pool can share a page
            // (a hit) without touching the request, so there it stays 0.
            if !caching && (!still_quiet || !mine.is_empty()) {
                request.quiet_until = quiet_until(self.spec.live_rules(), &self.pool, request);
            }
            let count = done.num_tokens - done.next_query;
            if caching {
                self.hash_appended(request_id, token_ids.map(|ids| &ids[offset..offset + count]));
            }
            offset += count;
        }
        debug_assert_eq!(fresh_at, fresh.len());
        Ok(copies)
    }

    /// Adds `child_id` sharing every page of every group of `parent_id` (copy on write).
    pub fn fork(&mut self, parent_id: u64, child_id: u64) -> Result<(), CoreError> {
        let parent = self.request(parent_id)?;
        self.check_new_id(child_id)?;
        self.share_pages(&all_pages(parent))?;
        let mut child = parent.clone();
        child.quiet_until = 0;
        self.requests.insert(child_id, child);
        // Its pages are shared now: its next append may copy.
        self.requests.get_mut(&parent_id).expect("checked above").quiet_until = 0;
        Ok(())
    }

    /// Removes a request, dropping its reference to every page of every group.
    pub fn free(&mut self, request_id: u64) -> Result<(), CoreError> {
        self.free_pages(&all_pages(self.request(request_id)?))?;
        self.requests.remove(&request_id);
        Ok(())
    }

    /// Every request's id, token count and first query still to run.
    pub(super) fn positions(&self) -> impl Iterator<Item = (u64, usize, usize)> + '_ {
        self.requests.iter().map(|(&id, r)| (id, r.num_tokens, r.next_query))
    }

    pub(super) fn request(&self, request_id: u64) -> Result<&RequestPages, CoreError> {
        Ok(self.requests.row(self.row_of(request_id)?))
    }

    /// `request_id`'s row in `requests`, valid until a request is added or removed.
    fn row_of(&self, request_id: u64) -> Result<usize, CoreError> {
        // Not `ok_or`: that builds (and drops) the error on every successful lookup.
        match self.requests.row_of(request_id) {
            Some(row) => Ok(row),
            None => Err(CoreError::UnknownRequest { request_id }),
        }
    }

    /// Pushes onto `plans` each group's change for `request` to hold `num_tokens` with
    /// queries from `next_query` on still to run, and says whether any group changes (if
    /// none, only the request's counters move). A page is shared (copied before it is
    /// written) when it has another reference beyond `drops`, those a batch's earlier
    /// requests let go. Counts only: nothing is taken.
    fn plan(
        &self,
        request: &RequestPages,
        num_tokens: usize,
        next_query: usize,
        drops: &PlannedDrops,
        plans: &mut Vec<GroupPlan>,
    ) -> Result<bool, CoreError> {
        let appending = num_tokens > request.num_tokens;
        let mut changes = false;
        let rules = self.spec.live_rules();
        debug_assert_eq!(rules.len(), request.groups.len());
        for (rule, pages) in rules.iter().zip(&request.groups) {
            let live = rule.live_pages(num_tokens, next_query);
            let old_len = pages.page_ids.len();
            // Live ranges only move forward, so the kept pages are the new table's front
            // and the new ones its back.
            let old_first = pages.first_page;
            let lo = (live.start.max(old_first) - old_first).min(old_len);
            let hi = live.end.min(old_first + old_len).saturating_sub(old_first).clamp(lo, old_len);
            let mut plan = GroupPlan {
                first_page: live.start,
                kept: lo..hi,
                num_new: live.len() - (hi - lo),
                copies: 0..0,
            };
            match *rule {
                LiveRule::State { .. } => {
                    if appending && old_len > 0 && self.is_shared(pages.page_ids[0], drops)? {
                        plan.copies = 0..old_len;
                    }
                }
                LiveRule::Tokens { block_size, .. } => {
                    // The page the first new token goes to, if it is partly filled already.
                    let written = block_size.div(request.num_tokens);
                    let partly_filled = block_size.rem(request.num_tokens) != 0;
                    let index = written.wrapping_sub(old_first);
                    if appending
                        && partly_filled
                        && plan.kept.contains(&index)
                        && self.is_shared(pages.page_ids[index], drops)?
                    {
                        plan.copies = index - lo..index - lo + 1;
                    }
                }
            }
            changes |= !plan.is_unchanged(pages);
            plans.push(plan);
        }
        Ok(changes)
    }

    /// Whether appending to `request` up to `num_tokens` (its queries from its current end
    /// on still to run) leaves every group's table as it is: no page enters or leaves the
    /// live range and none is copied, so only its counters move. Exactly when
    /// [`plan`](Self::plan) would plan no change, in fewer steps: a decode step asks it of
    /// every request, and it builds nothing.
    fn only_counters_move(
        &self,
        request: &RequestPages,
        num_tokens: usize,
        drops: &PlannedDrops,
    ) -> Result<bool, CoreError> {
        let old_tokens = request.num_tokens;
        let appending = num_tokens > old_tokens;
        for (rule, pages) in self.spec.live_rules().iter().zip(&request.groups) {
            let live = rule.live_pages(num_tokens, old_tokens);
            if live.start != pages.first_page || live.end != pages.first_page + pages.page_ids.len()
            {
                return Ok(false);
            }
            if !appending {
                continue;
            }
            // The kept page the new tokens write into, which `plan` copies if it is shared:
            // a state slot (its first page tells), or a token group's partly filled page.
            let written = match *rule {
                LiveRule::State { .. } => pages.page_ids.first().copied(),
                LiveRule::Tokens { block_size, .. } if block_size.rem(old_tokens) != 0 => {
                    let index = block_size.div(old_tokens).wrapping_sub(pages.first_page);
                    // The last page (always, for a table that covers its live range): read
                    // from the copy in the request's row, not from the page list.
                    if index.wrapping_add(1) == pages.page_ids.len() {
                        pages.page_ids.last_id()
                    } else {
                        pages.page_ids.get(index).copied()
                    }
                }
                LiveRule::Tokens { .. } => None,
            };
            if let Some(page) = written {
                if self.is_shared(page, drops)? {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Every request's `quiet_until` promises no more than its pages allow now
    /// ([`check_invariants`](Self::check_invariants)).
    pub(super) fn check_quiet_until(&self) -> Result<(), String> {
        let rules = self.spec.live_rules();
        for (&request_id, request) in self.requests.iter() {
            let promised = request.quiet_until;
            if promised > request.num_tokens && promised > quiet_until(rules, &self.pool, request) {
                return Err(format!(
                    "request {request_id}: quiet until {promised} tokens, its pages allow {}",
                    quiet_until(rules, &self.pool, request)
                ));
            }
        }
        Ok(())
    }

    /// Whether `page_id` has a holder besides the request asking, once `drops` (a batch's
    /// earlier requests' releases) are taken off. The map is looked at only for a page
    /// shared now, so a step without forks never hashes.
    #[inline]
    fn is_shared(&self, page_id: u32, drops: &PlannedDrops) -> Result<bool, CoreError> {
        let refs = self.pool.ref_cnt(page_id)?;
        Ok(refs > 1 && shared_beyond_drops(page_id, refs, drops))
    }
}

/// Whether a page of `refs` references keeps another holder once `drops` are taken off.
/// Out of line and cold: only a page shared now gets here, and keeping the map lookup out
/// of [`HybridTables::is_shared`] lets the decode fast path inline it (callgrind counted
/// 14k more instructions a 256-request step with the lookup inline, the check called
/// out of line).
#[cold]
#[inline(never)]
fn shared_beyond_drops(page_id: u32, refs: u32, drops: &PlannedDrops) -> bool {
    refs.saturating_sub(drops.get(&page_id).copied().unwrap_or(0)) > 1
}

/// The fresh pages `plans` take. Saturating: a sum past `usize::MAX` is refused by
/// `alloc_many` as more than the pool can ever hold, before anything is sized for it.
fn total_fresh(plans: &[GroupPlan]) -> usize {
    plans.iter().map(GroupPlan::num_fresh).fold(0, usize::saturating_add)
}

/// Every page a request references, once per reference.
fn all_pages(request: &RequestPages) -> Vec<u32> {
    request.groups.iter().flat_map(|g| g.page_ids.iter().copied()).collect()
}

/// Pushes onto `copies` the copies `plans` call for, with the fresh pages they take: each
/// group's share of `fresh` starts with its copy destinations (see [`commit`]).
fn copy_list(
    request: &RequestPages,
    plans: &[GroupPlan],
    fresh: &[u32],
    copies: &mut Vec<PageCopy>,
) {
    let mut next = 0;
    for (group, (plan, pages)) in plans.iter().zip(&request.groups).enumerate() {
        let destinations = &fresh[next..next + plan.copies.len()];
        for (&src, &dst) in plan.copied(pages).iter().zip(destinations) {
            copies.push(PageCopy { group, src, dst });
        }
        next += plan.num_fresh();
    }
}

/// The most tokens `request` (its pages and counters as they are, its next query at its end)
/// can reach through appends that only move its counters: no group's live range changes
/// for any query from its end on below the new length, and no page the appends write
/// (a token group's partly filled last page, a state slot) is shared. 0 when its next
/// append changes something, or when that is not cheap to tell (an empty table).
fn quiet_until(rules: &[LiveRule], pool: &Pool, request: &RequestPages) -> usize {
    let n = request.num_tokens;
    let shared = |page: u32| pool.ref_cnt(page).map_or(true, |refs| refs > 1);
    let mut limit = usize::MAX;
    for (rule, pages) in rules.iter().zip(&request.groups) {
        let (first, len) = (pages.first_page, pages.page_ids.len());
        match *rule {
            LiveRule::State { .. } => {
                if pages.page_ids.first().is_some_and(|&p| shared(p)) {
                    return 0;
                }
            }
            LiveRule::Tokens { block_size, sees } => {
                // The next token goes into the last page, which has room left.
                let Some(last) = pages.page_ids.last_id() else { return 0 };
                if block_size.rem(n) == 0 || block_size.div(n) != first + len - 1 || shared(last) {
                    return 0;
                }
                let bs = block_size.value();
                // Past the last page a new one is taken.
                let mut group_limit = (first + len) * bs;
                // The queries from n on must keep `first` as the first live page.
                match sees {
                    Lookback::All => {
                        if first != 0 {
                            return 0;
                        }
                    }
                    Lookback::Window(window) => {
                        let first_live = n.saturating_add(1).saturating_sub(window);
                        if block_size.div(first_live) != first {
                            return 0;
                        }
                        // The query at q sees from q + 1 - window: page `first` stays the
                        // first live one while q + 1 - window < (first + 1) * bs.
                        group_limit = group_limit.min((first + 1) * bs + window - 1);
                    }
                    Lookback::Chunk(chunk) => {
                        if block_size.div(n - chunk.rem(n)) != first {
                            return 0;
                        }
                        // Up to the next chunk's start, the queries' chunk is the same.
                        group_limit = group_limit.min(n - chunk.rem(n) + chunk.value());
                    }
                }
                limit = limit.min(group_limit);
            }
        }
    }
    if limit > n {
        limit
    } else {
        0
    }
}

/// Applies `plans` to `request`, handing out `fresh` in group order: each group's copy
/// destinations, then its new pages, and forgets its `quiet_until`. Cannot fail.
fn commit(request: &mut RequestPages, plans: &[GroupPlan], fresh: &[u32]) {
    request.quiet_until = 0;
    let mut fresh = fresh.iter().copied();
    for (plan, pages) in plans.iter().zip(&mut request.groups) {
        pages.page_ids.edit(|ids| {
            ids.truncate(plan.kept.end);
            ids.drain(..plan.kept.start);
            for index in plan.copies.clone() {
                ids[index] = fresh.next().expect("planned copy");
            }
            ids.extend(fresh.by_ref().take(plan.num_new));
        });
        pages.first_page = plan.first_page;
    }
    debug_assert!(fresh.next().is_none());
}

/// Swaps and transfers (`swap.rs`): a request's pages as one list, a request taken out of the
/// tables or put back with its references, and the tagged pool calls every method above
/// allocates, shares and frees through (`Owner::HybridTables`: `Pool::free` and
/// `Pool::share_many` refuse these pages).
impl HybridTables {
    /// Every page `request_id` holds, in a stable order a transfer or a swap can rely on:
    /// group by group in the spec's order, each group's pages in page order (`page_index`
    /// ascending from the table's `first_page`; a state slot's pages from 0), each entry
    /// naming its group, page index and page id. Moving these pages and rebuilding each
    /// group's table from `page_index` moves every group of the request.
    pub fn request_pages(&self, request_id: u64) -> Result<Vec<RequestPage>, CoreError> {
        Ok(Self::page_list(self.request(request_id)?))
    }

    /// The first position of `request_id` whose query has not run yet.
    pub fn next_query(&self, request_id: u64) -> Result<usize, CoreError> {
        Ok(self.request(request_id)?.next_query)
    }

    /// `request`'s pages in [`request_pages`](Self::request_pages)'s order. A field that
    /// comes to hold pages must be listed here and in [`attach`](Self::attach) alike.
    pub(super) fn page_list(request: &RequestPages) -> Vec<RequestPage> {
        let mut pages = Vec::new();
        for (group, held) in request.groups.iter().enumerate() {
            pages.extend(held.page_ids.iter().enumerate().map(|(i, &page_id)| RequestPage {
                group,
                page_index: held.first_page + i,
                page_id,
            }));
        }
        pages
    }

    /// `request`'s tokens, first query still to run and pages.
    pub(super) fn held_pages(request: &RequestPages) -> HeldPages {
        HeldPages {
            num_tokens: request.num_tokens,
            next_query: request.next_query,
            pages: Self::page_list(request),
        }
    }

    /// Takes `request_id` out of the tables with its page references, which are the
    /// caller's now (a swap-out frees them once their bytes are copied).
    pub(super) fn detach(&mut self, request_id: u64) -> Result<RequestPages, CoreError> {
        self.requests.remove(&request_id).ok_or(CoreError::UnknownRequest { request_id })
    }

    /// `request` with its pages replaced, in [`page_list`](Self::page_list)'s order, by
    /// `page_ids` (one per page; every table keeps its `first_page`).
    pub(super) fn with_page_ids(mut request: RequestPages, page_ids: &[u32]) -> RequestPages {
        request.quiet_until = 0;
        let mut ids = page_ids.iter();
        for held in &mut request.groups {
            held.page_ids.edit(|held_ids| {
                for id in held_ids {
                    *id = *ids.next().expect("one new id per page");
                }
            });
        }
        debug_assert!(ids.next().is_none(), "one new id per page");
        request
    }

    /// Puts `request` into the tables as `request_id` (absent: the caller checked), taking
    /// over its page references (allocated from this pool with `Owner::HybridTables`).
    pub(super) fn attach(&mut self, request_id: u64, request: RequestPages) {
        let previous = self.requests.insert(request_id, request);
        debug_assert!(previous.is_none(), "attach of a request the tables hold");
    }

    /// `count` new pages, all or none, tagged as the hybrid tables' (a growable pool grows).
    /// The one allocation path of the tables: with prefix caching, the tables first evict
    /// what the free list lacks themselves ([`make_room`](Self::make_room)).
    pub(super) fn alloc_pages(&mut self, count: usize) -> Result<Vec<u32>, CoreError> {
        self.make_room(count)?;
        self.pool.alloc_many_for(count, Owner::HybridTables)
    }

    /// Drops one reference to each page, all or none; a page not the hybrid tables' is
    /// refused. A cached page's last reference makes it evictable (its tag stays).
    pub(super) fn free_pages(&self, page_ids: &[u32]) -> Result<(), CoreError> {
        self.pool.free_many_for(page_ids, Owner::HybridTables)
    }

    /// Adds one reference to each page, all or none; a page not the hybrid tables' is refused.
    fn share_pages(&self, page_ids: &[u32]) -> Result<(), CoreError> {
        self.pool.share_many_for(page_ids, Owner::HybridTables)
    }
}

#[cfg(test)]
#[path = "tables_tests.rs"]
mod tests;
