//! Growing and shrinking a growable pool, and the allocation path that grows on demand
//! (design: `growable.md`).
//!
//! The fast path is the allocator's lock-free `alloc_into`, unchanged. Only when it finds too
//! few free blocks does a growable pool take the resize lock (the growable slab's mutex),
//! retry, map chunks, push the new ids and retry again. Every change of `num_blocks` and of
//! the mapping happens under that lock, and a shrink that drains the free list makes
//! concurrent allocations fail only into this slow path, where they wait for the lock and
//! retry: a shrink never causes a spurious `OutOfBlocks`.

use super::Pool;
use crate::error::CoreError;
use crate::slab::ResizeGuard;

impl Pool {
    /// The allocation slow path of [`Pool::alloc_into`], under the resize lock.
    pub(super) fn alloc_growing(
        &self,
        guard: &mut ResizeGuard<'_>,
        out: &mut [u32],
    ) -> Result<(), CoreError> {
        let chunks_before = guard.mapped_chunks();
        loop {
            // Retry first: the resize we may have waited for (a shrink's drain, another
            // thread's growth) may have made room.
            let shortfall = match self.allocator.alloc_into(out) {
                Err(CoreError::OutOfBlocks { requested, free, .. }) => requested - free,
                result => return result,
            };
            // Each pass raises num_blocks by the shortfall, so this ends at max_num_blocks.
            // A pool already there fails fast (re-checked here, under the lock).
            let target = self.num_blocks() + shortfall;
            let grown = if target > self.max_num_blocks() {
                Err(GrowError::MaxReached { shortfall })
            } else {
                self.grow_locked(guard, target).map_err(GrowError::Core)
            };
            if let Err(e) = grown {
                // Give back what this call mapped, if anything (all of it, unless other
                // threads allocated some of the new blocks meanwhile). A failure to give it
                // back leaves the pool consistent (see `shrink_locked`) and must not replace
                // the error the caller gets: it asked for blocks and gets none.
                if guard.mapped_chunks() > chunks_before {
                    let _ = self.shrink_locked(guard, chunks_before);
                }
                // Only a refusal is "cannot grow"; an OS or driver failure is what it is.
                return Err(match e {
                    GrowError::MaxReached { shortfall } => {
                        self.out_of_blocks(out.len(), &self.past_max(shortfall))
                    }
                    GrowError::Core(e @ CoreError::OutOfMemory { .. }) => {
                        self.out_of_blocks(out.len(), &refusal(e))
                    }
                    GrowError::Core(e) => e,
                });
            }
        }
    }

    /// Maps memory until at least `num_blocks` blocks exist (up to `max_num_blocks`); returns
    /// the bytes newly mapped (0 if there already were that many). Fails with `CannotGrow`
    /// past the maximum or when memory is refused, changing nothing.
    pub fn grow(&self, num_blocks: usize) -> Result<usize, CoreError> {
        let Some(slab) = self.growable_slab() else {
            return Err(CoreError::InvalidArgument(
                "grow needs a growable pool (growable=True)".into(),
            ));
        };
        let mut guard = slab.lock();
        if num_blocks > self.max_num_blocks() {
            return Err(self.out_of_blocks(
                num_blocks.saturating_sub(self.num_blocks()),
                &format!(
                    "growing to {num_blocks} blocks would exceed max_num_blocks {}",
                    self.max_num_blocks()
                ),
            ));
        }
        let before = guard.mapped_bytes();
        self.grow_locked(&mut guard, num_blocks).map_err(|e| match e {
            CoreError::OutOfMemory { .. } => {
                self.out_of_blocks(num_blocks - self.num_blocks(), &refusal(e))
            }
            e => e,
        })?;
        Ok(guard.mapped_bytes() - before)
    }

    /// Releases the chunks at the top of the range whose blocks are all free and that no live
    /// view reaches into (see [`Pool::pin_view_extent`]); returns the bytes released, which
    /// is less (possibly 0) while a view pins a larger extent. Afterwards the free list hands
    /// out the lowest ids first, so the top of the range tends to drain for the next shrink.
    /// If the backend fails to unmap, the error is returned and the pool stays consistent:
    /// blocks whose memory is still mapped stay in the pool and on the free list.
    pub fn shrink(&self) -> Result<usize, CoreError> {
        let Some(slab) = self.growable_slab() else { return Ok(0) };
        let mut guard = slab.lock();
        self.evict_for_shrink();
        self.shrink_locked(&mut guard, 0)
    }

