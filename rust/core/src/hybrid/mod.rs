//! Hybrid KV memory: a model whose layers keep different things (full attention, a
//! sliding window, chunked local attention, an MLA latent, a recurrent state) as a list of
//! KV groups over one pool. One slab and one free list serve every group; every page has
//! the pool's block bytes and a group's page holds as many of its tokens as fit (design,
//! rejected alternatives and the waste per model in `hybrid.md`).
//!
//! - `spec.rs`: [`ModelKvSpec`], the validated list of [`KvGroup`]s, each group's geometry
//!   inside a page and which pages a request keeps.
//! - `tables.rs`: [`HybridTables`], per request and per group the pages it holds: add,
//!   append (window and chunk groups release what no query can see any more), fork
//!   (copy on write), free.
//! - `request_map.rs`: the requests in dense rows, found by id (what a decode step reads
//!   lies side by side).
//! - `prefix.rs`: prefix caching across the groups (16-token chunk hashes, a hit every
//!   group can serve, state checkpoints), over the pool's prefix cache.
//! - `spill.rs`: cached pages evicted to the prefix cache's host tier and brought back by
//!   a hit, per group.
//! - `invariants.rs`: `HybridTables::check_invariants`, the equations tests check after
//!   every call.
//! - `pool.rs`: a pool made from a spec's page bytes (`Pool::new(&spec, ..)`).
//! - `swap.rs`: [`HybridHostTier`], every group of a request swapped to host memory and
//!   back; [`RequestPage`], a request's pages as swaps and transfers list them.

mod invariants;
mod pool;
mod prefix;
mod request_map;
mod spec;
mod spill;
mod swap;
mod tables;

#[cfg(feature = "internals")]
pub use prefix::mutation;
pub use prefix::{GroupCacheStats, HybridAdd, HASH_CHUNK_TOKENS};
pub use spec::{AttentionShape, GroupKind, KvGroup, ModelKvSpec, PageGeometry, StatePacking};
pub use swap::{HeldPages, HybridHostTier, RequestPage};
pub use tables::{GroupTable, HybridTables, PageCopy};
