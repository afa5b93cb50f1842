//! Per-block bookkeeping arrays (reference counts, free-list links, owner tags, the prefix
//! cache's flags) sized by the pool's capacity, allocated so that they cost memory only where
//! they are used; and [`try_grow`] for the arrays that grow with the mapped blocks instead.
//!
//! `alloc_zeroed` with the type's natural alignment is served by `calloc`, which for a large
//! request maps fresh pages that read as zero and are committed by the OS only when first
//! written. So an array for `max_num_blocks` ids takes address space up front and memory in
//! proportion to the ids actually touched: a growable pool's bookkeeping grows with what is
//! mapped, and a huge capacity that cannot even be reserved fails as `OutOfMemory` instead of
//! aborting the process. Every array here is zero-initialised by design (a zero reference
//! count is "free"; the free list stores its links relative to their initial values, see
//! `free_list.rs`), so nothing is written at creation.

use crate::error::CoreError;

/// Atomics whose all-zero bit pattern is a valid value (zero).
///
/// # Safety
/// An implementor must be valid when every byte of it is zero.
pub(crate) unsafe trait ZeroIsValid {}

// SAFETY: std's atomic integers have the layout of their integer, and 0 is a valid integer.
unsafe impl ZeroIsValid for std::sync::atomic::AtomicU32 {}
// SAFETY: as above.
unsafe impl ZeroIsValid for std::sync::atomic::AtomicU8 {}
// SAFETY: as above.
unsafe impl ZeroIsValid for std::sync::atomic::AtomicU64 {}
// SAFETY: `AtomicBool` has the layout of `bool`, and the zero byte is `false`.
unsafe impl ZeroIsValid for std::sync::atomic::AtomicBool {}

/// `len` zeroes, lazily committed; `OutOfMemory` if the address space cannot be had.
pub(crate) fn zeroed_slice<T: ZeroIsValid>(len: usize) -> Result<Box<[T]>, CoreError> {
    let out_of_memory = || CoreError::OutOfMemory {
        requested_bytes: len.saturating_mul(std::mem::size_of::<T>()),
        device: "host".into(),
    };
    let layout = std::alloc::Layout::array::<T>(len).map_err(|_| out_of_memory())?;
    if layout.size() == 0 {
        return Ok(Box::default());
    }
    // SAFETY: `layout` has a non-zero size (checked above).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut T;
    if ptr.is_null() {
        return Err(out_of_memory());
    }
    // SAFETY: `ptr` is a fresh zeroed allocation of `len` `T`s made with the layout that
    // `Box<[T]>` frees with (`Layout::array::<T>(len)`), and all-zero bytes are a valid `T`
    // (`ZeroIsValid`).
    Ok(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)) })
}

/// `len` atomic zeroes of the crate's sync facade: lazily committed outside loom; under loom
/// (whose atomics are not plain integers) built one by one, fallibly.
#[cfg(not(loom))]
pub(crate) fn zeroed_atomic_u32s(len: usize) -> Result<Box<[crate::sync::AtomicU32]>, CoreError> {
    zeroed_slice(len)
}
#[cfg(loom)]
pub(crate) fn zeroed_atomic_u32s(len: usize) -> Result<Box<[crate::sync::AtomicU32]>, CoreError> {
    atomics_one_by_one(len, || crate::sync::AtomicU32::new(0))
}

/// `len` atomic 64-bit zeroes of the crate's sync facade, as [`zeroed_atomic_u32s`].
#[cfg(not(loom))]
pub(crate) fn zeroed_atomic_u64s(len: usize) -> Result<Box<[crate::sync::AtomicU64]>, CoreError> {
    zeroed_slice(len)
}
#[cfg(loom)]
pub(crate) fn zeroed_atomic_u64s(len: usize) -> Result<Box<[crate::sync::AtomicU64]>, CoreError> {
    atomics_one_by_one(len, || crate::sync::AtomicU64::new(0))
}

/// `len` atomic `false`s of the crate's sync facade, as [`zeroed_atomic_u32s`].
#[cfg(not(loom))]
pub(crate) fn zeroed_atomic_bools(len: usize) -> Result<Box<[crate::sync::AtomicBool]>, CoreError> {
    zeroed_slice(len)
}
#[cfg(loom)]
pub(crate) fn zeroed_atomic_bools(len: usize) -> Result<Box<[crate::sync::AtomicBool]>, CoreError> {
    atomics_one_by_one(len, || crate::sync::AtomicBool::new(false))
}

/// Grows `v` to `len` copies of `value` if shorter; `OutOfMemory`, with `v` unchanged, if
/// the memory cannot be had. For bookkeeping that grows with a pool's mapped blocks.
pub(crate) fn try_grow<T: Clone>(v: &mut Vec<T>, len: usize, value: T) -> Result<(), CoreError> {
    let extra = len.saturating_sub(v.len());
    v.try_reserve(extra).map_err(|_| CoreError::OutOfMemory {
        requested_bytes: extra.saturating_mul(std::mem::size_of::<T>()),
        device: "host".into(),
    })?;
    v.resize(len.max(v.len()), value);
    Ok(())
}

/// Under loom: `len` atomics made by `zero`, with the allocation failure reported.
#[cfg(loom)]
fn atomics_one_by_one<T>(len: usize, zero: impl Fn() -> T) -> Result<Box<[T]>, CoreError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| CoreError::OutOfMemory {
        requested_bytes: len.saturating_mul(std::mem::size_of::<T>()),
        device: "host".into(),
    })?;
    v.extend((0..len).map(|_| zero()));
    Ok(v.into_boxed_slice())
}
