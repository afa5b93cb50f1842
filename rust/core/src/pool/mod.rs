//! `Pool`: a block allocator bound to a slab and a layout. Block `id` occupies
//! `[base_ptr + id * block_bytes, base_ptr + (id + 1) * block_bytes)`.
//!
//! A pool is fixed (one allocation of `num_blocks` blocks) or growable (a reserved range of
//! `max_num_blocks` blocks backed chunk by chunk; `growth.rs` holds grow, shrink and the
//! allocation slow path). `base_ptr` never changes in either.
//!
//! With prefix caching (`prefix.rs`), cached blocks nobody references are evictable: off
//! the free list, reused by a hit or evicted when the free list runs short.

mod prefix;

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::{Mutex, Weak};

use crate::allocator::BlockAllocator;
use crate::error::CoreError;
use crate::layout::KvLayout;
use crate::prefix_cache::PrefixCache;
use crate::slab::{self, ChunkBackend, Device, GrowableSlab, MemoryInfo, Slab};

/// How big a pool to make.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PoolSize {
    NumBlocks(usize),
    /// As many blocks as fit in this many bytes.
    MemoryBytes(usize),
    /// A fraction in (0, 1] of the device's free memory now (vLLM's `gpu_memory_utilization`
    /// applied to free rather than total memory, since other users may hold the rest).
    DeviceMemoryFraction(f64),
}

/// Sizes of a growable pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrowableSize {
    /// The reservation: the pool never holds more blocks.
    pub max_num_blocks: usize,
    /// Blocks mapped at creation (rounded up to whole chunks, so there may be more).
    pub initial_num_blocks: usize,
    /// Bytes per chunk; `None`: 2 MiB on the host, the driver's granularity on CUDA.
    pub chunk_bytes: Option<usize>,
}

pub(crate) enum Backing {
    Fixed(Box<dyn Slab>),
    Growable(GrowableSlab),
}

impl Backing {
    fn slab(&self) -> &dyn Slab {
        match self {
            Backing::Fixed(slab) => slab.as_ref(),
            Backing::Growable(slab) => slab,
        }
    }
}

pub struct Pool {
    pub(crate) layout: KvLayout,
    pub(crate) allocator: BlockAllocator,
    pub(crate) backing: Backing,
    /// Everything that holds block references (block tables), so `check_invariants` can
    /// compare the references they hold with the pool's counts. Not on any hot path.
    ref_holders: Mutex<Vec<Weak<dyn RefHolder>>>,
    /// Extents (in blocks) of the live views over the slab: extent -> number of views. A
    /// shrink never unmaps memory below the largest (see [`Pool::pin_view_extent`]).
    view_extents: Mutex<BTreeMap<usize, usize>>,
    /// `None` unless the pool was made [`with_prefix_caching`](Pool::with_prefix_caching).
    pub(crate) prefix_cache: Option<PrefixCache>,
}

/// Something that holds references to a pool's blocks (a `BlockTables`).
pub trait RefHolder: Send + Sync {
    /// Adds, for every block it references, one to `counts[block_id]` per reference.
    fn count_refs(&self, counts: &mut [u32]);
}

/// A plain snapshot of a pool's counters.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolStats {
    pub num_blocks: usize,
    /// `num_blocks` for a fixed pool.
    pub max_num_blocks: usize,
    pub growable: bool,
    /// Bytes backed by memory now, and the reservation (equal for fixed pools).
    /// `mapped_bytes` is always the same number as `slab_bytes` (both are the slab's
    /// `len_bytes`); it is kept under both names, the growable pool's and the fixed pool's.
    pub mapped_bytes: usize,
    pub reserved_bytes: usize,
    /// Mapped chunks and their size (a fixed pool is one chunk: its whole slab).
    pub num_chunks: usize,
    pub chunk_bytes: usize,
    /// On the free list.
    pub num_free: usize,
    /// Cached and unreferenced (0 without prefix caching).
    pub num_evictable: usize,
    /// Referenced: `num_free + num_evictable + num_used == num_blocks`.
    pub num_used: usize,
    pub high_water: usize,
    pub block_bytes: usize,
    /// Same as `mapped_bytes`.
    pub slab_bytes: usize,
    pub device: Device,
    pub memory: Option<MemoryInfo>,
}

impl Pool {
    pub fn new(layout: KvLayout, size: PoolSize, device: Device) -> Result<Self, CoreError> {
        let num_blocks = Self::resolve_num_blocks(&layout, size, device)?;
        let allocator = BlockAllocator::new(num_blocks)?;
        let slab_bytes = num_blocks
            .checked_mul(layout.block_bytes())
            .ok_or_else(|| CoreError::InvalidArgument(format!("{num_blocks} blocks overflow the address space")))?;
        let slab = slab::allocate(device, slab_bytes)?;
        Ok(Pool { layout, allocator, backing: Backing::Fixed(slab), ref_holders: Mutex::new(Vec::new()), view_extents: Mutex::new(BTreeMap::new()), prefix_cache: None })
    }

