//! A property-based fuzzer over the core's public entry points: random sequences of pool,
//! block-table, prefix-cache and host-tier calls with arbitrary arguments, valid or not
//! (foreign and repeated ids, counts of 0 and past every limit, unknown requests). After
//! every call: no panic, an error only of the kinds the call documents, nothing changed when
//! it failed, and every invariant check passes.
//!
//! The case count is bounded (`CASES`, override with `PROPTEST_CASES`) so that it runs in
//! seconds in `cargo test`; set `PROPTEST_CASES=20000` for a soak.

use std::sync::Arc;

use proptest::prelude::*;
use proptest::test_runner::Config;

use kvpool_core::pool::PoolSize;
use kvpool_core::tables::{BlockTables, PromptKey};
use kvpool_core::tier::{CopyMethod, HostTier};
use kvpool_core::{CoreError, DType, Device, GrowableSize, KvLayout, Pool, MAX_NUM_BLOCKS};

const CASES: u32 = 96;
const BLOCK_SIZE: usize = 2;
const NUM_BLOCKS: usize = 12;
const MAX_SEQS: usize = 4;
const MAX_BLOCKS_PER_SEQ: usize = 6;

/// What the pool under test is.
#[derive(Debug, Clone, Copy)]
struct Setup {
    growable: bool,
    prefix_caching: bool,
    prefix_host_tier: bool,
    host_tier: bool,
}

#[derive(Debug, Clone)]
enum Op {
    Alloc,
    AllocMany(usize),
    Free(u32),
    FreeMany(Vec<u32>),
    ShareMany(Vec<u32>),
    /// Frees the `n`-th block this test holds through the plain API (a valid free).
    FreeHeld(usize),
    Grow(usize),
    Shrink,
    ResetPrefixCache,
    Add(u64, usize),
    AddRequest(u64, Vec<u32>, Option<u8>),
    Append(Vec<u64>, Vec<usize>),
    Fork(u64, u64),
    FreeRequest(u64),
    SwapOut(Vec<u64>),
    SwapIn(Vec<u64>),
    TierFree(u64),
}

fn block_id() -> impl Strategy<Value = u32> {
    prop_oneof![
        4 => 0..(2 * NUM_BLOCKS as u32 + 2),
        1 => Just(u32::MAX),
        1 => Just(i32::MAX as u32),
    ]
}

fn count() -> impl Strategy<Value = usize> {
    prop_oneof![
        8 => 0..(3 * NUM_BLOCKS),
        1 => Just(usize::MAX),
        1 => Just(MAX_NUM_BLOCKS + 1),
        1 => Just(1usize << 40),
    ]
}

fn tokens() -> impl Strategy<Value = usize> {
    prop_oneof![
        8 => 0..(BLOCK_SIZE * MAX_BLOCKS_PER_SEQ + 3),
        1 => Just(usize::MAX),
        1 => Just(i32::MAX as usize + 1),
    ]
}

fn request_id() -> impl Strategy<Value = u64> {
    prop_oneof![8 => 0..6u64, 1 => Just(u64::MAX)]
}

/// Prompts from a small vocabulary, so that prefixes repeat and hit.
fn prompt() -> impl Strategy<Value = Vec<u32>> {
    (0..3u32, 0..(BLOCK_SIZE * MAX_BLOCKS_PER_SEQ + 2))
        .prop_map(|(base, len)| (0..len as u32).map(|t| base * 1000 + t % 5).collect())
}

fn op() -> impl Strategy<Value = Op> {
    let ids = || proptest::collection::vec(block_id(), 0..5);
    let rids = || proptest::collection::vec(request_id(), 0..4);
    prop_oneof![
        1 => Just(Op::Alloc),
        1 => count().prop_map(Op::AllocMany),
        1 => block_id().prop_map(Op::Free),
        1 => ids().prop_map(Op::FreeMany),
        1 => ids().prop_map(Op::ShareMany),
        1 => (0..8usize).prop_map(Op::FreeHeld),
        1 => count().prop_map(Op::Grow),
        1 => Just(Op::Shrink),
        1 => Just(Op::ResetPrefixCache),
        2 => (request_id(), tokens()).prop_map(|(r, n)| Op::Add(r, n)),
        2 => (request_id(), prompt(), proptest::option::of(0..2u8))
            .prop_map(|(r, p, salt)| Op::AddRequest(r, p, salt)),
        2 => (rids(), proptest::collection::vec(tokens(), 0..4))
            .prop_map(|(r, n)| Op::Append(r, n)),
        1 => (request_id(), request_id()).prop_map(|(a, b)| Op::Fork(a, b)),
        2 => request_id().prop_map(Op::FreeRequest),
        1 => rids().prop_map(Op::SwapOut),
        1 => rids().prop_map(Op::SwapIn),
        1 => request_id().prop_map(Op::TierFree),
    ]
}

