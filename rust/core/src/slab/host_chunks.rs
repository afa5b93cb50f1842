//! Host chunk backend: the growable slab's logic on plain memory, so CI tests it without a GPU.
//!
//! The whole range is reserved once with `mmap(PROT_NONE, MAP_NORESERVE)`: address space
//! only, no memory and no swap accounted. Mapping a chunk is `mprotect(READ | WRITE)`; its
//! pages are zero and cost memory only once touched. Unmapping is `madvise(MADV_DONTNEED)`
//! (the kernel drops the pages; a private anonymous mapping reads as zero afterwards) then
//! `mprotect(PROT_NONE)`, so a stray access to a released chunk faults instead of silently
//! committing memory again.

use std::io;

use super::growable::ChunkBackend;
use super::{Device, MemoryInfo};
use crate::error::CoreError;

pub struct HostChunks {
    base: usize,
    chunk_bytes: usize,
    num_chunks: usize,
}

fn page_bytes() -> usize {
    // SAFETY: sysconf has no preconditions; it returns -1 for an unknown name.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 {
        page as usize
    } else {
        4096
    }
}

/// The last OS error of a call on `bytes` bytes: lack of memory is `OutOfMemory` (a
/// refusal a growable pool reports as `CannotGrow`), anything else a `System` error.
fn os_error(what: &str, bytes: usize) -> CoreError {
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENOMEM) | Some(libc::EAGAIN) => {
            CoreError::OutOfMemory { requested_bytes: bytes, device: "host".into() }
        }
        errno => CoreError::System {
            operation: format!("{what} of {bytes} bytes"),
            errno: errno.unwrap_or(0),
            message: e.to_string(),
        },
    }
}

impl HostChunks {
    /// Reserves room for `reserved_bytes` (rounded up to whole chunks). `chunk_bytes` is
    /// rounded up to a multiple of the page size.
    pub fn new(reserved_bytes: usize, chunk_bytes: usize) -> Result<Self, CoreError> {
        let page = page_bytes();
        let chunk_bytes = chunk_bytes.max(1).div_ceil(page) * page;
        let num_chunks = reserved_bytes.max(1).div_ceil(chunk_bytes);
        let len = num_chunks.checked_mul(chunk_bytes).ok_or_else(|| {
            CoreError::InvalidArgument(format!("a reservation of {reserved_bytes} bytes overflows"))
        })?;
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing: it cannot
        // alias anything; the result is checked against MAP_FAILED below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_error("reserving address space (mmap)", len));
        }
        Ok(HostChunks { base: ptr as usize, chunk_bytes, num_chunks })
    }

    fn range(&self, first: usize, count: usize) -> (*mut libc::c_void, usize) {
        assert!(
            first + count <= self.num_chunks,
            "chunks {first}..{} outside the reservation",
            first + count
        );
        ((self.base + first * self.chunk_bytes) as *mut libc::c_void, count * self.chunk_bytes)
    }
}

impl Drop for HostChunks {
    fn drop(&mut self) {
        // SAFETY: `base..base + num_chunks * chunk_bytes` is exactly the mapping made in `new`,
        // unmapped only here; the pool that owns this backend is being dropped, so no Python
        // view of it is alive (a view holds its pool).
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.num_chunks * self.chunk_bytes) };
    }
}

impl ChunkBackend for HostChunks {
    fn base_ptr(&self) -> u64 {
        self.base as u64
    }
    fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }
    fn num_chunks(&self) -> usize {
        self.num_chunks
    }
    fn device(&self) -> Device {
        Device::Host
    }
    fn memory_info(&self) -> Result<Option<MemoryInfo>, CoreError> {
        Ok(None)
    }

    fn map_chunks(&self, first: usize, count: usize) -> Result<(), CoreError> {
        let (ptr, len) = self.range(first, count);
        // SAFETY: the range lies inside our reservation (checked in `range`) and holds no
        // memory anyone uses (the slab maps only unmapped chunks); making it accessible
        // changes nothing another owner relies on. One call: it succeeds or fails as a whole.
        if unsafe { libc::mprotect(ptr, len, libc::PROT_READ | libc::PROT_WRITE) } != 0 {
            return Err(os_error("committing a chunk (mprotect)", len));
        }
        Ok(())
    }

    fn unmap_chunks(&self, first: usize, count: usize) -> Result<(), CoreError> {
        let (ptr, len) = self.range(first, count);
        // SAFETY: the range lies inside our reservation. The slab unmaps only chunks that
        // hold no allocated block (shrink drains the free list and removes only drained ids)
        // and that lie past every live Python view's extent (views pin their extent with the
        // pool, `Pool::pin_view_extent`), so no view taken through the bindings reads them.
        // Raw addresses handed out earlier (`base_ptr`, `block_ptr`) are the caller's
        // responsibility: touching a block past `num_blocks` faults (PROT_NONE below).
        if unsafe { libc::madvise(ptr, len, libc::MADV_DONTNEED) } != 0 {
            // Nothing changed: the chunks stay mapped and usable (the slab's default).
            return Err(os_error("releasing a chunk (madvise)", len));
        }
        // SAFETY: as above; the pages are already gone, this only makes stray accesses fault.
        if unsafe { libc::mprotect(ptr, len, libc::PROT_NONE) } != 0 {
            let e = os_error("protecting a released chunk (mprotect)", len);
            // The slab counts a failed range as still mapped (we keep no count): make sure it
            // is readable and writable again, as it was (its pages now read as zero; the
            // blocks in it were free). SAFETY: as in `map_chunks`.
            unsafe { libc::mprotect(ptr, len, libc::PROT_READ | libc::PROT_WRITE) };
            return Err(e);
        }
        Ok(())
    }
}
