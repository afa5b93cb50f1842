//! `Pool`: a block allocator bound to a slab and a layout. Block `id` occupies
//! `[base_ptr + id * block_bytes, base_ptr + (id + 1) * block_bytes)`.
//!
//! A pool is fixed (one allocation of `num_blocks` blocks) or growable (a reserved range of
//! `max_num_blocks` blocks backed chunk by chunk). `base_ptr` never changes in either.
//!
//! - `geometry.rs`: what a block is: one `KvLayout`'s block, or a hybrid model's page of
//!   fixed bytes (`PoolGeometry`).
//! - `mod.rs`: construction, the block API (forwarded to the allocator; allocation grows a
//!   growable pool), stats and invariants.
//! - `growth.rs`: grow, shrink and the allocation slow path (design: `growable.md`).
//! - `views.rs`: the extents live views pin, which a shrink must keep mapped.
//! - `prefix.rs`: the evictable set of prefix caching beside the free list: cached
//!   blocks nobody references, reused by a hit or evicted when the free list runs short.
//! - `spill.rs`: the prefix cache's optional second tier in host memory, which the pool
//!   owns beside the cache and hands to the cache calls that evict or hit.
//! - `evicted.rs`: the optional stage that hands blocks leaving the last in-memory tier,
//!   with their hashes, to a tier below memory (a disk tier); `lower.rs` joins it and the
//!   host tier into the one target the cache calls.
//! - `checksum.rs`: CRC-32C of blocks, for tiers that verify what they read back.
//! - `device.rs`: the CUDA context and the pool's stream (CUDA pools only).
//!
//! The allocator is private to the crate: every block operation goes through the pool, so no
//! caller can allocate past a growable pool's growth path.

mod checksum;
mod crc;
#[cfg(feature = "cuda")]
mod device;
mod evicted;
mod external;
mod geometry;
mod growth;
mod lower;
mod owner;
mod prefix;
mod spill;
mod views;

#[cfg(feature = "cuda")]
pub use device::DeviceContext;
pub use evicted::{EvictionStage, EvictionStageStats, STAGE_ALIGN_BYTES};
pub use geometry::{PoolGeometry, PAGE_HASH_CHUNK_TOKENS};

use std::collections::BTreeMap;
use std::sync::{Mutex, Weak};

pub(crate) use evicted::AttachedStage;
#[cfg(test)]
pub(crate) use lower::LowerTiers;
pub(crate) use owner::Owner;
use owner::Owners;
pub(crate) use spill::SpillTier;

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
    /// Bytes per chunk, at least 1: rounded up to the page size (host) or the driver's
    /// granularity (CUDA), and capped at the reservation (`max_num_blocks * block_bytes`,
    /// rounded up alike). `None`: 2 MiB on the host, `DEFAULT_CUDA_CHUNK_BYTES` (or the whole
    /// reservation if smaller) on CUDA.
    pub chunk_bytes: Option<usize>,
}

enum Backing {
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
    geometry: PoolGeometry,
    allocator: BlockAllocator,
    /// Which API each allocated block belongs to (see `owner.rs`).
    owners: Owners,
    backing: Backing,
    /// The CUDA context and the pool's own stream (`None` on the host).
    #[cfg(feature = "cuda")]
    device_context: Option<DeviceContext>,
    /// Everything that holds block references (block tables), so `check_invariants` can
    /// compare the references they hold with the pool's counts. Not on any hot path.
    ref_holders: Mutex<Vec<Weak<dyn RefHolder>>>,
    /// Extents (in blocks) of the live views over the slab: extent -> number of views. A
    /// shrink never unmaps memory below the largest (see [`Pool::pin_view_extent`]).
    view_extents: Mutex<BTreeMap<usize, usize>>,
    /// `None` unless the pool was made [`with_prefix_caching`](Pool::with_prefix_caching).
    pub(crate) prefix_cache: Option<PrefixCache>,
    /// What lies below the prefix cache: its host tier, if it has one
    /// (`with_prefix_host_tier`), and the eviction stage, once attached.
    lower: lower::LowerTiers,
    /// A host tier's pool (`new_host_tier`): its blocks are taken only by swaps, so the plain
    /// block API refuses to allocate from it.
    host_tier: bool,
}

