//! Pools over memory kvpool does not allocate: a caller's buffer (`new_external`) or none
//! at all (`new_metadata_only`). Everything but the memory works as on any fixed pool.

use super::{Backing, Pool};
use crate::allocator::BlockAllocator;
use crate::error::CoreError;
use crate::layout::KvLayout;
use crate::slab::{ExternalSlab, NoSlab, Slab};

impl Pool {
    /// A fixed pool over `slab` (memory the caller owns): `num_blocks` blocks, or as many as
    /// fit when `None`. Refuses a slab too small for one block, or for `num_blocks`, with
    /// `InvalidArgument`, before anything is made.
    pub fn new_external(
        layout: KvLayout,
        slab: ExternalSlab,
        num_blocks: Option<usize>,
    ) -> Result<Self, CoreError> {
        let block_bytes = layout.block_bytes();
        let fit = slab.len_bytes() / block_bytes;
        let num_blocks = num_blocks.unwrap_or(fit);
        if num_blocks == 0 || num_blocks > fit || num_blocks > crate::MAX_NUM_BLOCKS {
            return Err(CoreError::InvalidArgument(format!(
                "an external buffer of {} bytes holds {fit} blocks of {block_bytes} bytes; asked for {num_blocks} (1..={} and no more than fit)",
                slab.len_bytes(),
                crate::MAX_NUM_BLOCKS
            )));
        }
        let device_context = Self::device_context_for(slab.device())?;
        let allocator = BlockAllocator::new(num_blocks)?;
        Self::assemble(layout.into(), allocator, Backing::Fixed(Box::new(slab)), device_context)
    }

    /// A metadata-only pool: `num_blocks` block ids with their reference counts, tables,
    /// prefix cache and events, and no memory (an engine that keeps its KV in its own
    /// tensors uses kvpool as its block manager). Every call that would reach block memory
    /// (addresses, views, copies, a host tier) refuses with `InvalidArgument` naming the mode.
    pub fn new_metadata_only(layout: KvLayout, num_blocks: usize) -> Result<Self, CoreError> {
        if num_blocks == 0 || num_blocks > crate::MAX_NUM_BLOCKS {
            return Err(CoreError::InvalidArgument(format!(
                "num_blocks must be in 1..={} (MAX_NUM_BLOCKS), got {num_blocks}",
                crate::MAX_NUM_BLOCKS
            )));
        }
        let allocator = BlockAllocator::new(num_blocks)?;
        Self::assemble(
            layout.into(),
            allocator,
            Backing::Fixed(Box::new(NoSlab)),
            Default::default(),
        )
    }

    /// False for a metadata-only pool.
    pub fn has_memory(&self) -> bool {
        self.backing.slab().has_memory()
    }

    /// Refuses `what` (a call that needs block memory) on a metadata-only pool.
    pub fn require_memory(&self, what: &str) -> Result<(), CoreError> {
        if self.has_memory() {
            return Ok(());
        }
        Err(CoreError::InvalidArgument(format!(
            "{what} needs block memory; this is a metadata-only pool (device=\"none\"): it keeps ids, tables, the prefix cache and events, and the KV lives elsewhere"
        )))
    }
}
