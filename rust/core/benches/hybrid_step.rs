//! The allocator's cost of a decode step on a hybrid layout against the same step on a
//! uniform one: 256 requests each grow by one token (contexts 512 to 2,559 tokens, so the
//! window group slides a page off every 16 steps, as the full group takes one).
//!
//! - `mixed`: gpt-oss-20b's layout through `HybridTables` (12 sliding-window-128 layers and
//!   12 full layers, 16 tokens a page in each group), one `append` per request;
//! - `mixed_batched`: the same tables, one `append_many` for the step;
//! - `uniform_batched`: 24 full layers through `BlockTables`, one `append_tokens_many` for
//!   the step (how a uniform engine calls it);
//! - `uniform_per_request`: the same tables, one `append_tokens` per request (the mixed
//!   step's call pattern).
//!
//! Pages are scaled down (1 KV head of 8 dims, so a page is 6 KiB instead of 384 KiB): the
//! tables never touch page bytes, so the allocator's work is the same, and 256 requests of
//! these contexts fit the host's memory. Host pools, no prefix caching. One iteration is one
//! step of 256 appends; every 256 steps the tables are rebuilt outside the timed region, so
//! contexts stay in range.
//!
//! ```text
//! cargo bench -p kvpool-core --bench hybrid_step
//! ```

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvpool_core::hybrid::{AttentionShape, GroupKind, HybridTables, KvGroup, ModelKvSpec};
use kvpool_core::pool::PoolSize;
use kvpool_core::tables::BlockTables;
use kvpool_core::{DType, Device, KvLayout, Pool};

const REQUESTS: usize = 256;
const WINDOW: usize = 128;
const BLOCK_SIZE: usize = 16;
/// Steps between rebuilds: each request grows by at most this many tokens.
const STEPS_PER_BUILD: u64 = 256;
const SHAPE: AttentionShape =
    AttentionShape { num_kv_heads: 1, head_dim: 8, dtype: DType::BFloat16 };

/// Request `i`'s context when the tables are built: spread over 512..2560.
fn context(i: usize) -> usize {
    512 + (i * 2039) % 2048
}

/// Blocks the requests can reach before the next rebuild, with one per request to spare.
fn blocks_needed(per_request: impl Fn(usize) -> usize) -> usize {
    (0..REQUESTS).map(per_request).sum::<usize>() + REQUESTS
}

fn gpt_oss_spec() -> ModelKvSpec {
    let sliding = (0..24).step_by(2).collect();
    let full = (1..24).step_by(2).collect();
    let groups = vec![
        KvGroup::new(sliding, GroupKind::SlidingWindow { window: WINDOW, shape: SHAPE }),
        KvGroup::new(full, GroupKind::Full(SHAPE)),
    ];
    let token_bytes = 12 * 2 * SHAPE.num_kv_heads * SHAPE.head_dim * 2;
    ModelKvSpec::new(24, groups, BLOCK_SIZE * token_bytes).unwrap()
}

fn build_mixed() -> HybridTables {
    let spec = gpt_oss_spec();
    let page_bytes = spec.page_bytes();
    let longest = |i: usize| context(i) + STEPS_PER_BUILD as usize;
    let num_pages = blocks_needed(|i| longest(i).div_ceil(BLOCK_SIZE) + WINDOW / BLOCK_SIZE + 1);
    // A stand-in layout whose blocks are the spec's pages.
    let carrier = KvLayout::new(1, 1, page_bytes / 4, 1, DType::Float16).unwrap();
    let pool = Pool::new(carrier, PoolSize::NumBlocks(num_pages), Device::Host).unwrap();
    let mut tables = HybridTables::new(Arc::new(pool), spec).unwrap();
    for i in 0..REQUESTS {
        tables.add(i as u64, context(i) - 1).unwrap();
        // One step so the window has slid to its steady size before timing.
        tables.append(i as u64, 1).unwrap();
    }
    tables
}

fn build_uniform() -> Arc<BlockTables> {
    let layout =
        KvLayout::new(24, SHAPE.num_kv_heads, SHAPE.head_dim, BLOCK_SIZE, SHAPE.dtype).unwrap();
    let longest = |i: usize| (context(i) + STEPS_PER_BUILD as usize).div_ceil(BLOCK_SIZE);
    let num_blocks = blocks_needed(longest);
    let pool = Arc::new(Pool::new(layout, PoolSize::NumBlocks(num_blocks), Device::Host).unwrap());
    let max_blocks = (0..REQUESTS).map(longest).max().unwrap() + 1;
    let tables = BlockTables::new(pool, REQUESTS, max_blocks).unwrap();
    for i in 0..REQUESTS {
        tables.add(i as u64, context(i)).unwrap();
    }
    tables
}

/// Times `iters` steps of `step`, rebuilding with `build` (untimed) every `STEPS_PER_BUILD`.
fn time_steps<T>(iters: u64, build: impl Fn() -> T, mut step: impl FnMut(&mut T)) -> Duration {
    let mut total = Duration::ZERO;
    let mut done = 0;
    while done < iters {
        let mut tables = build();
        let steps = (iters - done).min(STEPS_PER_BUILD);
        let start = Instant::now();
        for _ in 0..steps {
            step(&mut tables);
        }
        total += start.elapsed();
        done += steps;
    }
    total
}

fn bench(c: &mut Criterion) {
    let ids: Vec<u64> = (0..REQUESTS as u64).collect();
    let ones = vec![1usize; REQUESTS];
    let mut group = c.benchmark_group("hybrid_step");
    group.throughput(Throughput::Elements(REQUESTS as u64));
    group.bench_function("mixed", |b| {
        b.iter_custom(|iters| {
            time_steps(iters, build_mixed, |t| {
                for &id in &ids {
                    black_box(t.append(id, 1).unwrap());
                }
            })
        })
    });
    group.bench_function("mixed_batched", |b| {
        b.iter_custom(|iters| {
            time_steps(iters, build_mixed, |t| {
                black_box(t.append_many(&ids, &ones, None).unwrap());
            })
        })
    });
    group.bench_function("uniform_batched", |b| {
        b.iter_custom(|iters| {
            time_steps(iters, build_uniform, |t| {
                black_box(t.append_tokens_many(&ids, &ones).unwrap());
            })
        })
    });
    group.bench_function("uniform_per_request", |b| {
        b.iter_custom(|iters| {
            time_steps(iters, build_uniform, |t| {
                for &id in &ids {
                    black_box(t.append_tokens(id, 1).unwrap());
                }
            })
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(5)).sample_size(30);
    targets = bench
}
criterion_main!(benches);
