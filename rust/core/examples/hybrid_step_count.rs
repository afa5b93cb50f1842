//! The two batched decode steps of `benches/hybrid_step.rs` alone, for an instruction count:
//! `mixed` (gpt-oss-20b's layout, one `HybridTables::append_many` of 256 requests) or
//! `uniform` (24 full layers, one `BlockTables::append_tokens_many`), `STEPS` steps on the
//! benchmark's tables (rebuilt every 256 steps). Each step is one call of a function that
//! is never inlined, so callgrind can count it apart from the building:
//!
//! ```text
//! cargo build --release -p kvpool-core --example hybrid_step_count
//! valgrind --tool=callgrind --cache-sim=yes --collect-atstart=no \
//!     --toggle-collect='hybrid_step_count::mixed_step' \
//!     target/release/examples/hybrid_step_count mixed 512
//! ```
//!
//! (`uniform_step` for `uniform`); the totals over the steps, divided by `STEPS`, are one
//! step's.

use std::hint::black_box;
use std::process::ExitCode;

use kvpool_core::hybrid::HybridTables;
use kvpool_core::tables::BlockTables;

#[path = "../benches/common/hybrid_step_setup.rs"]
mod setup;
use setup::{build_mixed, build_uniform, REQUESTS, STEPS_PER_BUILD};

#[inline(never)]
fn mixed_step(tables: &mut HybridTables, ids: &[u64], ones: &[usize]) {
    black_box(tables.append_many(ids, ones, None).unwrap());
}

#[inline(never)]
fn uniform_step(tables: &BlockTables, ids: &[u64], ones: &[usize]) {
    black_box(tables.append_tokens_many(ids, ones).unwrap());
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(which), Some(Ok(steps))) = (args.get(1), args.get(2).map(|s| s.parse::<u64>()))
    else {
        eprintln!("usage: hybrid_step_count mixed|uniform STEPS");
        return ExitCode::from(2);
    };
    let ids: Vec<u64> = (0..REQUESTS as u64).collect();
    let ones = vec![1usize; REQUESTS];
    let mut done = 0;
    while done < steps {
        let batch = (steps - done).min(STEPS_PER_BUILD);
        match which.as_str() {
            "mixed" => {
                let mut tables = build_mixed();
                (0..batch).for_each(|_| mixed_step(&mut tables, &ids, &ones));
            }
            "uniform" => {
                let tables = build_uniform();
                (0..batch).for_each(|_| uniform_step(&tables, &ids, &ones));
            }
            _ => {
                eprintln!("the step is mixed or uniform, got {which}");
                return ExitCode::from(2);
            }
        }
        done += batch;
    }
    println!("{which}: {steps} steps of {REQUESTS} requests");
    ExitCode::SUCCESS
}
