//! What a pool's blocks are: the blocks of one `KvLayout` (a uniform model), or pages of a
//! fixed byte size whose contents a hybrid model's `ModelKvSpec` describes group by group.
//!
//! The slab, the free list, growth and the copy engines only ever need a block's bytes, so a
//! pool of pages works on every backend (host, CUDA, growable) exactly as a pool of layout
//! blocks does. What differs is the view: only a layout pool has one `KvLayout` to cut a
//! block into layers and K/V, so `Pool::layout` refuses on a pool of pages, and a
//! per-layer view of a group's pages comes from the spec (its offsets inside a page).
//! The pool's accessors of its geometry are in `mod.rs` (this module knows no pool).

use crate::error::CoreError;
use crate::layout::{KvLayout, BLOCK_ALIGN_BYTES};

/// Tokens per hashed chunk of a pool of pages with prefix caching: hybrid tables hash
/// prompts in chunks of this many tokens whatever each group's page size
/// (`hybrid::HASH_CHUNK_TOKENS` is this), so it is the block size the pool's prefix cache
/// counts and reports in (a layout pool's is its layout's block size).
pub const PAGE_HASH_CHUNK_TOKENS: usize = 16;

/// The geometry a pool is made with (`Pool::new` and the other constructors take anything
/// that converts into it: a `KvLayout`, a `&ModelKvSpec`, or this). Opaque, so that a page
/// size is always one [`pages`](Self::pages) accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolGeometry(Blocks);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blocks {
    /// Blocks of one layout: views by layer and K/V work.
    Layout(KvLayout),
    /// Pages of this many bytes with no layout of their own: a hybrid model's pages (see
    /// `hybrid/hybrid.md`), one group's per page while allocated.
    Pages(usize),
}

impl PoolGeometry {
    /// Pages of `page_bytes` bytes: a positive multiple of 256 (`BLOCK_ALIGN_BYTES`), as a
    /// `ModelKvSpec`'s, so that every page starts as aligned as the slab.
    pub fn pages(page_bytes: usize) -> Result<Self, CoreError> {
        if page_bytes == 0 || page_bytes % BLOCK_ALIGN_BYTES != 0 {
            return Err(CoreError::InvalidLayout(format!(
                "a pool's pages must be a positive multiple of {BLOCK_ALIGN_BYTES} bytes, got \
                 {page_bytes}"
            )));
        }
        Ok(PoolGeometry(Blocks::Pages(page_bytes)))
    }

    /// Bytes of one block (one page).
    pub fn block_bytes(&self) -> usize {
        match self.0 {
            Blocks::Layout(layout) => layout.block_bytes(),
            Blocks::Pages(page_bytes) => page_bytes,
        }
    }

    /// The tokens a prefix cache over these blocks hashes per block: the layout's block
    /// size, or [`PAGE_HASH_CHUNK_TOKENS`] for pages.
    pub(crate) fn hash_block_tokens(&self) -> usize {
        match self.0 {
            Blocks::Layout(layout) => layout.block_size(),
            Blocks::Pages(_) => PAGE_HASH_CHUNK_TOKENS,
        }
    }

    /// Whether the blocks are a hybrid model's pages (no layout).
    pub fn is_pages(&self) -> bool {
        matches!(self.0, Blocks::Pages(_))
    }

    /// The layout, or a refusal saying why a pool of pages has none.
    pub fn layout(&self) -> Result<&KvLayout, CoreError> {
        match &self.0 {
            Blocks::Layout(layout) => Ok(layout),
            Blocks::Pages(page_bytes) => Err(CoreError::InvalidLayout(format!(
                "this pool holds {page_bytes}-byte pages of a hybrid model (made from its \
                 ModelKvSpec), not blocks of one KvLayout: a group's layers are found in a page \
                 through the spec (ModelKvSpec::attention_offset_bytes, latent_offset_bytes, \
                 state_location)"
            ))),
        }
    }
}

impl From<KvLayout> for PoolGeometry {
    fn from(layout: KvLayout) -> Self {
        PoolGeometry(Blocks::Layout(layout))
    }
}
