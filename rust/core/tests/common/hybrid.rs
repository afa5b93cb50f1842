//! The mixed model the hybrid tests share. Included by those tests alone (through
//! `#[path = "common/hybrid.rs"]`), so the other tests that include `common` do not compile
//! helpers they never call.

use kvpool_core::hybrid::{AttentionShape, GroupKind, KvGroup, ModelKvSpec};
use kvpool_core::DType;

/// The page size of `mixed_spec`, and so the block bytes of the pool under it.
pub const PAGE_BYTES: usize = 1024;

/// An fp16 attention shape.
pub fn heads(num_kv_heads: usize, head_dim: usize) -> AttentionShape {
    AttentionShape { num_kv_heads, head_dim, dtype: DType::Float16 }
}

/// Six layers over pages of `PAGE_BYTES`, one group of each kind, in this order: full
/// attention (4 tokens a page), a sliding window of `window` over two layers (4 a page), a
/// 1500-byte recurrent state (2 pages a slot), an MLA latent (2 a page) and chunks of
/// `chunk` (4 a page).
pub fn mixed_spec(window: usize, chunk: usize) -> ModelKvSpec {
    let groups = vec![
        KvGroup::new(vec![0], GroupKind::Full(heads(1, 64))),
        KvGroup::new(vec![1, 2], GroupKind::SlidingWindow { window, shape: heads(1, 32) }),
        KvGroup::new(vec![3], GroupKind::RecurrentState { bytes_per_layer: 1500 }),
        KvGroup::new(
            vec![4],
            GroupKind::MlaLatent { latent_dim: 224, rope_dim: 32, dtype: DType::Float16 },
        ),
        KvGroup::new(vec![5], GroupKind::ChunkedLocal { chunk, shape: heads(1, 64) }),
    ];
    ModelKvSpec::new(6, groups, PAGE_BYTES).unwrap()
}
