//! The steps every swap shares, whatever tables it moves requests of (`BlockTables` for
//! `HostTier`, `HybridTables` for `hybrid::HybridHostTier`): the compute stream a copy is
//! ordered on, one direction's copy (destinations taken all or nothing, one copy per run),
//! the pending source blocks held until their copy is done, and dropping references.

#[cfg(feature = "cuda")]
use crate::block_copy::CopyMethod;
use crate::block_copy::{self, Done, Endpoints, Engine};
use crate::error::CoreError;
use crate::pool::{Owner, Pool};
use crate::slab::Device;

/// How a tier of `device_pool` copies: its engine, and the device its host memory is pinned
/// for (`None`: plain host memory, for a host pool).
pub(crate) struct TierEngine {
    pub(crate) pinned_for: Option<usize>,
    pub(crate) engine: Engine,
}

impl TierEngine {
    /// `memcpy` for a host pool; for a CUDA pool, a copy stream in its context queuing with
    /// `method`.
    #[cfg(feature = "cuda")]
    pub(crate) fn new(device_pool: &Pool, method: CopyMethod) -> Result<Self, CoreError> {
        match device_pool.device() {
            Device::Host => Ok(TierEngine { pinned_for: None, engine: Engine::Host }),
            Device::Cuda(ordinal) => {
                let ctx = device_pool
                    .device_context()
                    .expect("a CUDA pool has a device context")
                    .context();
                let engine = Engine::Cuda(block_copy::CudaEngine::new(ctx, method)?);
                Ok(TierEngine { pinned_for: Some(ordinal), engine })
            }
        }
    }

    /// `memcpy` for a host pool (no CUDA in this build).
    #[cfg(not(feature = "cuda"))]
    pub(crate) fn new(device_pool: &Pool) -> Result<Self, CoreError> {
        if device_pool.device() != Device::Host {
            return Err(CoreError::CudaUnavailable(
                "kvpool was built without the cuda feature".into(),
            ));
        }
        Ok(TierEngine { pinned_for: None, engine: Engine::Host })
    }
}

/// Which way a swap copies: the host pool is the destination (out) or the source (in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    Out,
    In,
}

/// A direction's copy, queued: each source's destination (in the order of the sources),
/// the number of copies (runs) and when they are done.
pub(crate) struct Copied {
    pub(crate) dests: Vec<u32>,
    pub(crate) num_copies: usize,
    pub(crate) done: Done,
}

/// Source blocks of a swap whose copy may still be reading them.
pub(crate) struct Pending {
    pub(crate) done: Done,
    pub(crate) device_blocks: Vec<u32>,
    pub(crate) host_blocks: Vec<u32>,
}

/// The compute stream copies are ordered after (and a swap-in is ordered before): `stream`,
/// or `device_pool`'s own. Checks a caller's stream belongs to the pool's context.
///
/// # Safety
/// `stream`, if given, is a live CUDA stream (its context is checked here).
pub(crate) unsafe fn compute_stream(
    engine: &Engine,
    device_pool: &Pool,
    stream: Option<u64>,
) -> Result<u64, CoreError> {
    #[cfg(not(feature = "cuda"))]
    let _ = device_pool;
    match (engine, stream) {
        (Engine::Host, None) => Ok(0),
        (Engine::Host, Some(_)) => Err(CoreError::InvalidArgument(
            "a stream was given, but the pool is on the host".into(),
        )),
        #[cfg(feature = "cuda")]
        (Engine::Cuda(_), None) => {
            Ok(device_pool.stream_handle().expect("a CUDA pool has a stream"))
        }
        #[cfg(feature = "cuda")]
        (Engine::Cuda(_), Some(handle)) => {
            let ctx =
                device_pool.device_context().expect("a CUDA pool has a device context").context();
            // SAFETY: the caller guarantees the handle is a live stream.
            unsafe {
                crate::driver::check_stream_context(ctx, handle as cudarc::driver::sys::CUstream)
            }?;
            Ok(handle)
        }
    }
}