    /// A growable pool on `device`: reserves room for `size.max_num_blocks` and maps enough
    /// chunks for `size.initial_num_blocks`.
    pub fn new_growable(layout: KvLayout, size: GrowableSize, device: Device) -> Result<Self, CoreError> {
        let reserved_bytes = Self::reservation_for(&layout, size)?;
        let slab = slab::reserve_growable(device, reserved_bytes, size.chunk_bytes)?;
        Self::with_growable_slab(layout, size, slab)
    }

    /// A growable pool over any chunk backend (tests inject failing ones). `size.chunk_bytes`
    /// is ignored: the backend has its own.
    pub fn with_chunk_backend(layout: KvLayout, size: GrowableSize, backend: Box<dyn ChunkBackend>) -> Result<Self, CoreError> {
        Self::reservation_for(&layout, size)?;
        Self::with_growable_slab(layout, size, GrowableSlab::new(backend))
    }

    fn reservation_for(layout: &KvLayout, size: GrowableSize) -> Result<usize, CoreError> {
        if size.max_num_blocks == 0 || size.initial_num_blocks > size.max_num_blocks {
            return Err(CoreError::InvalidArgument(format!(
                "a growable pool needs 1 <= max_num_blocks and initial_num_blocks <= max_num_blocks, got {} and {}",
                size.max_num_blocks, size.initial_num_blocks
            )));
        }
        size.max_num_blocks.checked_mul(layout.block_bytes()).ok_or_else(|| {
            CoreError::InvalidArgument(format!("{} blocks overflow the address space", size.max_num_blocks))
        })
    }

    fn with_growable_slab(layout: KvLayout, size: GrowableSize, slab: GrowableSlab) -> Result<Self, CoreError> {
        let needed = size.max_num_blocks * layout.block_bytes();
        if slab.reserved_bytes() < needed {
            return Err(CoreError::InvalidArgument(format!(
                "the backend reserves {} bytes, {} blocks need {needed}",
                slab.reserved_bytes(),
                size.max_num_blocks
            )));
        }
        let allocator = BlockAllocator::new_growable(0, size.max_num_blocks)?;
        let pool = Pool { layout, allocator, backing: Backing::Growable(slab), ref_holders: Mutex::new(Vec::new()), view_extents: Mutex::new(BTreeMap::new()), prefix_cache: None };
        pool.grow(size.initial_num_blocks).map_err(|e| match e {
            // Creation asked for memory and did not get it: the slab could not be allocated.
            CoreError::CannotGrow { .. } => CoreError::OutOfMemory {
                requested_bytes: size.initial_num_blocks * pool.layout.block_bytes(),
                device: pool.device().to_string(),
            },
            e => e,
        })?;
        Ok(pool)
    }

    fn resolve_num_blocks(layout: &KvLayout, size: PoolSize, device: Device) -> Result<usize, CoreError> {
        let block_bytes = layout.block_bytes();
        let num_blocks = match size {
            PoolSize::NumBlocks(n) => n,
            PoolSize::MemoryBytes(bytes) => bytes / block_bytes,
            PoolSize::DeviceMemoryFraction(fraction) => {
                if !(fraction > 0.0 && fraction <= 1.0) {
                    return Err(CoreError::InvalidArgument(format!(
                        "gpu_memory_utilization must be in (0, 1], got {fraction}"
                    )));
                }
                let info = slab::device_memory_info(device)?.ok_or_else(|| {
                    CoreError::InvalidArgument(
                        "gpu_memory_utilization needs a CUDA device; give num_blocks or memory_bytes for host pools"
                            .into(),
                    )
                })?;
                (info.free_bytes as f64 * fraction) as usize / block_bytes
            }
        };
        if num_blocks == 0 {
            return Err(CoreError::InvalidArgument(format!(
                "{size:?} gives 0 blocks of {block_bytes} bytes; a pool needs at least one"
            )));
        }
        Ok(num_blocks)
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }
    pub fn allocator(&self) -> &BlockAllocator {
        &self.allocator
    }
    pub fn device(&self) -> Device {
        self.backing.slab().device()
    }
    pub fn base_ptr(&self) -> u64 {
        self.backing.slab().base_ptr()
    }
    /// Bytes backed by memory now (for a growable pool, the mapped chunks).
    pub fn slab_bytes(&self) -> usize {
        self.backing.slab().len_bytes()
    }
    pub fn is_growable(&self) -> bool {
        matches!(self.backing, Backing::Growable(_))
    }
    /// Bytes of address space the pool holds (its mapped bytes if it is not growable).
    pub fn reserved_bytes(&self) -> usize {
        match &self.backing {
            Backing::Fixed(slab) => slab.len_bytes(),
            Backing::Growable(slab) => slab.reserved_bytes(),
        }
    }
    pub(crate) fn growable_slab(&self) -> Option<&GrowableSlab> {
        match &self.backing {
            Backing::Fixed(_) => None,
            Backing::Growable(slab) => Some(slab),
        }
    }

