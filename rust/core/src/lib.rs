//! kvpool-core: the memory side of a paged KV cache, with no Python in it.
//!
//! - [`layout`]: where every byte of a KV block lives (the one place strides are computed).
//! - [`slab`]: the memory that blocks are carved from (host or CUDA device).
//! - [`free_list`]: the depot, a lock-free stack of free block ids (see `free_list.md`);
//!   `free_ids.rs` puts per-thread caches (`thread_cache.rs`) in front of it.
//! - `allocator` (private): the free ids plus per-block reference counts (`ref_counts.rs`,
//!   16-bit counts packed four to a word): alloc, free, share.
//! - [`pool`]: an allocator bound to a slab and a layout; what the bindings expose. Every
//!   block operation goes through it. A growable pool maps its slab chunk by chunk
//!   (`pool/growth.rs`, design in `pool/growable.md`).
//! - [`prefix_cache`]: full blocks keyed by a hash chain of their content, reused across
//!   requests; unreferenced cached blocks are evictable (see `prefix_cache/prefix_cache.md`).
//! - [`hybrid`]: models whose layers keep different things (sliding window, chunked local,
//!   MLA latent, recurrent state) as KV groups over one pool (design in `hybrid/hybrid.md`).
//! - [`tables`]: each request's block table, and its upload to the GPU (`tables/upload.rs`,
//!   design in `tables/upload.md`).
//! - [`tier`]: a host tier (a second pool in host memory) and whole requests swapped between
//!   it and the device (design in `tier/tier.md`).
//! - [`block_copy`]: block copies between two slabs (the plan of runs; memcpy or a CUDA copy
//!   stream), for the host tier and the prefix cache's host tier (`pool/spill.rs`).
//!
//! The modules form a graph without cycles (`tests/module_graph.rs` checks it): `pool`
//! depends on the allocator, the slabs, `prefix_cache` and `block_copy`; `tables` on `pool`;
//! `tier` on `tables`; `prefix_cache` and `block_copy` on no pool, table or tier.
//! - `driver` (feature `cuda`): probing the CUDA driver, and owning wrappers of its objects.
//! - [`tensor_map`]: TMA tensor maps (`cuTensorMapEncodeTiled`, checked before the driver is
//!   asked) for the Hopper kernels' bulk copies.
//!
//! Every fallible call returns [`CoreError`] and changes nothing when it fails.

mod allocator;
pub mod block_copy;
#[cfg(feature = "cuda")]
pub mod driver;
pub mod error;
mod free_ids;
pub mod free_list;
pub mod hybrid;
pub mod layout;
pub mod pool;
pub mod prefix_cache;
mod ref_counts;
pub mod slab;
mod sync;
pub mod tables;
pub mod tensor_map;
mod thread_cache;
pub mod tier;
mod zeroed;

/// The bare allocator, which never grows a pool: only for this crate's own tests, loom
/// models and benchmarks (feature `internals`). Everything else goes through [`Pool`].
#[cfg(feature = "internals")]
pub use allocator::BlockAllocator;
pub use error::CoreError;
pub use layout::{DType, KvLayout};
pub use pool::{GrowableSize, Pool, PoolSize, PoolStats};
pub use ref_counts::MAX_REF_CNT;
pub use slab::Device;

/// Block ids are handed to kernels as int32, so a pool never holds more blocks than this.
pub const MAX_NUM_BLOCKS: usize = i32::MAX as usize;