#[cfg(feature = "cuda")]
type DeviceContextSlot = Option<DeviceContext>;
#[cfg(not(feature = "cuda"))]
type DeviceContextSlot = ();

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
    /// The most blocks ever used (referenced) at once; evictable blocks are not used.
    pub high_water: usize,
    pub block_bytes: usize,
    pub device: Device,
    pub memory: Option<MemoryInfo>,
}

impl Pool {
    /// A fixed pool of `size` on `device`, its blocks a `KvLayout`'s or a hybrid model's
    /// pages (`&ModelKvSpec`, or any [`PoolGeometry`]).
    pub fn new(
        geometry: impl Into<PoolGeometry>,
        size: PoolSize,
        device: Device,
    ) -> Result<Self, CoreError> {
        let geometry = geometry.into();
        let num_blocks = Self::resolve_num_blocks(geometry.block_bytes(), size, device)?;
        let slab_bytes = num_blocks.checked_mul(geometry.block_bytes()).ok_or_else(|| {
            CoreError::InvalidArgument(format!("{num_blocks} blocks overflow the address space"))
        })?;
        let device_context = Self::device_context_for(device)?;
        // The slab first: it is the large allocation, and it fails cleanly (OutOfMemory)
        // before any per-block bookkeeping is sized for a count that cannot be backed.
        let slab = slab::allocate(device, slab_bytes)?;
        let allocator = BlockAllocator::new(num_blocks)?;
        Self::assemble(geometry, allocator, Backing::Fixed(slab), device_context)
    }

    /// A fixed pool of host memory for a host tier (`tier/`): page-locked for CUDA device
    /// `pinned_for`, so copies between it and that device run asynchronously, or plain host
    /// memory when `None` (a host tier of a host pool, as CI tests it).
    pub fn new_host_tier(
        geometry: impl Into<PoolGeometry>,
        size: PoolSize,
        pinned_for: Option<usize>,
    ) -> Result<Self, CoreError> {
        let geometry = geometry.into();
        let num_blocks = Self::resolve_num_blocks(geometry.block_bytes(), size, Device::Host)?;
        let slab_bytes = num_blocks.checked_mul(geometry.block_bytes()).ok_or_else(|| {
            CoreError::InvalidArgument(format!("{num_blocks} blocks overflow the address space"))
        })?;
        let slab = slab::allocate_host_tier(slab_bytes, pinned_for)?;
        let allocator = BlockAllocator::new(num_blocks)?;
        let mut pool =
            Self::assemble(geometry, allocator, Backing::Fixed(slab), Default::default())?;
        pool.host_tier = true;
        Ok(pool)
    }

    /// The parts of a pool, with no holders or views yet.
    fn assemble(
        geometry: PoolGeometry,
        allocator: BlockAllocator,
        backing: Backing,
        device_context: DeviceContextSlot,
    ) -> Result<Self, CoreError> {
        #[cfg(not(feature = "cuda"))]
        let () = device_context;
        Ok(Pool {
            geometry,
            owners: Owners::new(allocator.max_num_blocks())?,
            allocator,
            backing,
            #[cfg(feature = "cuda")]
            device_context,
            ref_holders: Mutex::new(Vec::new()),
            view_extents: Mutex::new(BTreeMap::new()),
            prefix_cache: None,
            lower: Default::default(),
            host_tier: false,
        })
    }

    /// The context and stream a pool on `device` needs (none on the host).
    fn device_context_for(device: Device) -> Result<DeviceContextSlot, CoreError> {
        match device {
            Device::Host => Ok(Default::default()),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => DeviceContext::new(ordinal).map(Some),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Ok(()),
        }
    }

