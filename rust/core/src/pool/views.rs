//! Views over a pool's slab: the extent (in blocks) each live view covers. A shrink never
//! unmaps memory that a live view reaches into, so a view handed to Python (a NumPy array,
//! a `__cuda_array_interface__`) never points at unmapped memory.

use std::collections::BTreeMap;
use std::sync::MutexGuard;

use super::Pool;
use crate::slab::GrowableSlab;

impl Pool {
    /// Pins the blocks that exist now for a view over the slab: returns `num_blocks`, and
    /// until [`unpin_view_extent`](Self::unpin_view_extent) is called with it, a shrink keeps
    /// those blocks' memory mapped (it releases less instead). Taken under the resize lock,
    /// so the extent returned is mapped and stays so.
    pub fn pin_view_extent(&self) -> usize {
        let _guard = self.growable_slab().map(GrowableSlab::lock);
        let extent = self.num_blocks();
        *self.view_extents().entry(extent).or_insert(0) += 1;
        extent
    }

    /// Releases one pin of `extent` taken by [`pin_view_extent`](Self::pin_view_extent).
    pub fn unpin_view_extent(&self, extent: usize) {
        let mut extents = self.view_extents();
        if let Some(count) = extents.get_mut(&extent) {
            *count -= 1;
            if *count == 0 {
                extents.remove(&extent);
            }
        }
    }

    /// The largest extent a live view pins (0 if none).
    pub fn max_view_extent(&self) -> usize {
        self.view_extents().last_key_value().map_or(0, |(&extent, _)| extent)
    }

    fn view_extents(&self) -> MutexGuard<'_, BTreeMap<usize, usize>> {
        // Every update completes without panicking, so a poisoned map is still consistent.
        self.view_extents.lock().unwrap_or_else(|p| p.into_inner())
    }
}