fn setup() -> impl Strategy<Value = Setup> {
    (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
        |(growable, prefix_caching, spill, host_tier)| Setup {
            growable,
            prefix_caching,
            prefix_host_tier: prefix_caching && spill,
            host_tier,
        },
    )
}

struct World {
    pool: Arc<Pool>,
    tables: Arc<BlockTables>,
    tier: Option<HostTier>,
    /// Blocks this test holds through the plain pool API (one entry per reference).
    held: Vec<u32>,
}

impl World {
    fn new(s: Setup) -> World {
        let layout = KvLayout::new(1, 1, 32, BLOCK_SIZE, DType::Float16).unwrap();
        let mut pool = if s.growable {
            let size = GrowableSize {
                max_num_blocks: 2 * NUM_BLOCKS,
                initial_num_blocks: NUM_BLOCKS / 2,
                chunk_bytes: Some(4096),
            };
            Pool::new_growable(layout, size, Device::Host).unwrap()
        } else {
            Pool::new(layout, PoolSize::NumBlocks(NUM_BLOCKS), Device::Host).unwrap()
        };
        if s.prefix_caching {
            pool = pool.with_prefix_caching().unwrap();
        }
        if s.prefix_host_tier {
            pool = pool.with_prefix_host_tier(3).unwrap();
        }
        let pool = Arc::new(pool);
        let tables = BlockTables::new(pool.clone(), MAX_SEQS, MAX_BLOCKS_PER_SEQ).unwrap();
        let tier = s
            .host_tier
            .then(|| HostTier::new(tables.clone(), PoolSize::NumBlocks(5), CopyMethod::Auto))
            .transpose()
            .unwrap();
        World { pool, tables, tier, held: Vec::new() }
    }

    /// Everything a failed call must leave as it was.
    fn snapshot(&self) -> Snapshot {
        let pool = &self.pool;
        let ref_cnts = (0..pool.num_blocks() as u32).map(|b| pool.ref_cnt(b).unwrap()).collect();
        let mut requests: Vec<(u64, usize, Vec<i32>)> = self
            .tables
            .request_ids()
            .into_iter()
            .map(|r| (r, self.tables.num_tokens(r).unwrap(), self.tables.blocks(r).unwrap()))
            .collect();
        requests.sort();
        let swapped = self.tier.as_ref().map_or(Vec::new(), |t| {
            t.request_ids().into_iter().map(|r| (r, t.swapped(r).unwrap())).collect()
        });
        Snapshot {
            counts: (pool.num_blocks(), pool.num_free(), pool.num_used(), pool.num_evictable()),
            ref_cnts,
            requests,
            swapped,
        }
    }

    fn check(&self) -> Result<(), String> {
        self.pool.check_invariants_with(false)?;
        self.tables.check_invariants()?;
        if let Some(tier) = &self.tier {
            tier.check_invariants()?;
        }
        // The references this test holds are the rest: tables, tier and held add up.
        for &b in &self.held {
            let rc = self.pool.ref_cnt(b).map_err(|e| e.to_string())?;
            let mine = self.held.iter().filter(|&&h| h == b).count() as u32;
            if rc < mine {
                return Err(format!("block {b}: held {mine} times, ref_cnt {rc}"));
            }
        }
        Ok(())
    }

