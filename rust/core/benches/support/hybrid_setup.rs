//! The tables both hybrid-step benchmarks time (`hybrid_step.rs` with criterion,
//! `hybrid_step_counts.rs` under callgrind): gpt-oss-20b's layout through `HybridTables` and a
//! uniform 24-layer layout through `BlockTables`, 256 requests of 512 to 2,559 tokens.

use std::sync::Arc;

use kvpool_core::hybrid::{AttentionShape, GroupKind, HybridTables, KvGroup, ModelKvSpec};
use kvpool_core::pool::PoolSize;
use kvpool_core::tables::BlockTables;
use kvpool_core::{DType, Device, KvLayout, Pool};

pub const REQUESTS: usize = 256;
const WINDOW: usize = 128;
const BLOCK_SIZE: usize = 16;
/// Steps between rebuilds: each request grows by at most this many tokens.
pub const STEPS_PER_BUILD: u64 = 256;
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

pub fn build_mixed() -> HybridTables {
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

pub fn build_uniform() -> Arc<BlockTables> {
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
