//! A state machine over `HybridTables` on a mixed layout (full + sliding window + state +
//! MLA + chunked local): random add / append / fork / free, including calls that must fail,
//! checked after every call against a plain model that knows which keys each query sees
//! and which pages are shared:
//!
//! - every table holds exactly the pages that hold a token some query still to run sees
//!   (so a window or chunk group never holds a page no query can see);
//! - the pages are shared exactly as the model's (fork shares, a write copies);
//! - `free + used == total` over the slab, and `check_invariants` holds;
//! - a call fails exactly when the model says it must, and then changes nothing;
//! - once every request is freed, every page is free.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

use kvpool_core::hybrid::{HybridTables, ModelKvSpec};
use kvpool_core::pool::PoolSize;
use kvpool_core::{CoreError, DType, Device, KvLayout, Pool};

#[path = "common/hybrid.rs"]
mod hybrid_common;
use hybrid_common::PAGE_BYTES;

const NUM_PAGES: usize = 48;
const NUM_IDS: u64 = 4;

/// Tokens per page 4, 4, -, 2 and 4; a window of 5 (not a multiple of its page), a state
/// of 2 pages, chunks of 6.
fn mixed_spec() -> ModelKvSpec {
    hybrid_common::mixed_spec(5, 6)
}

/// What the model knows of a group: which keys a query sees, and its page size.
#[derive(Clone, Copy)]
enum Visibility {
    All { block_size: usize },
    Window { window: usize, block_size: usize },
    Chunk { chunk: usize, block_size: usize },
    State { pages: usize },
}

const GROUPS: [Visibility; 5] = [
    Visibility::All { block_size: 4 },
    Visibility::Window { window: 5, block_size: 4 },
    Visibility::State { pages: 2 },
    Visibility::All { block_size: 2 },
    Visibility::Chunk { chunk: 6, block_size: 4 },
];

/// Whether the query at position `query` attends to the key at position `key`.
fn sees(visibility: Visibility, query: usize, key: usize) -> bool {
    key <= query
        && match visibility {
            Visibility::All { .. } | Visibility::State { .. } => true,
            Visibility::Window { window, .. } => query - key < window,
            Visibility::Chunk { chunk, .. } => query / chunk == key / chunk,
        }
}

/// The pages holding a token that some query from `next_query` on sees (found by trying
/// the queries, not by a formula), or the state slot.
fn live_pages(visibility: Visibility, num_tokens: usize, next_query: usize) -> Range<usize> {
    let block_size = match visibility {
        Visibility::State { pages } => return 0..pages,
        Visibility::All { block_size }
        | Visibility::Window { block_size, .. }
        | Visibility::Chunk { block_size, .. } => block_size,
    };
    let seen =
        |key: usize| (next_query.max(key)..num_tokens + 16).any(|q| sees(visibility, q, key));
    let live: Vec<usize> = (0..num_tokens.div_ceil(block_size))
        .filter(|&page| (page * block_size..((page + 1) * block_size).min(num_tokens)).any(seen))
        .collect();
    match (live.first(), live.last()) {
        (Some(&first), Some(&last)) => {
            assert_eq!(live.len(), last - first + 1, "live pages are contiguous");
            first..last + 1
        }
        _ => 0..0,
    }
}

/// A page of the model: its identity only.
type ModelPage = u64;

#[derive(Clone, Debug)]
struct ModelRequest {
    num_tokens: usize,
    /// Per group: the first page index and the pages.
    groups: Vec<(usize, Vec<ModelPage>)>,
}

#[derive(Default, Debug)]
struct Model {
    requests: BTreeMap<u64, ModelRequest>,
    ref_cnt: BTreeMap<ModelPage, usize>,
    next_page: ModelPage,
}

/// One group's new table in the model: its first page index, its pages (`None`: a fresh
/// one, a copy included) and the pages it lets go.
struct ModelGroupPlan {
    first_page: usize,
    table: Vec<Option<ModelPage>>,
    released: Vec<ModelPage>,
}

#[derive(Clone, Debug)]
enum Op {
    Add { id: u64, num_tokens: usize },
    Append { id: u64, count: usize },
    Fork { parent: u64, child: u64 },
    Free { id: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0..NUM_IDS;
    prop_oneof![
        3 => (id.clone(), 0..16usize).prop_map(|(id, num_tokens)| Op::Add { id, num_tokens }),
        5 => (id.clone(), prop_oneof![3 => 0..3usize, 1 => 0..14usize])
            .prop_map(|(id, count)| Op::Append { id, count }),
        1 => (id.clone(), id.clone()).prop_map(|(parent, child)| Op::Fork { parent, child }),
        1 => id.prop_map(|id| Op::Free { id }),
    ]
}

impl Model {
    fn num_free(&self) -> usize {
        NUM_PAGES - self.ref_cnt.len()
    }

    fn fresh(&mut self) -> ModelPage {
        self.next_page += 1;
        self.ref_cnt.insert(self.next_page, 1);
        self.next_page
    }

    fn drop_ref(&mut self, page: ModelPage) {
        let count = self.ref_cnt.get_mut(&page).unwrap();
        *count -= 1;
        if *count == 0 {
            self.ref_cnt.remove(&page);
        }
    }