    /// Address of block `block_id` (allocated or not; the id must be in range).
    pub fn block_ptr(&self, block_id: u32) -> Result<u64, CoreError> {
        if block_id as usize >= self.num_blocks() {
            return Err(CoreError::out_of_range_id(block_id, self.num_blocks()));
        }
        Ok(self.base_ptr() + block_id as u64 * self.layout.block_bytes() as u64)
    }

    pub fn stats(&self) -> Result<PoolStats, CoreError> {
        let (num_chunks, chunk_bytes) = match &self.backing {
            Backing::Fixed(slab) => (1, slab.len_bytes()),
            Backing::Growable(slab) => (slab.mapped_bytes() / slab.chunk_bytes(), slab.chunk_bytes()),
        };
        Ok(PoolStats {
            num_blocks: self.num_blocks(),
            max_num_blocks: self.max_num_blocks(),
            growable: self.is_growable(),
            mapped_bytes: self.slab_bytes(),
            reserved_bytes: self.reserved_bytes(),
            num_chunks,
            chunk_bytes,
            num_free: self.num_free(),
            num_evictable: self.num_evictable(),
            num_used: self.num_used(),
            high_water: self.high_water(),
            block_bytes: self.layout.block_bytes(),
            slab_bytes: self.slab_bytes(),
            device: self.device(),
            memory: self.backing.slab().memory_info()?,
        })
    }

    /// Registers a holder of block references for `check_invariants`.
    pub fn register_ref_holder(&self, holder: Weak<dyn RefHolder>) {
        let mut holders = self.ref_holders.lock().unwrap_or_else(|p| p.into_inner());
        holders.retain(|h| h.strong_count() > 0);
        holders.push(holder);
    }

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

    fn view_extents(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, usize>> {
        // Every update completes without panicking, so a poisoned map is still consistent.
        self.view_extents.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The CUDA context and the pool's stream (`None` on the host).
    #[cfg(feature = "cuda")]
    pub fn cuda(&self) -> Option<(&std::sync::Arc<cudarc::driver::CudaContext>, &crate::cuda::Stream)> {
        self.backing.slab().cuda()
    }

    /// Raw handle of the pool's CUDA stream (`None` on the host).
    pub fn stream_handle(&self) -> Option<u64> {
        #[cfg(feature = "cuda")]
        {
            self.backing.slab().cuda().map(|(_, stream)| stream.raw() as u64)
        }
        #[cfg(not(feature = "cuda"))]
        {
            None
        }
    }

    /// Checks the allocator's invariants, then that no block has fewer references than the
    /// registered block tables hold, and, when `exact_refs` is set (nothing but the tables
    /// holds blocks), that every block's count equals the tables' references exactly.
    pub fn check_invariants_with(&self, exact_refs: bool) -> Result<(), String> {
        self.check_invariants()?;
        let mut held = vec![0u32; self.num_blocks()];
        let holders: Vec<_> = {
            let holders = self.ref_holders.lock().unwrap_or_else(|p| p.into_inner());
            holders.iter().filter_map(Weak::upgrade).collect()
        };
        for holder in holders {
            holder.count_refs(&mut held);
        }
        for (id, &refs) in held.iter().enumerate() {
            let rc = self.allocator.ref_cnt(id as u32).map_err(|e| e.to_string())?;
            if refs > rc || (exact_refs && refs != rc) {
                return Err(format!("block {id}: block tables hold {refs} references, its ref_cnt is {rc}"));
            }
        }
        Ok(())
    }

    pub fn check_invariants(&self) -> Result<(), String> {
        match self.growable_slab() {
            None => {
                self.check_block_invariants()?;
                let expected = self.num_blocks() * self.layout.block_bytes();
                if self.slab_bytes() < expected {
                    return Err(format!("slab holds {} bytes, {} blocks need {expected}", self.slab_bytes(), self.num_blocks()));
                }
                Ok(())
            }
            // Under the resize lock, so the mapping cannot change while it is compared.
            Some(slab) => self.check_growable_invariants(&slab.lock()),
        }
    }
}

/// A pool is used through its allocator's methods (`alloc`, `free_many`, ...).
impl Deref for Pool {
    type Target = BlockAllocator;
    fn deref(&self) -> &BlockAllocator {
        &self.allocator
    }
}
