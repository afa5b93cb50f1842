//! Growable slab: one reserved address range whose chunks are backed by memory on demand.
//!
//! ```text
//!  base_ptr                                                    base_ptr + reserved_bytes
//!  |<- chunk 0 ->|<- chunk 1 ->|<- chunk 2 ->|<- chunk 3 ->| ... |
//!  [   mapped    |   mapped    |  reserved, no memory behind it  ]
//!  [blk0|blk1|blk2|blk3|blk4|b5]                                   num_blocks = floor(mapped / block_bytes)
//! ```
//!
//! Mapped chunks are always a prefix `0..mapped_chunks`, so the address of every block stays
//! `base_ptr + id * block_bytes` for the slab's whole life: growing never moves a block, and
//! a block table uploaded before a growth is still right after it. A block may straddle two
//! chunks; it exists only once both are mapped.
//!
//! A [`ChunkBackend`] does the mapping (host: `mmap`/`mprotect`, CUDA: the driver's virtual
//! memory API). [`GrowableSlab`] keeps the mapped count behind a mutex that is also the pool's
//! resize lock (`pool/growth.rs`): holding a [`ResizeGuard`] is what allows changing it.

#[cfg(loom)]
use loom::sync::{Mutex, MutexGuard};
#[cfg(not(loom))]
use std::sync::{Mutex, MutexGuard};

use crate::sync::{AtomicUsize, Ordering};

use super::{Device, MemoryInfo, Slab};
use crate::error::CoreError;

/// Backs the chunks of one reserved address range with memory.
///
/// The slab calls `map_chunks` and `unmap_chunks` only under its lock, with chunks mapped
/// in order as one prefix: `map_chunks(first, n)` only when `0..first` are mapped and the
/// rest are not, `unmap_chunks(first, n)` only on the top `n` mapped chunks. The backend
/// releases whatever is still mapped and the reservation when dropped.
pub trait ChunkBackend: Send + Sync {
    /// First byte of the reservation (a device address for CUDA). Never changes.
    fn base_ptr(&self) -> u64;
    /// Bytes per chunk: a multiple of the page size or of the driver's granularity.
    fn chunk_bytes(&self) -> usize;
    /// Chunks in the reservation.
    fn num_chunks(&self) -> usize;
    fn device(&self) -> Device;
    fn memory_info(&self) -> Result<Option<MemoryInfo>, CoreError>;
    /// Backs chunks `first..first + count` with memory, all or none: on failure the chunks of
    /// this call that were mapped are released again. A refusal for lack of memory is
    /// `CoreError::OutOfMemory`.
    fn map_chunks(&self, first: usize, count: usize) -> Result<(), CoreError>;
    /// Releases chunks `first..first + count` to the system or driver. Their contents are lost.
    /// On failure some of them may still be mapped: the slab then asks
    /// [`mapped_chunks`](Self::mapped_chunks) how many are, and counts that many. A chunk that
    /// is still mapped must stay usable (its blocks go back to the pool).
    fn unmap_chunks(&self, first: usize, count: usize) -> Result<(), CoreError>;
    /// How many chunks (a prefix) are mapped, if the backend keeps count; `None` means that a
    /// failed `unmap_chunks` left every chunk of its range mapped and usable.
    fn mapped_chunks(&self) -> Option<usize> {
        None
    }
}

pub struct GrowableSlab {
    backend: Box<dyn ChunkBackend>,
    /// Number of mapped chunks; the mutex is the pool's resize lock.
    mapped_chunks: Mutex<usize>,
    /// `mapped_chunks * chunk_bytes`, readable without the lock (stats, `len_bytes`).
    mapped_bytes: AtomicUsize,
}

/// Exclusive right to change which chunks are mapped (and, by the pool's convention, how many
/// blocks exist).
pub struct ResizeGuard<'a> {
    slab: &'a GrowableSlab,
    mapped_chunks: MutexGuard<'a, usize>,
}