    /// Each group's new table for `request` grown to `num_tokens` (queries from
    /// `next_query` on to run). Fresh pages are only counted here.
    fn plan(
        &self,
        request: &ModelRequest,
        num_tokens: usize,
        next_query: usize,
    ) -> Vec<ModelGroupPlan> {
        let appending = num_tokens > request.num_tokens;
        GROUPS
            .iter()
            .zip(&request.groups)
            .map(|(&visibility, (old_first, old))| {
                let live = live_pages(visibility, num_tokens, next_query);
                let mut table = Vec::new();
                let mut released = Vec::new();
                for (k, &page) in (*old_first..).zip(old) {
                    if !live.contains(&k) {
                        released.push(page);
                    }
                }
                for k in live.clone() {
                    let old_page = k.checked_sub(*old_first).and_then(|i| old.get(i)).copied();
                    let written = match visibility {
                        Visibility::State { .. } => appending,
                        Visibility::All { block_size }
                        | Visibility::Window { block_size, .. }
                        | Visibility::Chunk { block_size, .. } => {
                            appending
                                && request.num_tokens % block_size != 0
                                && k == request.num_tokens / block_size
                        }
                    };
                    match old_page {
                        Some(page) if written && self.ref_cnt[&page] > 1 => {
                            released.push(page);
                            table.push(None);
                        }
                        page => table.push(page),
                    }
                }
                ModelGroupPlan { first_page: live.start, table, released }
            })
            .collect()
    }

    /// Applies `op` if it must succeed; otherwise says which error it must fail with.
    fn apply(&mut self, op: &Op) -> Result<(), &'static str> {
        match *op {
            Op::Add { id, num_tokens } => {
                if self.requests.contains_key(&id) {
                    return Err("duplicate");
                }
                let empty =
                    ModelRequest { num_tokens: 0, groups: vec![(0, Vec::new()); GROUPS.len()] };
                self.grow(id, empty, num_tokens, 0)
            }
            Op::Append { id, count } => {
                let request = self.requests.get(&id).ok_or("unknown")?.clone();
                let next_query = request.num_tokens;
                self.grow(id, request, next_query + count, next_query)
            }
            Op::Fork { parent, child } => {
                let request = self.requests.get(&parent).ok_or("unknown")?.clone();
                if self.requests.contains_key(&child) {
                    return Err("duplicate");
                }
                for (_, pages) in &request.groups {
                    for page in pages {
                        *self.ref_cnt.get_mut(page).unwrap() += 1;
                    }
                }
                self.requests.insert(child, request);
                Ok(())
            }
            Op::Free { id } => {
                let request = self.requests.remove(&id).ok_or("unknown")?;
                for (_, pages) in request.groups {
                    for page in pages {
                        self.drop_ref(page);
                    }
                }
                Ok(())
            }
        }
    }

    fn grow(
        &mut self,
        id: u64,
        request: ModelRequest,
        num_tokens: usize,
        next_query: usize,
    ) -> Result<(), &'static str> {
        let plans = self.plan(&request, num_tokens, next_query);
        let needed: usize =
            plans.iter().map(|plan| plan.table.iter().filter(|p| p.is_none()).count()).sum();
        if needed > self.num_free() {
            return Err("out of blocks");
        }
        let mut groups = Vec::new();
        for plan in plans {
            for page in plan.released {
                self.drop_ref(page);
            }
            let pages = plan.table.into_iter().map(|p| p.unwrap_or_else(|| self.fresh())).collect();
            groups.push((plan.first_page, pages));
        }
        self.requests.insert(id, ModelRequest { num_tokens, groups });
        Ok(())
    }
}

/// Runs `op`; returns the number of copies it asked for.
fn run(tables: &mut HybridTables, op: &Op) -> Result<usize, CoreError> {
    match *op {
        Op::Add { id, num_tokens } => tables.add(id, num_tokens).map(|()| 0),
        Op::Append { id, count } => tables.append(id, count).map(|copies| copies.len()),
        Op::Fork { parent, child } => tables.fork(parent, child).map(|()| 0),
        Op::Free { id } => tables.free(id).map(|()| 0),
    }
}

/// The sum over requests of group `group`'s first page index: it grows when a table
/// releases pages from its front.
fn first_pages(tables: &HybridTables, group: usize) -> usize {
    (0..NUM_IDS).filter_map(|id| tables.table(id, group).ok()).map(|t| t.first_page).sum()
}

fn error_kind(error: &CoreError) -> &'static str {
    match error {
        CoreError::OutOfBlocks { .. } => "out of blocks",
        CoreError::DuplicateRequest { .. } => "duplicate",
        CoreError::UnknownRequest { .. } => "unknown",
        other => panic!("unexpected error {other:?}"),
    }
}

/// Every table of every id, and the pool's counts.
fn snapshot(tables: &HybridTables) -> Vec<String> {
    let mut out = vec![format!("free {}", tables.pool().num_free())];
    for id in 0..NUM_IDS {
        for g in 0..GROUPS.len() {
            out.push(format!("{:?}", tables.table(id, g).ok()));
        }
    }
    out.extend((0..NUM_PAGES as u32).map(|p| format!("{:?}", tables.pool().ref_cnt(p))));
    out
}

