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
use kvpool_core::{CoreError, Device, Pool};

#[path = "common/hybrid.rs"]
mod hybrid_common;

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
