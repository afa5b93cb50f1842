//! `tensor_map_tiled`: a TMA tensor map (`cuTensorMapEncodeTiled`) encoded by the core, for
//! the Hopper prefill's K/V copies (python/kvpool/kernels/_prefill.py builds two per plan).

use kvpool_core::layout::DType;
use kvpool_core::tensor_map::{encode_tiled, TiledMapSpec};
use kvpool_core::CoreError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::KvResult;
use crate::ids::{count, Int};

fn values<T: TryFrom<usize>>(ints: Vec<Int>, what: &str) -> Result<Vec<T>, CoreError> {
    ints.into_iter()
        .enumerate()
        .map(|(i, v)| {
            let name = format!("{what}[{i}]");
            let n = count(v, &name)?;
            T::try_from(n).map_err(|_| {
                CoreError::InvalidArgument(format!("tensor map: {name} = {n} is out of range"))
            })
        })
        .collect()
}

/// The 128 bytes of a tiled tensor map over `global_address` (16-byte aligned device memory
/// holding `dtype` elements): `dims` innermost first (the innermost contiguous), dimension
/// i + 1 `strides_bytes[i]` bytes apart, boxes of `box_dims` elements, shared memory swizzled
/// in `swizzle_bytes` spans (0, 32, 64 or 128). Elements outside `dims` read as zeros.
/// Refuses what the driver would (InvalidArgumentError, naming the argument); without a
/// driver CudaUnavailableError. The address is recorded, not read.
#[pyfunction]
pub fn tensor_map_tiled<'py>(
    py: Python<'py>,
    global_address: Int,
    dtype: &str,
    dims: Vec<Int>,
    strides_bytes: Vec<Int>,
    box_dims: Vec<Int>,
    swizzle_bytes: Int,
) -> KvResult<Bound<'py, PyBytes>> {
    let spec = TiledMapSpec {
        global_address: count(global_address, "tensor map: global_address")? as u64,
        dtype: DType::parse(dtype)?,
        dims: values(dims, "dims")?,
        strides_bytes: values(strides_bytes, "strides_bytes")?,
        box_dims: values(box_dims, "box_dims")?,
        swizzle_bytes: values(vec![swizzle_bytes], "swizzle_bytes")?[0],
    };
    let bytes = py.detach(|| encode_tiled(&spec))?;
    Ok(PyBytes::new(py, &bytes))
}
