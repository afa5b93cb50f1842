//! Block copies between two slabs: the plan (which destination each source block gets, and
//! the runs of consecutive blocks one copy each moves) and the engines that move them. It
//! knows nothing of pools; the host tier (`tier/`) and the prefix cache's host tier
//! (`pool/spill.rs`) drive it.
//!
//! - `plan.rs`: the assignment of destinations and the runs.
//! - `engine.rs`: `memcpy` per run on the host, complete when the call returns; on CUDA,
//!   asynchronous copies on the engine's own copy stream (`cuda.rs`), ordered after the
//!   compute stream's work, with an event saying when they are done (`done.rs`).

#[cfg(feature = "cuda")]
mod cuda;
mod done;
mod engine;
mod plan;

#[cfg(feature = "cuda")]
pub use cuda::{CopyMethod, CudaEngine};
pub use done::{Done, Endpoints};
pub use engine::Engine;
pub use plan::{assign, runs, Run};
