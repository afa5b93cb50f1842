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

/// Five layers over pages of `PAGE_BYTES`, one group per layer, with page sizes that do
/// not divide the 16-token hash chunk: full attention (21 tokens a page), a sliding window
/// of `window` (5 a page), a 1500-byte recurrent state (2 pages a slot, when `with_state`),
/// an MLA latent (2 a page) and chunks of `chunk` (4 a page). Without the state the groups
/// keep their order, less the state.
pub fn cached_spec(window: usize, chunk: usize, with_state: bool) -> ModelKvSpec {
    let mut groups = vec![
        GroupKind::Full(heads(1, 12)),
        GroupKind::SlidingWindow { window, shape: heads(1, 48) },
        GroupKind::RecurrentState { bytes_per_layer: 1500 },
        GroupKind::MlaLatent { latent_dim: 224, rope_dim: 32, dtype: DType::Float16 },
        GroupKind::ChunkedLocal { chunk, shape: heads(1, 64) },
    ];
    if !with_state {
        groups.remove(2);
    }
    let num_layers = groups.len();
    let groups = groups.into_iter().enumerate().map(|(l, kind)| KvGroup::new(vec![l], kind));
    ModelKvSpec::new(num_layers, groups.collect(), PAGE_BYTES).unwrap()
}

/// Byte `offset` from the base of a host pool's slab, checked against the slab's size.
fn slab_address(pool: &kvpool_core::Pool, offset: usize, len: usize) -> usize {
    let bytes = pool.num_blocks() * pool.block_bytes();
    assert!(offset + len <= bytes, "{offset} + {len} is past the slab's {bytes} bytes");
    pool.base_ptr() as usize + offset
}

/// Writes `value` at byte `offset` of a host pool's slab.
pub fn write_u64(pool: &kvpool_core::Pool, offset: usize, value: u64) {
    let address = slab_address(pool, offset, 8);
    // SAFETY: a host pool's slab is `num_blocks * block_bytes` bytes the pool owns and keeps
    // mapped while it lives; `slab_address` checked the 8 bytes are inside it; no other
    // thread touches the pool in these tests; unaligned writes are allowed.
    unsafe { (address as *mut u64).write_unaligned(value) }
}

/// Reads the 8 bytes at byte `offset` of a host pool's slab.
pub fn read_u64(pool: &kvpool_core::Pool, offset: usize) -> u64 {
    let address = slab_address(pool, offset, 8);
    // SAFETY: as in `write_u64`: inside the mapped slab, no concurrent access.
    unsafe { (address as *const u64).read_unaligned() }
}

/// Runs `copies` on a host pool, in order, as a caller runs them before its kernels.
pub fn run_copies(pool: &kvpool_core::Pool, copies: &[kvpool_core::hybrid::PageCopy]) {
    let page_bytes = pool.block_bytes();
    for copy in copies {
        let src = slab_address(pool, copy.src as usize * page_bytes, page_bytes);
        let dst = slab_address(pool, copy.dst as usize * page_bytes, page_bytes);
        assert_ne!(src, dst, "{copy:?} copies a page onto itself");
        // SAFETY: both whole pages are inside the mapped slab (checked above) and distinct,
        // so they do not overlap; no other thread touches the pool.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, page_bytes) }
    }
}