    /// Runs `op`; on error, the error's kind must be one `op` documents.
    fn apply(&mut self, op: &Op) -> Result<(), CoreError> {
        use CoreError as E;
        let grow_errors = |e: &E| matches!(e, E::OutOfBlocks { .. } | E::CannotGrow { .. });
        match op {
            Op::Alloc => expect(self.pool.alloc().map(|b| self.held.push(b)), grow_errors),
            Op::AllocMany(n) => {
                expect(self.pool.alloc_many(*n).map(|ids| self.held.extend(ids)), grow_errors)
            }
            Op::Free(b) => {
                let r = self.pool.free(*b);
                if r.is_ok() {
                    self.forget_held(&[*b]);
                }
                expect(r, block_errors)
            }
            Op::FreeMany(ids) => {
                let r = self.pool.free_many(ids);
                if r.is_ok() {
                    self.forget_held(ids);
                }
                expect(r, block_errors)
            }
            Op::ShareMany(ids) => {
                let r = self.pool.share_many(ids);
                if r.is_ok() {
                    self.held.extend(ids);
                }
                expect(r, block_errors)
            }
            Op::FreeHeld(n) if self.held.is_empty() => {
                let _ = n;
                Ok(())
            }
            Op::FreeHeld(n) => {
                let b = self.held[n % self.held.len()];
                self.pool.free(b).expect("a block this test holds frees");
                self.forget_held(&[b]);
                Ok(())
            }
            Op::Grow(n) => expect(self.pool.grow(*n).map(drop), |e| {
                grow_errors(e) || matches!(e, E::InvalidArgument(_))
            }),
            Op::Shrink => self.pool.shrink().map(drop),
            Op::ResetPrefixCache => expect(self.pool.reset_prefix_cache().map(drop), |e| {
                matches!(e, E::CacheInUse { .. })
            }),
            Op::Add(r, n) => expect(self.tables.add(*r, *n).map(drop), request_errors),
            Op::AddRequest(r, prompt, salt) => {
                let salt = salt.map(|s| [s]);
                let key = PromptKey {
                    cache_salt: salt.as_ref().map(|s| &s[..]),
                    lora_id: None,
                    extra_keys: b"",
                };
                expect(self.tables.add_request(*r, prompt, &key).map(drop), request_errors)
            }
            Op::Append(rids, counts) => {
                expect(self.tables.append_tokens_many(rids, counts).map(drop), request_errors)
            }
            Op::Fork(parent, child) => expect(self.tables.fork(*parent, *child), request_errors),
            Op::FreeRequest(r) => expect(self.tables.free(*r), request_errors),
            Op::SwapOut(rids) => match &self.tier {
                Some(tier) => {
                    // SAFETY: no stream is given (a host pool has none).
                    let swapped = unsafe { tier.swap_out(rids, None) };
                    expect(swapped.map(drop), request_errors)
                }
                None => Ok(()),
            },
            Op::SwapIn(rids) => match &self.tier {
                Some(tier) => {
                    // SAFETY: no stream is given (a host pool has none).
                    let swapped = unsafe { tier.swap_in(rids, None) };
                    expect(swapped.map(drop), request_errors)
                }
                None => Ok(()),
            },
            Op::TierFree(r) => match &self.tier {
                Some(tier) => expect(tier.free(*r), request_errors),
                None => Ok(()),
            },
        }
    }

    fn forget_held(&mut self, ids: &[u32]) {
        for b in ids {
            if let Some(at) = self.held.iter().position(|h| h == b) {
                self.held.swap_remove(at);
            }
        }
    }
}

#[derive(Debug, PartialEq)]
struct Snapshot {
    counts: (usize, usize, usize, usize),
    ref_cnts: Vec<u32>,
    requests: Vec<(u64, usize, Vec<i32>)>,
    swapped: Vec<(u64, (usize, Vec<u32>))>,
}

fn block_errors(e: &CoreError) -> bool {
    matches!(
        e,
        CoreError::InvalidBlock { .. }
            | CoreError::DoubleFree { .. }
            | CoreError::CapacityExceeded { .. }
            | CoreError::InvalidArgument(_)
    )
}

fn request_errors(e: &CoreError) -> bool {
    matches!(
        e,
        CoreError::UnknownRequest { .. }
            | CoreError::DuplicateRequest { .. }
            | CoreError::WrongTier { .. }
            | CoreError::CapacityExceeded { .. }
            | CoreError::OutOfBlocks { .. }
            | CoreError::CannotGrow { .. }
            | CoreError::HostTierFull { .. }
            | CoreError::InvalidArgument(_)
    )
}

/// `result`, with an error of a kind `documented` does not accept turned into a panic.
fn expect(
    result: Result<(), CoreError>,
    documented: impl Fn(&CoreError) -> bool,
) -> Result<(), CoreError> {
    if let Err(e) = &result {
        assert!(documented(e), "an undocumented error: {e:?}");
    }
    result
}

proptest! {
    #![proptest_config(Config { cases: CASES, max_shrink_iters: 2_000, ..Config::default() })]

    #[test]
    fn any_sequence_of_calls_keeps_every_invariant(
        setup in setup(),
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let mut world = World::new(setup);
        for op in &ops {
            let before = world.snapshot();
            let result = world.apply(op);
            if result.is_err() {
                prop_assert_eq!(&world.snapshot(), &before, "{:?} failed with {:?} and changed the state", op, result);
            }
            if let Err(m) = world.check() {
                prop_assert!(false, "after {:?} ({:?}): {}", op, result, m);
            }
        }
        // Everything comes back: the requests, the tier, the blocks held.
        if let Some(tier) = &world.tier {
            for r in tier.request_ids() {
                tier.free(r).unwrap();
            }
        }
        for r in world.tables.request_ids() {
            world.tables.free(r).unwrap();
        }
        let held = std::mem::take(&mut world.held);
        for b in held {
            world.pool.free(b).unwrap();
        }
        world.pool.reset_prefix_cache().unwrap();
        prop_assert_eq!(world.pool.num_free(), world.pool.num_blocks());
        world.pool.check_invariants_with(true).map_err(TestCaseError::fail)?;
    }
}