    /// A growable pool on `device`: reserves room for `size.max_num_blocks` and maps enough
    /// chunks for `size.initial_num_blocks`.
    pub fn new_growable(
        geometry: impl Into<PoolGeometry>,
        size: GrowableSize,
        device: Device,
    ) -> Result<Self, CoreError> {
        let geometry = geometry.into();
        let reserved_bytes = Self::reservation_for(geometry.block_bytes(), size)?;
        // A chunk larger than the whole reservation would map more than the pool can use.
        let chunk_bytes = size.chunk_bytes.map(|c| c.min(reserved_bytes));
        let slab = slab::reserve_growable(device, reserved_bytes, chunk_bytes)?;
        Self::with_growable_slab(geometry, size, slab)
    }

    /// A growable pool over any chunk backend (tests inject failing ones). `size.chunk_bytes`
    /// is ignored: the backend has its own.
    pub fn with_chunk_backend(
        geometry: impl Into<PoolGeometry>,
        size: GrowableSize,
        backend: Box<dyn ChunkBackend>,
    ) -> Result<Self, CoreError> {
        let geometry = geometry.into();
        Self::reservation_for(geometry.block_bytes(), size)?;
        Self::with_growable_slab(geometry, size, GrowableSlab::new(backend))
    }

    /// The bytes to reserve; refuses, before anything is reserved, a `max_num_blocks` past
    /// `MAX_NUM_BLOCKS` (however large) and a `chunk_bytes` of 0.
    fn reservation_for(block_bytes: usize, size: GrowableSize) -> Result<usize, CoreError> {
        if size.max_num_blocks == 0 || size.max_num_blocks > crate::MAX_NUM_BLOCKS {
            return Err(CoreError::InvalidArgument(format!(
                "max_num_blocks must be in 1..={} (MAX_NUM_BLOCKS), got {}",
                crate::MAX_NUM_BLOCKS,
                size.max_num_blocks
            )));
        }
        if size.chunk_bytes == Some(0) {
            return Err(CoreError::InvalidArgument(
                "chunk_bytes must be at least 1 (it is rounded up to the page size or the driver's granularity, and capped at max_num_blocks * block_bytes), got 0".into(),
            ));
        }
        if size.initial_num_blocks > size.max_num_blocks {
            return Err(CoreError::InvalidArgument(format!(
                "a growable pool needs initial_num_blocks <= max_num_blocks, got {} and {}",
                size.max_num_blocks, size.initial_num_blocks
            )));
        }
        size.max_num_blocks.checked_mul(block_bytes).ok_or_else(|| {
            CoreError::InvalidArgument(format!(
                "{} blocks overflow the address space",
                size.max_num_blocks
            ))
        })
    }

    fn with_growable_slab(
        geometry: PoolGeometry,
        size: GrowableSize,
        slab: GrowableSlab,
    ) -> Result<Self, CoreError> {
        let needed = size.max_num_blocks * geometry.block_bytes();
        if slab.reserved_bytes() < needed {
            return Err(CoreError::InvalidArgument(format!(
                "the backend reserves {} bytes, {} blocks need {needed}",
                slab.reserved_bytes(),
                size.max_num_blocks
            )));
        }
        let allocator = BlockAllocator::new_growable(0, size.max_num_blocks)?;
        let device_context = Self::device_context_for(slab.device())?;
        let pool = Self::assemble(geometry, allocator, Backing::Growable(slab), device_context)?;
        pool.grow(size.initial_num_blocks).map_err(|e| match e {
            // Creation asked for memory and did not get it: the slab could not be allocated.
            CoreError::CannotGrow { .. } => CoreError::OutOfMemory {
                requested_bytes: size.initial_num_blocks * pool.block_bytes(),
                device: pool.device().to_string(),
            },
            e => e,
        })?;
        Ok(pool)
    }