    /// Grows a growable pool for a request of `requested` blocks of which `available` can be
    /// had without growing (free, and evictable with prefix caching), by the shortfall. A
    /// refusal names the request and what was available, not the shortfall.
    pub(super) fn grow_for(&self, requested: usize, available: usize) -> Result<(), CoreError> {
        let shortfall = requested.saturating_sub(available);
        let refused = |reason: &str| self.cannot_grow(requested, available, reason);
        if self.num_blocks() + shortfall > self.max_num_blocks() {
            return Err(refused(&self.past_max(shortfall)));
        }
        match self.grow(self.num_blocks() + shortfall) {
            Ok(_) => Ok(()),
            Err(CoreError::CannotGrow { reason, .. }) => Err(refused(&reason)),
            Err(e) => Err(e),
        }
    }

    /// Why growing by `shortfall` blocks is refused by the pool's own limit.
    fn past_max(&self, shortfall: usize) -> String {
        format!(
            "{shortfall} more blocks are needed, max_num_blocks leaves room for {} more ({} mapped)",
            self.max_num_blocks() - self.num_blocks(),
            self.num_blocks()
        )
    }

    /// `CannotGrow` (`OutOfBlocks` for a fixed pool) for a request of `requested` blocks,
    /// with the counts as they are now.
    pub(super) fn out_of_blocks(&self, requested: usize, reason: &str) -> CoreError {
        self.cannot_grow(requested, self.num_free(), reason)
    }

    /// As [`out_of_blocks`](Self::out_of_blocks), with `free` blocks available.
    fn cannot_grow(&self, requested: usize, free: usize, reason: &str) -> CoreError {
        if !self.is_growable() {
            return CoreError::OutOfBlocks { requested, free, num_blocks: self.num_blocks() };
        }
        CoreError::CannotGrow {
            requested,
            free,
            num_blocks: self.num_blocks(),
            max_num_blocks: self.max_num_blocks(),
            reason: reason.to_string(),
        }
    }

    /// Blocks that fit in `mapped_bytes`, capped at the reservation.
    fn blocks_in(&self, mapped_bytes: usize) -> usize {
        (mapped_bytes / self.block_bytes()).min(self.max_num_blocks())
    }

    fn grow_locked(&self, guard: &mut ResizeGuard<'_>, target: usize) -> Result<(), CoreError> {
        let old = self.num_blocks();
        if target <= old {
            return Ok(());
        }
        let chunks = (target * self.block_bytes()).div_ceil(guard.chunk_bytes());
        // The cache's metadata covers the new ids before they exist (first: a failure then
        // leaves nothing to undo; metadata for ids that did not come is merely unused).
        if let Some(cache) = &self.prefix_cache {
            cache.grow_to(self.blocks_in(chunks * guard.chunk_bytes()))?;
        }
        guard.map_to(chunks)?;
        let new_num_blocks = self.blocks_in(guard.mapped_bytes());
        // The new ids and the free ones together, sorted, so the lowest come out first and a
        // growth does not push old low ids under new high ones.
        let mut free_ids = self.allocator.drain_free();
        free_ids.extend(old as u32..new_num_blocks as u32);
        self.allocator.set_num_blocks(new_num_blocks, free_ids);
        Ok(())
    }

