//! Tiled TMA tensor maps: the 128-byte descriptor (`CUtensorMap`) a Hopper kernel's
//! `cp.async.bulk.tensor` reads to copy a box of a strided global tensor into shared memory.
//! The Hopper prefill (cuda/paged_prefill_sm90.cu) copies its K/V pages this way, through two
//! maps over the whole pool (K and V) that the plan encodes once.
//!
//! [`TiledMapSpec::check`] refuses what the driver would refuse (documented limits of
//! `cuTensorMapEncodeTiled`), with a message that names the argument, so a bad map is an
//! `InvalidArgument` and never a driver error code; [`encode_tiled`] then asks the driver.
//! Encoding reads no device memory (the address is only recorded) and needs no context.

use crate::error::CoreError;
use crate::layout::DType;

/// Size of an encoded map (`sizeof(CUtensorMap)`).
pub const TENSOR_MAP_BYTES: usize = 128;
/// The most dimensions a tiled map may have.
pub const MAX_RANK: usize = 5;
/// The most elements a box may span in one dimension.
pub const MAX_BOX_DIM: u32 = 256;

/// What a tiled map describes: a tensor of `dims` elements (innermost first; the innermost is
/// contiguous), dimension i + 1 `strides_bytes[i]` bytes apart, copied in boxes of `box_dims`
/// elements, shared memory swizzled in `swizzle_bytes` spans (0: none, 32, 64, 128).
/// Elements outside the tensor read as zeros.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TiledMapSpec {
    pub global_address: u64,
    pub dtype: DType,
    pub dims: Vec<u64>,
    pub strides_bytes: Vec<u64>,
    pub box_dims: Vec<u32>,
    pub swizzle_bytes: u32,
}

fn bad(message: String) -> CoreError {
    CoreError::InvalidArgument(format!("tensor map: {message}"))
}

impl TiledMapSpec {
    /// The driver's limits, checked here so a refusal says which argument is wrong.
    pub fn check(&self) -> Result<(), CoreError> {
        let rank = self.dims.len();
        if rank == 0 || rank > MAX_RANK {
            return Err(bad(format!("rank {rank}: a tiled map has 1..={MAX_RANK} dimensions")));
        }
        if self.strides_bytes.len() != rank - 1 || self.box_dims.len() != rank {
            return Err(bad(format!(
                "{rank} dims need {} strides and {rank} box dims, got {} and {}",
                rank - 1,
                self.strides_bytes.len(),
                self.box_dims.len()
            )));
        }
        if self.global_address % 16 != 0 {
            return Err(bad(format!(
                "global address {:#x} is not 16-byte aligned",
                self.global_address
            )));
        }
        if let Some((i, d)) = self.dims.iter().enumerate().find(|(_, &d)| d == 0 || d > 1 << 32) {
            return Err(bad(format!("dims[{i}] = {d}: each dimension holds 1..=2^32 elements")));
        }
        if let Some((i, s)) =
            self.strides_bytes.iter().enumerate().find(|(_, &s)| s % 16 != 0 || s >= 1 << 40)
        {
            return Err(bad(format!(
                "strides_bytes[{i}] = {s}: a stride is a multiple of 16 bytes below 2^40"
            )));
        }
        if let Some((i, b)) =
            self.box_dims.iter().enumerate().find(|(_, &b)| b == 0 || b > MAX_BOX_DIM)
        {
            return Err(bad(format!(
                "box_dims[{i}] = {b}: a box spans 1..={MAX_BOX_DIM} elements"
            )));
        }
        let inner_bytes = self.box_dims[0] as usize * self.dtype.size_bytes();
        if inner_bytes % 16 != 0 {
            return Err(bad(format!(
                "the box's inner dimension is {inner_bytes} bytes: it must be a multiple of 16"
            )));
        }
        match self.swizzle_bytes {
            0 => {}
            32 | 64 | 128 if inner_bytes <= self.swizzle_bytes as usize => {}
            32 | 64 | 128 => {
                return Err(bad(format!(
                    "the box's inner dimension is {inner_bytes} bytes, more than the \
                     {}-byte swizzle span",
                    self.swizzle_bytes
                )))
            }
            s => return Err(bad(format!("swizzle_bytes {s}: one of 0, 32, 64, 128"))),
        }
        Ok(())
    }
}

/// Encodes `spec` (checked first) with `cuTensorMapEncodeTiled`: the map's 128 bytes, to be
/// passed to a kernel by value (`__grid_constant__`) or copied to 64-byte-aligned device
/// memory. Without a CUDA driver: `CudaUnavailable`.
pub fn encode_tiled(spec: &TiledMapSpec) -> Result<[u8; TENSOR_MAP_BYTES], CoreError> {
    spec.check()?;
    encode_checked(spec)
}