/// The tables against the model: the same requests and token counts, every table the
/// model's pages at the model's place, and the same sharing (one real page per model page).
fn compare(tables: &HybridTables, model: &Model) {
    tables.check_invariants().unwrap();
    let pool = tables.pool();
    assert_eq!(pool.num_free() + pool.num_used(), pool.num_blocks());
    assert_eq!(pool.num_free(), model.num_free());
    let mut real_of: BTreeMap<ModelPage, u32> = BTreeMap::new();
    let mut model_of: BTreeMap<u32, ModelPage> = BTreeMap::new();
    for id in 0..NUM_IDS {
        let Some(request) = model.requests.get(&id) else {
            assert!(!tables.contains(id));
            continue;
        };
        assert_eq!(tables.num_tokens(id).unwrap(), request.num_tokens);
        for (g, (first, pages)) in request.groups.iter().enumerate() {
            let table = tables.table(id, g).unwrap();
            assert_eq!(table.page_ids.len(), pages.len(), "request {id} group {g}");
            if !pages.is_empty() {
                assert_eq!(table.first_page, *first, "request {id} group {g}");
            }
            for (&real, &page) in table.page_ids.iter().zip(pages) {
                assert_eq!(
                    *real_of.entry(page).or_insert(real),
                    real,
                    "one real page per model page"
                );
                assert_eq!(
                    *model_of.entry(real).or_insert(page),
                    page,
                    "one model page per real page"
                );
                assert_eq!(pool.ref_cnt(real).unwrap() as usize, model.ref_cnt[&page]);
            }
        }
    }
}

/// How often the runs met what they are meant to test.
#[derive(Default, Debug)]
struct Coverage {
    succeeded: usize,
    out_of_blocks: usize,
    other_failures: usize,
    copies: usize,
    window_releases: usize,
    chunk_releases: usize,
}

fn check_run(ops: &[Op], coverage: &mut Coverage) -> Result<(), TestCaseError> {
    let spec = mixed_spec();
    let pool = Arc::new(Pool::new(&spec, PoolSize::NumBlocks(NUM_PAGES), Device::Host).unwrap());
    let mut tables = HybridTables::new(pool, spec).unwrap();
    let mut model = Model::default();
    for op in ops {
        let before = snapshot(&tables);
        let expected = model.apply(op);
        let window_first = first_pages(&tables, 1);
        let chunk_first = first_pages(&tables, 4);
        let actual = run(&mut tables, op);
        match (&actual, op) {
            (Ok(copies), _) => {
                coverage.succeeded += 1;
                coverage.copies += copies;
            }
            (Err(CoreError::OutOfBlocks { .. }), _) => coverage.out_of_blocks += 1,
            (Err(_), _) => coverage.other_failures += 1,
        }
        if actual.is_ok() && matches!(op, Op::Append { .. }) {
            coverage.window_releases += (first_pages(&tables, 1) > window_first) as usize;
            coverage.chunk_releases += (first_pages(&tables, 4) > chunk_first) as usize;
        }
        prop_assert_eq!(actual.as_ref().map_err(error_kind).err(), expected.err(), "{:?}", op);
        if actual.is_err() {
            prop_assert_eq!(snapshot(&tables), before, "a failed {:?} changed something", op);
        }
        compare(&tables, &model);
    }
    for id in 0..NUM_IDS {
        if tables.contains(id) {
            tables.free(id).unwrap();
        }
    }
    tables.check_invariants().unwrap();
    prop_assert_eq!(tables.pool().num_free(), NUM_PAGES, "pages leaked");
    Ok(())
}