    /// Unmaps the top chunks whose blocks are all free, keeping at least `min_chunks` and
    /// every chunk a live view reaches into.
    fn shrink_locked(
        &self,
        guard: &mut ResizeGuard<'_>,
        min_chunks: usize,
    ) -> Result<usize, CoreError> {
        let num_blocks = self.num_blocks();
        let mapped = guard.mapped_chunks();
        // Free blocks, every thread's cached ones included, in our hands (parked): nobody can
        // allocate one of them until we push it back. Not necessarily every free block (ids
        // freed during the drain may stay behind, see `BlockAllocator::drain_free`); an id not
        // drained is treated as allocated (or in flight) and stays.
        let drained = self.allocator.drain_free();
        let mut is_free = vec![false; num_blocks];
        for &id in &drained {
            is_free[id as usize] = true;
        }
        let live_end = is_free.iter().rposition(|&free| !free).map_or(0, |id| id + 1);
        let keep_end = live_end.max(self.max_view_extent());
        let chunk_bytes = guard.chunk_bytes();
        let keep_chunks = (keep_end * self.block_bytes()).div_ceil(chunk_bytes).max(min_chunks);
        if keep_chunks >= mapped {
            self.allocator.set_num_blocks(num_blocks, drained);
            return Ok(0);
        }
        // Blocks new_num_blocks.. are all free (new_num_blocks >= live_end) and now off the
        // list; lower num_blocks before the memory goes.
        let new_num_blocks = self.blocks_in(keep_chunks * chunk_bytes);
        debug_assert!(new_num_blocks >= keep_end);
        let (kept, removed): (Vec<u32>, Vec<u32>) =
            drained.into_iter().partition(|&id| (id as usize) < new_num_blocks);
        self.allocator.set_num_blocks(new_num_blocks, kept);
        let before = guard.mapped_bytes();
        if let Err(e) = guard.unmap_to(keep_chunks) {
            // Some chunks may still be mapped: their blocks (removed ids, all free) come back.
            let restored = self.blocks_in(guard.mapped_bytes());
            let mut free_ids = self.allocator.drain_free();
            free_ids.extend(removed.into_iter().filter(|&id| (id as usize) < restored));
            self.allocator.set_num_blocks(restored, free_ids);
            return Err(e);
        }
        Ok(before - guard.mapped_bytes())
    }

    /// The growable pool's invariants, with the resize lock held (design: `growable.md`):
    ///
    /// ```text
    /// num_blocks * block_bytes <= mapped_bytes <= reserved_bytes
    /// num_blocks == min(floor(mapped_bytes / block_bytes), max_num_blocks)
    /// num_blocks >= max over live views of extent
    /// ref_cnt(id) > 0  =>  (id + 1) * block_bytes <= mapped_bytes      for every id
    /// ```
    pub(super) fn check_growable_invariants(&self, guard: &ResizeGuard<'_>) -> Result<(), String> {
        self.check_block_invariants()?;
        let (num_blocks, block_bytes) = (self.num_blocks(), self.block_bytes());
        let mapped = guard.mapped_bytes();
        let reserved = self.reserved_bytes();
        if !(num_blocks * block_bytes <= mapped && mapped <= reserved) {
            return Err(format!(
                "need num_blocks * block_bytes <= mapped_bytes <= reserved_bytes, got {num_blocks} * {block_bytes} = {}, {mapped}, {reserved}",
                num_blocks * block_bytes
            ));
        }
        if num_blocks < self.max_view_extent() {
            return Err(format!(
                "num_blocks {num_blocks} is below a live view's extent {}",
                self.max_view_extent()
            ));
        }
        if num_blocks != self.blocks_in(mapped) {
            return Err(format!(
                "num_blocks {num_blocks}, but {mapped} mapped bytes hold {}",
                self.blocks_in(mapped)
            ));
        }
        if self.mapped_bytes() != mapped {
            return Err(format!(
                "slab reports {} mapped bytes, the lock holds {mapped}",
                self.mapped_bytes()
            ));
        }
        // Mapped chunks cover every allocated block (ids past num_blocks have ref_cnt 0 by
        // the allocator's check; this one restates the memory side of it).
        for id in 0..self.max_num_blocks() {
            let rc = self.allocator.ref_cnt_unchecked(id);
            if rc > 0 && (id + 1) * block_bytes > mapped {
                return Err(format!(
                    "block {id} is allocated (ref_cnt {rc}) but its memory is not mapped"
                ));
            }
        }
        Ok(())
    }
}

/// Why the allocation slow path could not grow the pool.
enum GrowError {
    /// `max_num_blocks` would be exceeded by growing `shortfall` blocks: the pool cannot
    /// grow, by its own limit.
    MaxReached { shortfall: usize },
    /// The slab's backend failed: a refusal of memory (`OutOfMemory`) or anything else.
    Core(CoreError),
}

/// Why memory was refused, for `CannotGrow`'s reason.
fn refusal(e: CoreError) -> String {
    match e {
        CoreError::OutOfMemory { requested_bytes, device } => {
            format!("{device} refused {requested_bytes} bytes (out of memory)")
        }
        e => e.to_string(),
    }
}