#[cfg(feature = "cuda")]
fn encode_checked(spec: &TiledMapSpec) -> Result<[u8; TENSOR_MAP_BYTES], CoreError> {
    use cudarc::driver::sys;

    crate::driver::device_count()?; // loads the driver, or says why there is none
    let data_type = match spec.dtype {
        DType::Float16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::BFloat16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::Float32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        // fp8 is copied as bytes: a box moves bits, it converts nothing.
        DType::Float8E4M3 | DType::Float8E5M2 => {
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8
        }
    };
    let swizzle = match spec.swizzle_bytes {
        32 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_32B,
        64 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        128 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        _ => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
    };
    let element_strides = [1u32; MAX_RANK];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: `map` is a valid out-pointer to a CUtensorMap; dims and box_dims hold `rank`
    // elements and strides_bytes `rank - 1` (checked above), element_strides at least `rank`;
    // the driver only records the global address and reads no device memory.
    let status = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            data_type,
            spec.dims.len() as u32,
            spec.global_address as *mut std::ffi::c_void,
            spec.dims.as_ptr(),
            spec.strides_bytes.as_ptr(),
            spec.box_dims.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if status != sys::cudaError_enum::CUDA_SUCCESS {
        return Err(CoreError::Cuda(format!("cuTensorMapEncodeTiled({spec:?}): {status:?}")));
    }
    let mut bytes = [0u8; TENSOR_MAP_BYTES];
    for (chunk, word) in bytes.chunks_exact_mut(8).zip(map.opaque.iter()) {
        chunk.copy_from_slice(&word.to_ne_bytes());
    }
    Ok(bytes)
}

#[cfg(not(feature = "cuda"))]
fn encode_checked(_spec: &TiledMapSpec) -> Result<[u8; TENSOR_MAP_BYTES], CoreError> {
    Err(CoreError::CudaUnavailable("kvpool was built without the cuda feature".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The K map of the Hopper prefill over a pool: head_dim 128, 8 KV heads, 16-token pages,
    /// 2 layers, 100 blocks, fp16.
    fn kv_spec() -> TiledMapSpec {
        let head = 2 * 128u64;
        let token = 8 * head;
        let kv = 16 * token;
        TiledMapSpec {
            global_address: 0x7f00_0000_0000,
            dtype: DType::Float16,
            dims: vec![128, 8, 16, 2, 100],
            strides_bytes: vec![head, token, 2 * kv, 4 * kv],
            box_dims: vec![64, 1, 16, 1, 1],
            swizzle_bytes: 128,
        }
    }

    fn refused(spec: TiledMapSpec, needle: &str) {
        match spec.check() {
            Err(CoreError::InvalidArgument(m)) => assert!(m.contains(needle), "{m}"),
            other => panic!("expected InvalidArgument containing {needle:?}, got {other:?}"),
        }
    }

    #[test]
    fn the_prefill_kv_map_passes_the_checks() {
        kv_spec().check().unwrap();
    }

    #[test]
    fn each_limit_is_refused_with_its_argument_named() {
        refused(
            TiledMapSpec { dims: vec![], strides_bytes: vec![], box_dims: vec![], ..kv_spec() },
            "rank 0",
        );
        refused(TiledMapSpec { dims: vec![1; 6], ..kv_spec() }, "rank 6");
        refused(TiledMapSpec { strides_bytes: vec![256; 3], ..kv_spec() }, "need 4 strides");
        refused(TiledMapSpec { global_address: 0x7f00_0000_0008, ..kv_spec() }, "16-byte aligned");
        refused(TiledMapSpec { dims: vec![128, 8, 16, 0, 100], ..kv_spec() }, "dims[3] = 0");
        refused(TiledMapSpec { dims: vec![128, 8, 16, 2, (1 << 32) + 1], ..kv_spec() }, "dims[4]");
        refused(
            TiledMapSpec { strides_bytes: vec![256, 2056, 8192, 16384], ..kv_spec() },
            "strides_bytes[1]",
        );
        refused(
            TiledMapSpec { strides_bytes: vec![256, 2048, 8192, 1 << 40], ..kv_spec() },
            "strides_bytes[3]",
        );
        refused(
            TiledMapSpec { box_dims: vec![64, 1, 257, 1, 1], ..kv_spec() },
            "box_dims[2] = 257",
        );
        refused(TiledMapSpec { box_dims: vec![64, 0, 16, 1, 1], ..kv_spec() }, "box_dims[1] = 0");
        refused(TiledMapSpec { box_dims: vec![4, 1, 16, 1, 1], ..kv_spec() }, "multiple of 16");
        refused(TiledMapSpec { box_dims: vec![128, 1, 16, 1, 1], ..kv_spec() }, "swizzle span");
        refused(TiledMapSpec { swizzle_bytes: 96, ..kv_spec() }, "swizzle_bytes 96");
        // No swizzle: a 256-byte inner box is fine.
        TiledMapSpec { box_dims: vec![128, 1, 16, 1, 1], swizzle_bytes: 0, ..kv_spec() }
            .check()
            .unwrap();
    }

    #[test]
    fn a_bad_spec_is_refused_before_the_driver_is_asked() {
        // Without a driver a checked spec gives CudaUnavailable; a bad one its own message.
        let err = encode_tiled(&TiledMapSpec { swizzle_bytes: 96, ..kv_spec() }).unwrap_err();
        assert!(matches!(err, CoreError::InvalidArgument(_)), "{err:?}");
    }
}
