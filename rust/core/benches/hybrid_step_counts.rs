//! The decode steps of `hybrid_step.rs`, a fixed number of them, for instruction and cache
//! counts under callgrind (which do not move with the machine's load, unlike times):
//!
//! ```text
//! cargo bench -p kvpool-core --bench hybrid_step_counts --no-run
//! valgrind --tool=callgrind --cache-sim=yes --toggle-collect='*step_once*' \
//!     target/release/deps/hybrid_step_counts-<hash> mixed_batched
//! ```
//!
//! The argument names the step (`mixed`, `mixed_batched`, `uniform_batched`,
//! `uniform_per_request`; default `mixed_batched`), a second one the number of rebuilds (each
//! runs 256 steps; default 2). Only `step_once` is counted, so the totals over
//! `256 x rebuilds` steps give the cost of a step; the rebuilds are left out.

use std::hint::black_box;

#[path = "support/hybrid_setup.rs"]
mod setup;
use setup::{build_mixed, build_uniform, REQUESTS, STEPS_PER_BUILD};

/// One step of `tables`; not inlined, so that callgrind can count it alone.
#[inline(never)]
fn step_once<T>(tables: &mut T, step: &mut impl FnMut(&mut T)) {
    step(tables)
}

fn run<T>(rebuilds: u64, build: impl Fn() -> T, mut step: impl FnMut(&mut T)) {
    for _ in 0..rebuilds {
        let mut tables = build();
        for _ in 0..STEPS_PER_BUILD {
            step_once(&mut tables, &mut step);
        }
    }
}

fn main() {
    // `cargo bench` passes `--bench`: only the other arguments are ours.
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let which = args.first().map_or("mixed_batched", String::as_str);
    let rebuilds: u64 = args.get(1).map_or(2, |n| n.parse().expect("a number of rebuilds"));
    let ids: Vec<u64> = (0..REQUESTS as u64).collect();
    let ones = vec![1usize; REQUESTS];
    match which {
        "mixed" => run(rebuilds, build_mixed, |t| {
            for &id in &ids {
                black_box(t.append(id, 1).unwrap());
            }
        }),
        "mixed_batched" => run(rebuilds, build_mixed, |t| {
            black_box(t.append_many(&ids, &ones, None).unwrap());
        }),
        "uniform_batched" => run(rebuilds, build_uniform, |t| {
            black_box(t.append_tokens_many(&ids, &ones).unwrap());
        }),
        "uniform_per_request" => run(rebuilds, build_uniform, |t| {
            for &id in &ids {
                black_box(t.append_tokens(id, 1).unwrap());
            }
        }),
        other => panic!("unknown step {other}"),
    }
    println!("{which}: {} steps of {REQUESTS} requests", rebuilds * STEPS_PER_BUILD);
}