#[test]
fn random_calls_on_a_mixed_layout_match_the_model() {
    // A fixed seed: the same cases every run.
    let config = Config { cases: 256, failure_persistence: None, ..Config::default() };
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]);
    let mut runner = TestRunner::new_with_rng(config, rng);
    let coverage = std::cell::RefCell::new(Coverage::default());
    runner
        .run(&proptest::collection::vec(op(), 1..60), |ops| {
            check_run(&ops, &mut coverage.borrow_mut())
        })
        .unwrap();
    // The runs did meet every case they check.
    let c = coverage.into_inner();
    assert!(
        c.succeeded > 2000
            && c.out_of_blocks > 50
            && c.other_failures > 200
            && c.copies > 100
            && c.window_releases > 500
            && c.chunk_releases > 100,
        "{c:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Prefix caching across groups.
//
// A second machine over a caching pool: requests are added and appended with token ids
// drawn from a few shared streams (so prompts share prefixes), checkpointed, declared
// computed, forked and freed. The test plays the device: it runs every copy a call returns
// on the host slab, checks that every key the call's queries see (and every resumed state)
// holds the value of exactly that token's prefix in that group, then writes the values of
// the tokens the call computes. Against a plain model that keeps the cached keys as token
// prefixes:
//
// - the hit is exactly the model's while nothing was evicted (a roomy pool), and never more
//   than the model's (a tight pool, where pages are evicted);
// - every served key and state reads back the bytes of its own prefix and group (a hit from
//   another group, or a state resumed from the wrong place, reads other bytes);
// - every table holds exactly the pages some query still to run sees;
// - `check_invariants` (per group: used + evictable; free + all of it == total) after every
//   call, and a failed call changes nothing;
// - once every request is freed nothing is used, and a cache reset frees every page.
// ---------------------------------------------------------------------------------------

use std::collections::HashSet;

use kvpool_core::hybrid::{mutation, PageCopy, HASH_CHUNK_TOKENS};
use kvpool_core::layout::KvPart;
use kvpool_core::tables::PromptKey;

const C: usize = HASH_CHUNK_TOKENS;
/// Request ids of the cached machine: enough that adds find a free one.
const CACHED_IDS: u64 = 8;
/// Pages of a pool the cached machine never fills.
const ROOMY: usize = 4096;
const WINDOW: usize = 20;
const CHUNK: usize = 24;

const WITH_STATE: [Visibility; 5] = [
    Visibility::All { block_size: 21 },
    Visibility::Window { window: WINDOW, block_size: 5 },
    Visibility::State { pages: 2 },
    Visibility::All { block_size: 2 },
    Visibility::Chunk { chunk: CHUNK, block_size: 4 },
];
const WITHOUT_STATE: [Visibility; 4] = [
    Visibility::All { block_size: 21 },
    Visibility::Window { window: WINDOW, block_size: 5 },
    Visibility::All { block_size: 2 },
    Visibility::Chunk { chunk: CHUNK, block_size: 4 },
];

/// A 64-bit mix (splitmix64's finaliser).
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_add(0x9e37_79b9_7f4a_7c15).wrapping_add(a << 6);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A request of the caching model: its tokens, how they continue, and what the tables know.
#[derive(Clone, Debug)]
struct CachedRequest {
    tokens: Vec<u32>,
    /// `prefix[p]`: a hash of `tokens[..=p]`, so a value names its whole prefix.
    prefix: Vec<u64>,
    family: u32,
    /// Tokens below this follow the family's stream; the others the request's variant.
    diverge: usize,
    variant: u32,
    next_query: usize,
    /// The tables know every token (added and appended with ids).
    known: bool,
    /// Keys are registered up to here.
    registered: usize,
}

impl CachedRequest {
    fn token(&self, p: usize) -> u32 {
        if p < self.diverge {
            self.family << 16 | p as u32
        } else {
            0x8000_0000 | self.variant << 16 | p as u32
        }
    }

    fn push_tokens(&mut self, count: usize) -> Vec<u32> {
        let new: Vec<u32> =
            (self.tokens.len()..self.tokens.len() + count).map(|p| self.token(p)).collect();
        for &t in &new {
            let before = self.prefix.last().copied().unwrap_or(0x5eed);
            self.prefix.push(mix(before, t as u64));
            self.tokens.push(t);
        }
        new
    }

    fn num_tokens(&self) -> usize {
        self.tokens.len()
    }
}

/// The model: the requests, and the cached keys as (group, page index, prefix hash at the
/// boundary) and the checkpoints as (group, prefix hash).
#[derive(Default)]
struct CacheModel {
    groups: &'static [Visibility],
    requests: BTreeMap<u64, CachedRequest>,
    keys: HashSet<(usize, usize, u64)>,
    checkpoints: HashSet<(usize, u64)>,
}

#[derive(Clone, Debug)]
enum CachedOp {
    Add {
        id: u64,
        family: u32,
        diverge: usize,
        variant: u32,
        len: usize,
    },
    AddWithoutIds {
        id: u64,
        len: usize,
    },
    Append {
        id: u64,
        count: usize,
    },
    AppendWithoutIds {
        id: u64,
        count: usize,
    },
    /// Appends up to the next chunk boundary (1 to 16 tokens), where checkpoints go.
    ToBoundary {
        id: u64,
    },
    Checkpoint {
        id: u64,
    },
    Computed {
        id: u64,
    },
    Fork {
        parent: u64,
        child: u64,
    },
    Free {
        id: u64,
    },
}

/// One call, or a few that belong together (a checkpoint right after reaching a boundary).
fn cached_ops() -> impl Strategy<Value = Vec<CachedOp>> {
    let id = 0..CACHED_IDS;
    prop_oneof![
        3 => cached_op(),
        1 => id.prop_map(|id| vec![CachedOp::ToBoundary { id }, CachedOp::Checkpoint { id }]),
    ]
}

/// [`cached_ops`], and now and then a round that sends a cached prompt to the host tier and
/// back: a request computes 48 tokens, checkpoints and ends, one without ids takes most of
/// the pool (evicting, so spilling, its pages), ends, and a prompt sharing the 48 tokens comes.
fn cached_ops_with_spills() -> impl Strategy<Value = Vec<CachedOp>> {
    let id = 0..CACHED_IDS;
    let round = (id.clone(), id, 0..2u32, 40..70usize).prop_map(|(a, b, family, big)| {
        let (diverge, len) = (72, 47);
        vec![
            CachedOp::Add { id: a, family, diverge, variant: 0, len },
            CachedOp::ToBoundary { id: a },
            CachedOp::Checkpoint { id: a },
            CachedOp::Free { id: a },
            CachedOp::AddWithoutIds { id: b, len: big },
            CachedOp::Free { id: b },
            CachedOp::Add { id: a, family, diverge: 48, variant: 1, len: 60 },
        ]
    });
    prop_oneof![8 => cached_ops(), 1 => round]
}

fn cached_op() -> impl Strategy<Value = Vec<CachedOp>> {
    let id = 0..CACHED_IDS;
    // Prompts diverge from their family's stream at a few places, so they share prefixes.
    let diverge = prop_oneof![Just(24usize), Just(40), Just(72)];
    prop_oneof![
        6 => (id.clone(), 0..2u32, diverge, 0..2u32, 1..72usize).prop_map(
            |(id, family, diverge, variant, len)| CachedOp::Add { id, family, diverge, variant, len }
        ),
        1 => (id.clone(), 1..20usize).prop_map(|(id, len)| CachedOp::AddWithoutIds { id, len }),
        4 => (id.clone(), prop_oneof![2 => 0..3usize, 1 => 0..20usize])
            .prop_map(|(id, count)| CachedOp::Append { id, count }),
        1 => (id.clone(), 0..3usize).prop_map(|(id, count)| CachedOp::AppendWithoutIds { id, count }),
        3 => id.clone().prop_map(|id| CachedOp::ToBoundary { id }),
        3 => id.clone().prop_map(|id| CachedOp::Checkpoint { id }),
        2 => id.clone().prop_map(|id| CachedOp::Computed { id }),
        1 => (id.clone(), id.clone()).prop_map(|(parent, child)| CachedOp::Fork { parent, child }),
        3 => id.prop_map(|id| CachedOp::Free { id }),
    ]
    .prop_map(|op| vec![op])
}

fn block_size_of(visibility: Visibility) -> Option<usize> {
    match visibility {
        Visibility::State { .. } => None,
        Visibility::All { block_size }
        | Visibility::Window { block_size, .. }
        | Visibility::Chunk { block_size, .. } => Some(block_size),
    }
}

impl CacheModel {
    /// Registers `id`'s keys up to `upto` (its tokens below have run): for each boundary
    /// `b`, each page `k` in the table now with `k * bs < b <= ceil16((k + 1) * bs)`.
    fn register(&mut self, id: u64, upto: usize) {
        let request = &self.requests[&id];
        if !request.known {
            return;
        }
        let upto = upto / C * C;
        let n = request.num_tokens();
        let mut new = Vec::new();
        for b in (request.registered + C..=upto).step_by(C) {
            for (g, &visibility) in self.groups.iter().enumerate() {
                let Some(bs) = block_size_of(visibility) else { continue };
                for k in live_pages(visibility, n, request.next_query) {
                    if k * bs < b && b <= ((k + 1) * bs).div_ceil(C) * C {
                        new.push((g, k, request.prefix[b - 1]));
                    }
                }
            }
        }
        self.keys.extend(new);
        let request = self.requests.get_mut(&id).unwrap();
        request.registered = request.registered.max(upto);
    }

    /// The longest hit every group can serve for `tokens`' prefixes `prefix`.
    fn hit(&self, prefix: &[u64]) -> usize {
        let n = prefix.len();
        let mut h = n.saturating_sub(1) / C * C;
        while h > 0 {
            let serves = self.groups.iter().enumerate().all(|(g, &visibility)| {
                let Some(bs) = block_size_of(visibility) else {
                    return self.checkpoints.contains(&(g, prefix[h - 1]));
                };
                live_pages(visibility, h, h).all(|k| {
                    let end = (k + 1) * bs;
                    let b = if end <= h { end.div_ceil(C) * C } else { h };
                    self.keys.contains(&(g, k, prefix[b - 1]))
                })
            });
            if serves {
                return h;
            }
            h -= C;
        }
        0
    }
}

/// The value the test writes for token `p` of `request` in group `group`: it names the
/// group and the token's whole prefix.
fn token_value(request: &CachedRequest, group: usize, p: usize) -> u64 {
    mix(request.prefix[p], group as u64 + 1)
}

/// The value of a state after the first `t` tokens (`t > 0`).
fn state_value(request: &CachedRequest, group: usize, t: usize) -> u64 {
    mix(request.prefix[t - 1], 1000 + group as u64)
}

/// Where the test writes token `p`'s value in group `group`: the first bytes of its K (or
/// latent) in the page the table holds for it.
fn token_offset(tables: &HybridTables, id: u64, group: usize, p: usize) -> Option<usize> {
    let spec = tables.spec();
    let table = tables.table(id, group).unwrap();
    let bs = table.block_size.unwrap();
    let page = *table.page_ids.get((p / bs).checked_sub(table.first_page)?)? as usize;
    Some(match spec.groups()[group].kind {
        kvpool_core::hybrid::GroupKind::MlaLatent { .. } => {
            spec.latent_offset_bytes(group, page, 0, p % bs, 0).unwrap()
        }
        _ => spec.attention_offset_bytes(group, page, 0, KvPart::K, p % bs, 0, 0).unwrap(),
    })
}

/// Where the test writes a state's value: the first bytes of each page of the slot.
fn state_offsets(tables: &HybridTables, id: u64, group: usize) -> Vec<usize> {
    let table = tables.table(id, group).unwrap();
    table.page_ids.iter().map(|&page| page as usize * PAGE_BYTES).collect()
}

/// Checks what the queries from `query` on read below `query`: every key they see holds its
/// own prefix's value in its own group, and each state holds the state after `query`.
fn check_reads(
    tables: &HybridTables,
    groups: &[Visibility],
    id: u64,
    request: &CachedRequest,
    query: usize,
) -> Result<(), TestCaseError> {
    let pool = tables.pool();
    for (g, &visibility) in groups.iter().enumerate() {
        if let Visibility::State { .. } = visibility {
            if query > 0 {
                for offset in state_offsets(tables, id, g) {
                    prop_assert_eq!(
                        hybrid_common::read_u64(pool, offset),
                        state_value(request, g, query),
                        "request {} group {} state after {}",
                        id,
                        g,
                        query
                    );
                }
            }
            continue;
        }
        for p in (0..query).filter(|&p| sees(visibility, query, p)) {
            let offset = token_offset(tables, id, g, p);
            prop_assert!(offset.is_some(), "request {} group {} lost token {}", id, g, p);
            prop_assert_eq!(
                hybrid_common::read_u64(pool, offset.unwrap()),
                token_value(request, g, p),
                "request {} group {} token {} (queries from {})",
                id,
                g,
                p,
                query
            );
        }
    }
    Ok(())
}

/// Plays the step that computes `request`'s tokens from `from` on: writes their values and
/// the state after them.
fn write_step(
    tables: &HybridTables,
    groups: &[Visibility],
    id: u64,
    request: &CachedRequest,
    from: usize,
) {
    let pool = tables.pool();
    let n = request.num_tokens();
    for (g, &visibility) in groups.iter().enumerate() {
        if let Visibility::State { .. } = visibility {
            if n > 0 {
                for offset in state_offsets(tables, id, g) {
                    hybrid_common::write_u64(pool, offset, state_value(request, g, n));
                }
            }
            continue;
        }
        for p in from..n {
            if let Some(offset) = token_offset(tables, id, g, p) {
                hybrid_common::write_u64(pool, offset, token_value(request, g, p));
            }
        }
    }
}

/// Every table of every id and the pool's counts: what a failed call must leave alone.
fn cached_snapshot(tables: &HybridTables) -> Vec<String> {
    let pool = tables.pool();
    let mut out = vec![format!("{} {} {}", pool.num_free(), pool.num_evictable(), pool.num_used())];
    out.push(format!("{:?}", tables.cache_stats()));
    for id in 0..CACHED_IDS {
        for g in 0..tables.spec().num_groups() {
            out.push(format!("{:?}", tables.table(id, g).ok()));
        }
    }
    out
}

#[derive(Default, Debug)]
struct CacheCoverage {
    hits: usize,
    /// Hits that copied a page the hit ends inside, or a state.
    copied_hits: usize,
    checkpoints: usize,
    evictions: u64,
    exact_hits_checked: usize,
    out_of_blocks: usize,
    /// Hits that brought pages back from the prefix cache's host tier.
    host_hits: usize,
    /// Exact hits checked after the pool had evicted (a host tier that never dropped).
    exact_hits_after_evictions: usize,
}

/// One run of `ops` over a pool of `num_pages` pages whose prefix cache spills to a host
/// tier of `host_pages` (if given). The hit must be the model's on a roomy pool (it never
/// evicts) and while the host tier has dropped nothing (every evicted page is there);
/// otherwise at most the model's.
fn check_cached_run(
    ops: &[CachedOp],
    groups: &'static [Visibility],
    num_pages: usize,
    host_pages: Option<usize>,
    coverage: &mut CacheCoverage,
) -> Result<(), TestCaseError> {
    let with_state = groups.len() == 5;
    let carrier = KvLayout::new(1, 1, PAGE_BYTES / 4, 1, DType::Float16).unwrap();
    let pool = Pool::new(carrier, PoolSize::NumBlocks(num_pages), Device::Host).unwrap();
    let pool = pool.with_prefix_caching().unwrap();
    let pool = Arc::new(match host_pages {
        Some(n) => pool.with_prefix_host_tier(n).unwrap(),
        None => pool,
    });
    let spec = hybrid_common::cached_spec(WINDOW, CHUNK, with_state);
    let mut tables = HybridTables::new(pool.clone(), spec).unwrap();
    let mut model = CacheModel { groups, ..CacheModel::default() };
    let key = PromptKey::default();
    for op in ops {
        let before = cached_snapshot(&tables);
        // What the model expects, short of running out of pages (which it does not count).
        let id = match *op {
            CachedOp::Add { id, .. }
            | CachedOp::AddWithoutIds { id, .. }
            | CachedOp::Append { id, .. }
            | CachedOp::AppendWithoutIds { id, .. }
            | CachedOp::ToBoundary { id }
            | CachedOp::Checkpoint { id }
            | CachedOp::Computed { id }
            | CachedOp::Free { id } => id,
            CachedOp::Fork { parent, .. } => parent,
        };
        let exists = model.requests.contains_key(&id);
        let expected_error = match *op {
            CachedOp::Add { .. } | CachedOp::AddWithoutIds { .. } if exists => Some("duplicate"),
            CachedOp::Add { .. } | CachedOp::AddWithoutIds { .. } => None,
            CachedOp::Fork { child, .. } if exists && model.requests.contains_key(&child) => {
                Some("duplicate")
            }
            _ if !exists => Some("unknown"),
            CachedOp::Checkpoint { .. } => {
                let r = &model.requests[&id];
                let n = r.num_tokens();
                (n == 0 || n % C != 0 || !r.known).then_some("invalid")
            }
            _ => None,
        };
        let result: Result<(), CoreError> = (|| {
            match *op {
                CachedOp::Add { id, family, diverge, variant, len } => {
                    let mut request = CachedRequest {
                        tokens: Vec::new(),
                        prefix: Vec::new(),
                        family,
                        diverge,
                        variant,
                        next_query: 0,
                        known: true,
                        registered: 0,
                    };
                    let tokens = request.push_tokens(len);
                    let expected_hit = model.hit(&request.prefix);
                    let stats = pool.prefix_cache_stats().unwrap();
                    let added = tables.add_request(id, &tokens, &key)?;
                    let hit = added.num_cached_tokens;
                    // A roomy pool never evicts (checked at the end), and a host tier at
                    // least as large as the pool that has dropped nothing holds every page
                    // evicted (a smaller one may not have room for one eviction's pages),
                    // so every key the model has is there.
                    let kept =
                        host_pages.is_some_and(|n| n >= num_pages) && stats.host_evictions == 0;
                    if num_pages >= ROOMY || kept {
                        assert_eq!(hit, expected_hit, "{op:?}: the hit is the model's");
                        coverage.exact_hits_checked += 1;
                        coverage.exact_hits_after_evictions += (stats.evictions > 0) as usize;
                    } else {
                        assert!(
                            hit <= expected_hit,
                            "{op:?}: hit {hit} > the model's {expected_hit}"
                        );
                    }
                    coverage.hits += (hit > 0) as usize;
                    coverage.host_hits += (added.swapped_in_pages > 0) as usize;
                    coverage.copied_hits += !added.copies.is_empty() as usize;
                    hybrid_common::run_copies(&pool, &added.copies);
                    request.next_query = hit;
                    request.registered = hit;
                    check_reads(&tables, groups, id, &request, hit).unwrap();
                    write_step(&tables, groups, id, &request, hit);
                    model.requests.insert(id, request);
                }
                CachedOp::AddWithoutIds { id, len } => {
                    tables.add(id, len)?;
                    let mut request = CachedRequest {
                        tokens: Vec::new(),
                        prefix: Vec::new(),
                        family: 9,
                        diverge: 0,
                        variant: 9 + id as u32,
                        next_query: 0,
                        known: false,
                        registered: 0,
                    };
                    request.push_tokens(len);
                    write_step(&tables, groups, id, &request, 0);
                    model.requests.insert(id, request);
                }
                CachedOp::Append { .. }
                | CachedOp::AppendWithoutIds { .. }
                | CachedOp::ToBoundary { .. } => {
                    let mut request = model
                        .requests
                        .get(&id)
                        .ok_or(CoreError::UnknownRequest { request_id: id })?
                        .clone();
                    let old_n = request.num_tokens();
                    let (count, with_ids) = match *op {
                        CachedOp::Append { count, .. } => (count, true),
                        CachedOp::AppendWithoutIds { count, .. } => (count, false),
                        _ => (C - old_n % C, true),
                    };
                    let new = request.push_tokens(count);
                    let copies: Vec<PageCopy> = if with_ids {
                        tables.append_tokens(id, &new)?
                    } else {
                        tables.append(id, count)?
                    };
                    hybrid_common::run_copies(&pool, &copies);
                    // The model registers before the append changes the tables.
                    model.register(id, old_n);
                    request.registered = model.requests[&id].registered;
                    request.next_query = old_n;
                    request.known &= with_ids;
                    check_reads(&tables, groups, id, &request, old_n).unwrap();
                    write_step(&tables, groups, id, &request, old_n);
                    model.requests.insert(id, request);
                }
                CachedOp::Checkpoint { id } => {
                    let copies = tables.checkpoint(id)?;
                    hybrid_common::run_copies(&pool, &copies);
                    let n = model.requests[&id].num_tokens();
                    model.register(id, n);
                    for (g, v) in groups.iter().enumerate() {
                        if let Visibility::State { .. } = v {
                            let prefix = model.requests[&id].prefix[n - 1];
                            model.checkpoints.insert((g, prefix));
                        }
                    }
                    coverage.checkpoints += !copies.is_empty() as usize;
                }
                CachedOp::Computed { id } => {
                    tables.cache_computed(id)?;
                    let n = model.requests[&id].num_tokens();
                    model.register(id, n);
                }
                CachedOp::Fork { parent, child } => {
                    tables.fork(parent, child)?;
                    let mut request = model.requests[&parent].clone();
                    request.diverge = request.diverge.min(request.num_tokens());
                    request.variant = 100 + child as u32;
                    model.requests.insert(child, request);
                }
                CachedOp::Free { id } => {
                    tables.free(id)?;
                    model.requests.remove(&id);
                }
            }
            Ok(())
        })();
        match (&result, expected_error) {
            (Err(CoreError::OutOfBlocks { .. }), None) => {
                coverage.out_of_blocks += 1;
                prop_assert_eq!(
                    cached_snapshot(&tables),
                    before,
                    "a failed {:?} changed something",
                    op
                );
            }
            (Err(e), Some(kind)) => {
                let actual = match e {
                    CoreError::DuplicateRequest { .. } => "duplicate",
                    CoreError::UnknownRequest { .. } => "unknown",
                    CoreError::InvalidArgument(_) => "invalid",
                    other => panic!("{op:?}: unexpected {other:?}"),
                };
                prop_assert_eq!(actual, kind, "{:?}", op);
                prop_assert_eq!(
                    cached_snapshot(&tables),
                    before,
                    "a failed {:?} changed something",
                    op
                );
            }
            (Ok(()), None) => {}
            (result, expected) => {
                prop_assert!(false, "{:?}: {:?}, the model expects {:?}", op, result, expected)
            }
        }
        tables.check_invariants().map_err(TestCaseError::fail)?;
        for (&id, request) in &model.requests {
            for (g, &visibility) in groups.iter().enumerate() {
                let table = tables.table(id, g).unwrap();
                let live = live_pages(visibility, request.num_tokens(), request.next_query);
                prop_assert_eq!(table.page_ids.len(), live.len(), "request {} group {}", id, g);
                if !live.is_empty() {
                    prop_assert_eq!(table.first_page, live.start, "request {} group {}", id, g);
                }
            }
        }
        let stats = tables.cache_stats();
        let evictable: usize = stats.iter().map(|s| s.evictable_pages).sum();
        prop_assert_eq!(evictable, pool.num_evictable());
        prop_assert_eq!(pool.num_free() + pool.num_evictable() + pool.num_used(), num_pages);
    }
    // Every request still there reads what its next query sees.
    for (&id, request) in &model.requests {
        check_reads(&tables, groups, id, request, request.num_tokens())?;
    }
    for id in 0..CACHED_IDS {
        if tables.contains(id) {
            tables.free(id).unwrap();
        }
    }
    tables.check_invariants().map_err(TestCaseError::fail)?;
    prop_assert_eq!(pool.num_used(), 0, "pages leaked");
    prop_assert_eq!(pool.num_free() + pool.num_evictable(), num_pages);
    let evictions = pool.prefix_cache_stats().unwrap().evictions;
    coverage.evictions += evictions;
    pool.reset_prefix_cache().unwrap();
    prop_assert_eq!(pool.num_free(), num_pages, "a cached page leaked");
    Ok(())
}

/// Runs `cases` cached runs of the given layout and pool size; returns the first failure.
fn cached_runs(
    groups: &'static [Visibility],
    num_pages: usize,
    host_pages: Option<usize>,
    cases: u32,
) -> (Result<(), String>, CacheCoverage) {
    cached_runs_of(cached_ops().boxed(), groups, num_pages, host_pages, cases)
}

/// [`cached_runs`] of the ops `ops` draws.
fn cached_runs_of(
    ops: BoxedStrategy<Vec<CachedOp>>,
    groups: &'static [Visibility],
    num_pages: usize,
    host_pages: Option<usize>,
    cases: u32,
) -> (Result<(), String>, CacheCoverage) {
    let config =
        Config { cases, failure_persistence: None, max_shrink_iters: 32, ..Config::default() };
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[11; 32]);
    let mut runner = TestRunner::new_with_rng(config, rng);
    let coverage = std::cell::RefCell::new(CacheCoverage::default());
    let result = runner
        .run(&proptest::collection::vec(ops, 1..50), |ops| {
            let ops: Vec<CachedOp> = ops.into_iter().flatten().collect();
            check_cached_run(&ops, groups, num_pages, host_pages, &mut coverage.borrow_mut())
        })
        .map_err(|e| e.to_string());
    (result, coverage.into_inner())
}