    fn resolve_num_blocks(
        block_bytes: usize,
        size: PoolSize,
        device: Device,
    ) -> Result<usize, CoreError> {
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
        if num_blocks == 0 || num_blocks > crate::MAX_NUM_BLOCKS {
            // Named by what the caller gave: a memory size is not a block count.
            let given = match size {
                PoolSize::NumBlocks(n) => {
                    return Err(CoreError::InvalidArgument(format!(
                        "num_blocks must be in 1..={} (MAX_NUM_BLOCKS), got {n}",
                        crate::MAX_NUM_BLOCKS
                    )))
                }
                PoolSize::MemoryBytes(bytes) => format!("memory_bytes={bytes}"),
                PoolSize::DeviceMemoryFraction(fraction) => {
                    format!("gpu_memory_utilization={fraction}")
                }
            };
            return Err(CoreError::InvalidArgument(format!(
                "{given} holds {num_blocks} blocks of {block_bytes} bytes; a pool holds 1..={} blocks",
                crate::MAX_NUM_BLOCKS
            )));
        }
        Ok(num_blocks)
    }

    /// Blocks that exist now (backed by memory).
    pub fn num_blocks(&self) -> usize {
        self.allocator.num_blocks()
    }
    /// The most blocks this pool can ever hold (`num_blocks` unless growable).
    pub fn max_num_blocks(&self) -> usize {
        self.allocator.max_num_blocks()
    }
    /// Free blocks now (a snapshot under concurrency).
    pub fn num_free(&self) -> usize {
        self.allocator.num_free()
    }
    /// Blocks referenced by someone: neither free nor evictable.
    pub fn num_used(&self) -> usize {
        self.allocator.num_used().saturating_sub(self.num_evictable())
    }
    /// The most blocks ever in use at once. With prefix caching, "in use" is referenced:
    /// evictable cached blocks count as free (as in vLLM's usage), so a pool full of
    /// reusable cache does not look full. Sampled after every allocation (and, with prefix
    /// caching, every prefix hit) and on every read; exact while one thread uses the pool.
    pub fn high_water(&self) -> usize {
        match &self.prefix_cache {
            Some(cache) => cache.raise_used_high_water(self.num_used()),
            None => self.allocator.high_water(),
        }
    }
    /// Current reference count of a block (0: free).
    pub fn ref_cnt(&self, block_id: u32) -> Result<u32, CoreError> {
        self.allocator.ref_cnt(block_id)
    }

    pub fn alloc(&self) -> Result<u32, CoreError> {
        let mut id = [0u32];
        self.alloc_into(&mut id)?;
        Ok(id[0])
    }

    /// Allocates `count` blocks, all or none, growing a growable pool if needed.
    pub fn alloc_many(&self, count: usize) -> Result<Vec<u32>, CoreError> {
        self.alloc_many_for(count, Owner::Pool)
    }

    /// [`alloc_many`](Self::alloc_many) on behalf of `owner`, whose tag the new ids get. It
    /// allocates for requests, never for a swap, so a host tier's pool refuses it whatever
    /// the owner.
    pub(crate) fn alloc_many_for(&self, count: usize, owner: Owner) -> Result<Vec<u32>, CoreError> {
        self.refuse_if_host_tier()?;
        if count > self.max_num_blocks() {
            // Can never succeed: refuse before sizing a buffer for it.
            return Err(self.out_of_blocks(count, "the request exceeds max_num_blocks"));
        }
        let mut ids = Vec::new();
        ids.try_reserve_exact(count).map_err(|_| CoreError::OutOfMemory {
            requested_bytes: count * 4,
            device: "host".into(),
        })?;
        ids.resize(count, 0);
        self.alloc_into_for(&mut ids, owner)?;
        Ok(ids)
    }

    /// Fills `out` with newly allocated ids (ref count 1), or fails having taken none. A
    /// growable pool that finds too few free blocks grows first; if it cannot, it fails with
    /// `CannotGrow` and is exactly as it was. A host tier's pool refuses (`InvalidArgument`):
    /// its free blocks are the tier's room for swaps.
    pub fn alloc_into(&self, out: &mut [u32]) -> Result<(), CoreError> {
        self.alloc_into_for(out, Owner::Pool)
    }

