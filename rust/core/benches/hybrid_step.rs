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
//!
//! `hybrid_step_counts.rs` runs the same steps a fixed number of times, for callgrind.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

#[path = "support/hybrid_setup.rs"]
mod setup;
use setup::{build_mixed, build_uniform, REQUESTS, STEPS_PER_BUILD};

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