impl GrowableSlab {
    pub fn new(backend: Box<dyn ChunkBackend>) -> Self {
        GrowableSlab { backend, mapped_chunks: Mutex::new(0), mapped_bytes: AtomicUsize::new(0) }
    }

    /// Takes the resize lock (blocks while another thread grows or shrinks).
    pub fn lock(&self) -> ResizeGuard<'_> {
        // The count is set right after each backend call, from the call's outcome (after a
        // failed unmap, from what the backend reports is still mapped), and nothing between
        // a backend call and that update can panic: a poisoned lock still guards a count that
        // matches the mapping.
        let mapped_chunks = self.mapped_chunks.lock().unwrap_or_else(|p| p.into_inner());
        ResizeGuard { slab: self, mapped_chunks }
    }

    pub fn chunk_bytes(&self) -> usize {
        self.backend.chunk_bytes()
    }
    pub fn num_chunks(&self) -> usize {
        self.backend.num_chunks()
    }
    pub fn reserved_bytes(&self) -> usize {
        self.num_chunks() * self.chunk_bytes()
    }
    /// Bytes backed by memory now (a snapshot).
    pub fn mapped_bytes(&self) -> usize {
        self.mapped_bytes.load(Ordering::Acquire)
    }
}

impl ResizeGuard<'_> {
    pub fn mapped_chunks(&self) -> usize {
        *self.mapped_chunks
    }
    pub fn mapped_bytes(&self) -> usize {
        *self.mapped_chunks * self.slab.chunk_bytes()
    }
    pub fn chunk_bytes(&self) -> usize {
        self.slab.chunk_bytes()
    }

    /// Maps chunks until `chunks` are mapped; all or nothing.
    pub fn map_to(&mut self, chunks: usize) -> Result<(), CoreError> {
        let mapped = *self.mapped_chunks;
        if chunks <= mapped {
            return Ok(());
        }
        if chunks > self.slab.num_chunks() {
            return Err(CoreError::InvalidArgument(format!(
                "{chunks} chunks requested, the reservation holds {}",
                self.slab.num_chunks()
            )));
        }
        self.slab.backend.map_chunks(mapped, chunks - mapped)?;
        self.set(chunks);
        Ok(())
    }

    /// Unmaps the top chunks until `chunks` are mapped. The caller guarantees that no block
    /// with a byte in them is allocated (or can become allocated) and that no live view
    /// reaches into them. On failure the count is what the backend reports is still mapped
    /// (between `chunks` and the count before): [`mapped_chunks`](Self::mapped_chunks) tells
    /// the caller how many blocks still have memory.
    pub fn unmap_to(&mut self, chunks: usize) -> Result<(), CoreError> {
        let mapped = *self.mapped_chunks;
        if chunks >= mapped {
            return Ok(());
        }
        match self.slab.backend.unmap_chunks(chunks, mapped - chunks) {
            Ok(()) => {
                self.set(chunks);
                Ok(())
            }
            Err(e) => {
                // Count exactly what is still mapped: counting too few would make the next
                // `map_to` map over live chunks, counting too many would let blocks live on
                // memory that is gone.
                let still =
                    self.slab.backend.mapped_chunks().unwrap_or(mapped).clamp(chunks, mapped);
                self.set(still);
                Err(e)
            }
        }
    }

    fn set(&mut self, chunks: usize) {
        *self.mapped_chunks = chunks;
        self.slab.mapped_bytes.store(chunks * self.slab.chunk_bytes(), Ordering::Release);
    }
}

impl Slab for GrowableSlab {
    fn base_ptr(&self) -> u64 {
        self.backend.base_ptr()
    }
    /// The mapped bytes: only they may be touched.
    fn len_bytes(&self) -> usize {
        self.mapped_bytes()
    }
    fn device(&self) -> Device {
        self.backend.device()
    }
    fn memory_info(&self) -> Result<Option<MemoryInfo>, CoreError> {
        self.backend.memory_info()
    }
}
