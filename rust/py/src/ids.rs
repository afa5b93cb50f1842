//! Turning Python values into block ids and counts. Anything that is not a valid id
//! (negative, past the end, too big for any integer type, not an integer at all) becomes
//! `InvalidBlockError`, never a bare `OverflowError` or `TypeError`.

use kvpool_core::CoreError;
use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt};

fn invalid(value: &Bound<'_, PyAny>, reason: impl Into<String>) -> CoreError {
    let shown = value.repr().map(|r| r.to_string()).unwrap_or_else(|_| "<unprintable>".into());
    CoreError::InvalidBlock { value: shown, reason: reason.into() }
}

fn check_range(value: i64, num_blocks: usize) -> Result<u32, CoreError> {
    if value < 0 {
        return Err(CoreError::InvalidBlock { value: value.to_string(), reason: "negative".into() });
    }
    if value as u64 >= num_blocks as u64 {
        return Err(CoreError::out_of_range_id(value, num_blocks));
    }
    Ok(value as u32)
}

/// One block id, checked against `0..num_blocks`.
pub fn block_id(value: &Bound<'_, PyAny>, num_blocks: usize) -> Result<u32, CoreError> {
    if value.is_instance_of::<PyBool>() {
        return Err(invalid(value, "a bool is not a block id"));
    }
    match value.extract::<i64>() {
        Ok(v) => check_range(v, num_blocks),
        Err(e) if e.is_instance_of::<PyOverflowError>(value.py()) || value.is_instance_of::<PyInt>() => {
            Err(invalid(value, "too large for any block id"))
        }
        Err(_) => Err(invalid(
            value,
            format!(
                "not an integer (type {})",
                value.get_type().name().map(|n| n.to_string()).unwrap_or_default()
            ),
        )),
    }
}

/// A sequence of block ids: an int32/int64 NumPy array (fast path) or any iterable of ints.
pub fn block_ids(values: &Bound<'_, PyAny>, num_blocks: usize) -> Result<Vec<u32>, CoreError> {
    if let Ok(array) = values.extract::<PyReadonlyArray1<'_, i32>>() {
        return collect(array.as_array().iter().map(|&v| v as i64), num_blocks);
    }
    if let Ok(array) = values.extract::<PyReadonlyArray1<'_, i64>>() {
        return collect(array.as_array().iter().copied(), num_blocks);
    }
    if let Ok(array) = values.cast::<numpy::PyUntypedArray>() {
        if array.ndim() != 1 {
            return Err(CoreError::InvalidArgument(format!(
                "block ids must be one-dimensional, got an array of shape {:?}",
                array.shape()
            )));
        }
    }
    let iter = values.try_iter().map_err(|_| {
        CoreError::InvalidArgument(format!(
            "block ids must be an iterable of ints, got {}",
            values.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    })?;
    let mut ids = Vec::with_capacity(values.len().unwrap_or(0));
    for item in iter {
        let item = item.map_err(|e| CoreError::InvalidArgument(format!("iterating block ids: {e}")))?;
        ids.push(block_id(&item, num_blocks)?);
    }
    Ok(ids)
}

fn collect(values: impl Iterator<Item = i64>, num_blocks: usize) -> Result<Vec<u32>, CoreError> {
    values.map(|v| check_range(v, num_blocks)).collect()
}

/// A Python int argument for a count or size. Bools are refused; ints beyond i64 saturate
/// so the range check that follows names them (a bare `OverflowError` would not).
pub struct Int(pub i64);

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.is_instance_of::<PyBool>() {
            return Err(crate::errors::PyKvError(CoreError::InvalidArgument(format!(
                "expected an integer count, got the bool {}",
                obj.repr()?
            )))
            .into());
        }
        match obj.extract::<i64>() {
            Ok(v) => Ok(Int(v)),
            Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
                Ok(Int(if obj.lt(0)? { i64::MIN } else { i64::MAX }))
            }
            Err(e) => Err(e),
        }
    }
}

/// A non-negative count of blocks (or tokens, or layers).
pub fn count(value: Int, what: &str) -> Result<usize, CoreError> {
    let Int(value) = value;
    usize::try_from(value).map_err(|_| CoreError::InvalidArgument(format!("{what} must be >= 0, got {value}")))
}