    /// Drops one reference; the block returns to the free list when its count reaches 0.
    /// A block that block tables hold is refused (`InvalidBlock`), changing nothing.
    pub fn free(&self, block_id: u32) -> Result<(), CoreError> {
        self.free_many_for(&[block_id], Owner::Pool)
    }

    /// Drops one reference to each id, all or none (bad, repeated, free or table-held ids
    /// change nothing).
    pub fn free_many(&self, block_ids: &[u32]) -> Result<(), CoreError> {
        self.free_many_for(block_ids, Owner::Pool)
    }

    /// Adds one reference to each id. All must be allocated through the pool API.
    pub fn share_many(&self, block_ids: &[u32]) -> Result<(), CoreError> {
        self.share_many_for(block_ids, Owner::Pool)
    }

    /// [`alloc_into`](Self::alloc_into) on behalf of `owner`, whose tag the new ids get.
    pub(crate) fn alloc_into_for(&self, out: &mut [u32], owner: Owner) -> Result<(), CoreError> {
        if owner == Owner::Pool {
            self.refuse_if_host_tier()?;
        }
        match (self.allocator.alloc_into(out), self.growable_slab()) {
            (Err(CoreError::OutOfBlocks { .. }), _) if self.prefix_cache.is_some() => {
                self.alloc_evicting(out)?
            }
            (Err(CoreError::OutOfBlocks { .. }), Some(slab)) => {
                self.alloc_growing(&mut slab.lock(), out)?
            }
            (result, _) => result?,
        }
        if let Some(cache) = &self.prefix_cache {
            cache.raise_used_high_water(self.num_used());
        }
        self.owners.set(out, owner);
        Ok(())
    }

    /// The plain block API's refusal on a host tier's pool.
    fn refuse_if_host_tier(&self) -> Result<(), CoreError> {
        if !self.host_tier {
            return Ok(());
        }
        Err(CoreError::InvalidArgument(
            "this pool is a host tier's: its blocks are taken only by swaps (HostTier.swap_out); allocate from the device pool".into(),
        ))
    }

    /// [`free_many`](Self::free_many) on behalf of `owner`: every allocated id must be its.
    pub(crate) fn free_many_for(&self, block_ids: &[u32], owner: Owner) -> Result<(), CoreError> {
        self.check_owner(block_ids, owner)?;
        match (&self.prefix_cache, block_ids) {
            (Some(cache), _) => self.free_many_cached(cache, block_ids),
            (None, [id]) => self.allocator.free(*id),
            (None, _) => self.allocator.free_many(block_ids),
        }
    }

    /// [`share_many`](Self::share_many) on behalf of `owner`: every allocated id must be its.
    pub(crate) fn share_many_for(&self, block_ids: &[u32], owner: Owner) -> Result<(), CoreError> {
        self.check_owner(block_ids, owner)?;
        self.allocator.share_many(block_ids)
    }

    /// The API that allocated `block_id` (meaningful while it is allocated).
    pub(crate) fn owner(&self, block_id: u32) -> Owner {
        self.owners.get(block_id)
    }

    /// Refuses an allocated id that belongs to another owner. Ids out of range or free are
    /// left to the allocator, which names them (`InvalidBlock`, `DoubleFree`).
    fn check_owner(&self, block_ids: &[u32], owner: Owner) -> Result<(), CoreError> {
        let num_blocks = self.num_blocks();
        for &id in block_ids {
            if (id as usize) < num_blocks && self.allocator.ref_cnt_unchecked(id as usize) > 0 {
                let actual = self.owners.get(id);
                if actual != owner {
                    return Err(CoreError::InvalidBlock {
                        value: id.to_string(),
                        reason: actual.describe().into(),
                    });
                }
            }
        }
        Ok(())
    }

