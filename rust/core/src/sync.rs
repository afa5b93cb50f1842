//! Atomics facade: `loom`'s model-checked atomics under `cfg(loom)`, `std`'s otherwise.
//! Everything concurrent in this crate imports its atomics from here, never from `std`.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
