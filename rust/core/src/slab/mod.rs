//! Slabs: the memory that KV blocks are carved from. The allocator never sees which backend
//! it runs on; it only needs `base_ptr + block_id * block_bytes`.

pub mod external;
mod host;
pub use external::{ExternalSlab, NoSlab};
pub use host::HostSlab;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod cuda_chunks;
pub mod growable;
#[cfg(unix)]
pub mod host_chunks;
#[cfg(feature = "cuda")]
pub mod pinned;

pub use growable::{ChunkBackend, GrowableSlab, ResizeGuard};

/// Chunk size of growable host slabs when none is asked for (what the CUDA driver's
/// granularity is on current GPUs, so both backends behave alike).
pub const DEFAULT_HOST_CHUNK_BYTES: usize = 2 << 20;

/// Chunk size of growable CUDA slabs when none is asked for (capped at the reservation).
/// The driver's cost is per `cuMemCreate` (on the H200 17 ms for 512 chunks, ~34 us each), so
/// granularity-sized 2 MiB chunks grew 1 GiB slower than allocate-copy-free of 8 GiB (0.4x,
/// bench/results/2026-11-30_d048de5_h200/growable_h200.json); 256 MiB chunks grew it 40.2x faster
/// (bench/results/2026-12-01_0da9aa7_h200x2/growable_h200.json).
/// Shrinking is coarser in exchange: a chunk is released only when all its blocks are free.
pub const DEFAULT_CUDA_CHUNK_BYTES: usize = 256 << 20;

use crate::error::CoreError;

/// Where a slab's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Host,
    Cuda(usize),
}

impl Device {
    /// Parses `"host"`/`"cpu"`, `"cuda"`, `"cuda:N"` and `"auto"` (CUDA device 0 if a driver
    /// and a device are present, host otherwise).
    pub fn parse(spec: &str) -> Result<Device, CoreError> {
        let spec = spec.trim().to_ascii_lowercase();
        match spec.as_str() {
            "host" | "cpu" => Ok(Device::Host),
            "cuda" => Ok(Device::Cuda(0)),
            "auto" => Ok(if cuda_device_count() > 0 { Device::Cuda(0) } else { Device::Host }),
            _ => match spec.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(ordinal)) => Ok(Device::Cuda(ordinal)),
                _ => Err(CoreError::InvalidArgument(format!(
                    "device {spec:?} is not one of \"auto\", \"host\", \"cuda\", \"cuda:N\""
                ))),
            },
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Host => write!(f, "host"),
            Device::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// Free and total bytes of a device, as the driver reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryInfo {
    pub free_bytes: usize,
    pub total_bytes: usize,
}

/// A contiguous region of memory owned for the slab's lifetime and freed on drop.
pub trait Slab: Send + Sync {
    /// Address of the first byte (a device pointer for CUDA slabs).
    fn base_ptr(&self) -> u64;
    fn len_bytes(&self) -> usize;
    fn device(&self) -> Device;
    /// The device's memory as the driver sees it now; `None` for host memory.
    fn memory_info(&self) -> Result<Option<MemoryInfo>, CoreError>;
    /// False for a metadata-only pool's slab, which has no memory behind its blocks.
    fn has_memory(&self) -> bool {
        true
    }
}

/// Number of CUDA devices, 0 when there is no driver (never panics).
pub fn cuda_device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        crate::driver::device_count().unwrap_or(0)
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// Allocates a slab of `len_bytes` on `device`.
pub fn allocate(device: Device, len_bytes: usize) -> Result<Box<dyn Slab>, CoreError> {
    match device {
        Device::Host => Ok(Box::new(HostSlab::new(len_bytes)?)),
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => Ok(Box::new(cuda::CudaSlab::new(ordinal, len_bytes)?)),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => {
            Err(CoreError::CudaUnavailable("kvpool was built without the cuda feature".into()))
        }
    }
}

/// A host slab for a host tier: page-locked for CUDA device `pinned_for`, so copies between
/// it and that device run asynchronously, or plain host memory when `None` (a host tier of a
/// host pool, as CI tests it).
pub fn allocate_host_tier(
    len_bytes: usize,
    pinned_for: Option<usize>,
) -> Result<Box<dyn Slab>, CoreError> {
    match pinned_for {
        None => allocate(Device::Host, len_bytes),
        #[cfg(feature = "cuda")]
        Some(ordinal) => Ok(Box::new(pinned::PinnedSlab::new(ordinal, len_bytes)?)),
        #[cfg(not(feature = "cuda"))]
        Some(_) => {
            Err(CoreError::CudaUnavailable("kvpool was built without the cuda feature".into()))
        }
    }
}

/// Free and total memory of `device` (`None` for the host).
pub fn device_memory_info(device: Device) -> Result<Option<MemoryInfo>, CoreError> {
    match device {
        Device::Host => Ok(None),
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => cuda::memory_info(ordinal).map(Some),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => {
            Err(CoreError::CudaUnavailable("kvpool was built without the cuda feature".into()))
        }
    }
}

/// A growable slab reserving `reserved_bytes` on `device`, mapped in chunks of `chunk_bytes`
/// (rounded up to the page size or driver granularity; `None`: 2 MiB on the host,
/// `DEFAULT_CUDA_CHUNK_BYTES` or the whole reservation if smaller on CUDA). Nothing is
/// mapped yet.
pub fn reserve_growable(
    device: Device,
    reserved_bytes: usize,
    chunk_bytes: Option<usize>,
) -> Result<GrowableSlab, CoreError> {
    let backend: Box<dyn ChunkBackend> = match device {
        #[cfg(unix)]
        Device::Host => Box::new(host_chunks::HostChunks::new(
            reserved_bytes,
            chunk_bytes.unwrap_or(DEFAULT_HOST_CHUNK_BYTES),
        )?),
        #[cfg(not(unix))]
        Device::Host => {
            let _ = (reserved_bytes, chunk_bytes);
            return Err(CoreError::InvalidArgument("growable host pools need a Unix mmap".into()));
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => Box::new(cuda_chunks::CudaChunks::new(
            ordinal,
            reserved_bytes,
            chunk_bytes.unwrap_or(DEFAULT_CUDA_CHUNK_BYTES.min(reserved_bytes)),
        )?),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => {
            return Err(CoreError::CudaUnavailable(
                "kvpool was built without the cuda feature".into(),
            ))
        }
    };
    Ok(GrowableSlab::new(backend))
}