    /// What this pool's blocks are: a layout's blocks or a hybrid model's pages.
    pub fn geometry(&self) -> &PoolGeometry {
        &self.geometry
    }
    /// Bytes of one block (one page).
    pub fn block_bytes(&self) -> usize {
        self.geometry.block_bytes()
    }
    /// The layout of every block; refused (`InvalidLayout`) on a pool of a hybrid model's
    /// pages, which has none.
    pub fn layout(&self) -> Result<&KvLayout, CoreError> {
        self.geometry.layout()
    }
    pub fn device(&self) -> Device {
        self.backing.slab().device()
    }
    pub fn base_ptr(&self) -> u64 {
        self.backing.slab().base_ptr()
    }
    /// Bytes backed by memory now (for a growable pool, the mapped chunks).
    pub fn mapped_bytes(&self) -> usize {
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
        self.require_memory("block_ptr")?;
        if block_id as usize >= self.num_blocks() {
            return Err(CoreError::out_of_range_id(block_id, self.num_blocks()));
        }
        Ok(self.base_ptr() + block_id as u64 * self.block_bytes() as u64)
    }

    pub fn stats(&self) -> Result<PoolStats, CoreError> {
        let (num_chunks, chunk_bytes) = match &self.backing {
            Backing::Fixed(slab) => (1, slab.len_bytes()),
            Backing::Growable(slab) => {
                (slab.mapped_bytes() / slab.chunk_bytes(), slab.chunk_bytes())
            }
        };
        Ok(PoolStats {
            num_blocks: self.num_blocks(),
            max_num_blocks: self.max_num_blocks(),
            growable: self.is_growable(),
            mapped_bytes: self.mapped_bytes(),
            reserved_bytes: self.reserved_bytes(),
            num_chunks,
            chunk_bytes,
            num_free: self.num_free(),
            num_evictable: self.num_evictable(),
            num_used: self.num_used(),
            high_water: self.high_water(),
            block_bytes: self.block_bytes(),
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

    /// The CUDA context and the pool's stream (`None` on the host).
    #[cfg(feature = "cuda")]
    pub fn device_context(&self) -> Option<&DeviceContext> {
        self.device_context.as_ref()
    }

    /// Raw handle of the pool's CUDA stream (`None` on the host).
    pub fn stream_handle(&self) -> Option<u64> {
        #[cfg(feature = "cuda")]
        {
            self.device_context.as_ref().map(|dc| dc.stream().raw() as u64)
        }
        #[cfg(not(feature = "cuda"))]
        {
            None
        }
    }

    /// Checks [`check_invariants`](Self::check_invariants), then, with `refs(b)` the
    /// references the registered block tables hold to block `b`:
    ///
    /// ```text
    /// refs(b) <= ref_cnt(b)                  (== when exact_refs: nothing else holds blocks)
    /// refs(b) > 0  =>  owner(b) == Tables
    /// ```
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
                return Err(format!(
                    "block {id}: block tables hold {refs} references, its ref_cnt is {rc}"
                ));
            }
            if refs > 0 && self.owners.get(id as u32) != Owner::Tables {
                return Err(format!(
                    "block {id} is held by block tables but tagged {:?}",
                    self.owners.get(id as u32)
                ));
            }
        }
        Ok(())
    }

    /// The allocator's invariants (`num_free + num_used == num_blocks`, every free id on the
    /// list once and `< num_blocks`, free iff `ref_cnt == 0`), then the memory's:
    ///
    /// ```text
    /// fixed:    num_blocks * block_bytes <= mapped_bytes
    /// growable: see `check_growable_invariants` (taken under the resize lock)
    /// ```
    ///
    /// Exact only while no other thread uses the pool.
    pub fn check_invariants(&self) -> Result<(), String> {
        match self.growable_slab() {
            None => {
                self.check_block_invariants()?;
                let expected = self.num_blocks() * self.block_bytes();
                if self.has_memory() && self.mapped_bytes() < expected {
                    return Err(format!(
                        "slab holds {} bytes, {} blocks need {expected}",
                        self.mapped_bytes(),
                        self.num_blocks()
                    ));
                }
                Ok(())
            }
            // Under the resize lock, so the mapping cannot change while it is compared.
            Some(slab) => self.check_growable_invariants(&slab.lock()),
        }
    }
}