/// Takes one block of `to` per entry of `sources` (tagged `owner`, all or nothing: a full
/// host pool is `HostTierFull` when swapping out) and queues the copies from `from`, one per
/// run of consecutive blocks. Swapping in, `compute` then waits for them on the device.
/// On error nothing is taken: whatever was queued has finished and the destinations are back.
///
/// # Safety
/// Every source is a block of `from` holding a reference that stays until the returned
/// `done` completes; `compute` came from [`compute_stream`] for `engine`.
pub(crate) unsafe fn copy_blocks(
    engine: &Engine,
    from: &Pool,
    to: &Pool,
    sources: &[u32],
    owner: Owner,
    compute: u64,
    direction: Direction,
) -> Result<Copied, CoreError> {
    let mut dests = vec![0u32; sources.len()];
    to.alloc_into_for(&mut dests, owner).map_err(|e| match (direction, e) {
        (Direction::Out, CoreError::OutOfBlocks { requested, free, num_blocks }) => {
            CoreError::HostTierFull { requested, free, num_blocks }
        }
        (_, e) => e,
    })?;
    let dests = block_copy::assign(sources, dests);
    let runs = block_copy::runs(sources, &dests);
    let ends = Endpoints {
        src_base: from.base_ptr(),
        dst_base: to.base_ptr(),
        block_bytes: to.block_bytes(),
    };
    // SAFETY: the sources are allocated blocks of `from` (the caller's contract), the
    // destinations just allocated blocks of `to`, both in range of their pools, whose block
    // bytes are equal (a tier's host pool is made with its device pool's); the sources stay
    // allocated until `done` completes; `compute` was checked by `compute_stream`.
    let copied = unsafe { engine.copy(&runs, ends, compute) }.and_then(|done| match direction {
        Direction::Out => Ok(done),
        // SAFETY: as above.
        Direction::In => unsafe { engine.order_before(&done, compute) }.map(|()| done),
    });
    match copied {
        Ok(done) => Ok(Copied { dests, num_copies: runs.len(), done }),
        Err(e) => {
            // A failed order_before leaves a copy in flight: wait before freeing.
            if direction == Direction::In {
                let _ = engine.mark().and_then(|d| d.wait());
            }
            let _ = to.free_many_for(&dests, owner);
            Err(e)
        }
    }
}

/// Returns the source blocks of finished copies to their pools; the number released
/// (device, host). Never blocks.
pub(crate) fn release_completed(
    pending: &mut Vec<Pending>,
    device_pool: &Pool,
    host_pool: &Pool,
    owner: Owner,
) -> Result<(usize, usize), CoreError> {
    let mut released = (0, 0);
    let mut i = 0;
    while i < pending.len() {
        if !pending[i].done.is_complete()? {
            i += 1;
            continue;
        }
        let p = pending.swap_remove(i);
        drop_refs(device_pool, &p.device_blocks, owner);
        drop_refs(host_pool, &p.host_blocks, owner);
        released.0 += p.device_blocks.len();
        released.1 += p.host_blocks.len();
    }
    Ok(released)
}

/// Drops one reference per entry of `blocks`, which may repeat a block: one swap of a parent
/// and its fork copies their shared blocks once per holder. Cannot fail: each entry is a
/// reference the tier holds (a block freed behind its back through the plain pool API is
/// refused as not the tables', and that reference is then gone already).
pub(crate) fn drop_refs(pool: &Pool, blocks: &[u32], owner: Owner) {
    if pool.free_many_for(blocks, owner).is_err() {
        for &b in blocks {
            let _ = pool.free_many_for(&[b], owner);
        }
    }
}

pub(crate) fn check_distinct(request_ids: &[u64]) -> Result<(), CoreError> {
    let mut sorted = request_ids.to_vec();
    sorted.sort_unstable();
    match sorted.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(CoreError::InvalidArgument(format!(
            "request id {} appears twice in one call",
            w[0]
        ))),
        None => Ok(()),
    }
}