#[test]
fn prefix_cached_calls_match_the_model_with_a_state_group() {
    let (roomy, c) = cached_runs(&WITH_STATE, ROOMY, None, 128);
    roomy.unwrap();
    // Every hit here resumes a state from a checkpoint.
    assert!(
        c.evictions == 0 && c.hits > 8 && c.checkpoints > 100 && c.exact_hits_checked > 200,
        "{c:?}"
    );
    let (tight, c) = cached_runs(&WITH_STATE, 160, None, 128);
    tight.unwrap();
    assert!(c.evictions > 500 && c.out_of_blocks > 50 && c.hits > 4, "{c:?}");
}

#[test]
fn prefix_cached_calls_match_the_model_without_a_state_group() {
    let (roomy, c) = cached_runs(&WITHOUT_STATE, ROOMY, None, 128);
    roomy.unwrap();
    assert!(
        c.evictions == 0 && c.hits > 30 && c.copied_hits > 30 && c.exact_hits_checked > 200,
        "{c:?}"
    );
    let (tight, c) = cached_runs(&WITHOUT_STATE, 120, None, 128);
    tight.unwrap();
    assert!(c.evictions > 300 && c.out_of_blocks > 100 && c.hits > 15, "{c:?}");
}

#[test]
fn prefix_cached_calls_spill_to_a_host_tier_and_match_the_model() {
    // A host tier that never drops: every hit is the model's, evictions or not.
    let layouts: [(&'static [Visibility], usize); 2] = [(&WITH_STATE, 80), (&WITHOUT_STATE, 60)];
    for (groups, num_pages) in layouts {
        let (result, c) =
            cached_runs_of(cached_ops_with_spills().boxed(), groups, num_pages, Some(4096), 64);
        result.unwrap();
        assert!(
            c.evictions > 1000 && c.host_hits > 20 && c.exact_hits_after_evictions > 50,
            "{c:?}"
        );
    }
    // A small one drops (whole checkpoints only) and still serves the right bytes.
    let (result, c) =
        cached_runs_of(cached_ops_with_spills().boxed(), &WITH_STATE, 80, Some(24), 64);
    result.unwrap();
    assert!(c.host_hits > 5, "{c:?}");
}

/// A run the random ones meet rarely: a prompt sharing only the head of a request whose
/// window has moved on hits the pages that left that window.
fn window_head_reuse() -> Vec<CachedOp> {
    vec![
        CachedOp::Add { id: 0, family: 0, diverge: 72, variant: 0, len: 70 },
        CachedOp::Append { id: 0, count: 1 },
        CachedOp::Add { id: 1, family: 0, diverge: 24, variant: 1, len: 34 },
    ]
}

/// Whether `ops` pass the cached machine (a panic inside it counts as a failure).
fn fixed_run_passes(ops: &[CachedOp], groups: &'static [Visibility]) -> bool {
    let run = std::panic::catch_unwind(|| {
        check_cached_run(ops, groups, ROOMY, None, &mut CacheCoverage::default()).is_ok()
    });
    run.unwrap_or(false)
}

#[test]
fn a_shorter_prompt_hits_the_pages_that_left_a_window() {
    let mut coverage = CacheCoverage::default();
    check_cached_run(&window_head_reuse(), &WITHOUT_STATE, ROOMY, None, &mut coverage).unwrap();
    assert_eq!(coverage.hits, 1);
}

/// Each deliberate bug fails the cached machine: a hit that ignores the state groups'
/// checkpoints, window pages let go uncached, keys that ignore the group.
#[test]
fn each_caching_bug_fails_the_machine() {
    use mutation::Mutation::*;
    let cases: [(mutation::Mutation, &'static [Visibility]); 3] = [
        (HitIgnoresStateCheckpoints, &WITH_STATE),
        (WindowPagesReleasedUncached, &WITHOUT_STATE),
        (KeysIgnoreTheGroup, &WITHOUT_STATE),
    ];
    for (bug, groups) in cases {
        mutation::set(Some(bug));
        let (result, _) = cached_runs(groups, ROOMY, None, 128);
        let fixed = fixed_run_passes(&window_head_reuse(), groups);
        mutation::set(None);
        assert!(result.is_err() || !fixed, "{bug:?} went unnoticed");
    }
    // A page brought back from the host tier's wrong slot reads other bytes.
    mutation::set(Some(HostHitFromTheNextSlot));
    let (result, _) =
        cached_runs_of(cached_ops_with_spills().boxed(), &WITHOUT_STATE, 60, Some(4096), 64);
    mutation::set(None);
    assert!(result.is_err(), "HostHitFromTheNextSlot went unnoticed");
}
