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
    // Sized by the caller's sequence, so fallibly; more than `num_blocks + 1` ids hold a
    // repeat or a stray id (refused below), so more room than that is never needed up front.
    let mut ids = Vec::new();
    let room = values.len().unwrap_or(0).min(num_blocks.saturating_add(1));
    ids.try_reserve_exact(room)
        .map_err(|_| CoreError::OutOfMemory { requested_bytes: room.saturating_mul(4), device: "host".into() })?;
    for item in iter {
        let item = item.map_err(|e| CoreError::InvalidArgument(format!("iterating block ids: {e}")))?;
        ids.push(block_id(&item, num_blocks)?);
    }
    Ok(ids)
}

fn collect(values: impl Iterator<Item = i64>, num_blocks: usize) -> Result<Vec<u32>, CoreError> {
    values.map(|v| check_range(v, num_blocks)).collect()
}

/// A Python int argument for a count or size. Bools are refused. An int beyond i64 keeps
/// the int itself, so that errors name what the caller passed, never a clamped value.
pub struct Int {
    value: i64,
    /// The caller's int when it does not fit i64 (then `value` is i64::MIN or i64::MAX).
    big: Option<Py<PyAny>>,
}

impl Int {
    pub fn new(value: i64) -> Self {
        Int { value, big: None }
    }
    /// The int as the caller wrote it, in decimal.
    pub fn shown(&self) -> String {
        match &self.big {
            None => self.value.to_string(),
            Some(big) => Python::attach(|py| big.bind(py).str().map(|s| s.to_string()).unwrap_or_default()),
        }
    }
    /// The caller's int, when it is too large for any count (beyond i64).
    pub fn too_large(&self) -> Option<&Py<PyAny>> {
        self.big.as_ref().filter(|_| self.value > 0)
    }
}

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
            Ok(v) => Ok(Int::new(v)),
            Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
                let value = if obj.lt(0)? { i64::MIN } else { i64::MAX };
                Ok(Int { value, big: Some(obj.to_owned().unbind()) })
            }
            Err(e) => Err(e),
        }
    }
}

/// A non-negative count of blocks (or tokens, or layers) that fits the machine's words.
pub fn count(value: Int, what: &str) -> Result<usize, CoreError> {
    if value.too_large().is_some() {
        return Err(CoreError::InvalidArgument(format!(
            "{what} {} is out of range (at most {})",
            value.shown(),
            i64::MAX
        )));
    }
    usize::try_from(value.value)
        .map_err(|_| CoreError::InvalidArgument(format!("{what} must be >= 0, got {}", value.shown())))
}

/// A count of tokens. One beyond 64 bits exceeds every capacity (`CapacityError`, as a
/// large count that fits does), named as the caller wrote it.
pub fn tokens(value: Int, what: &str) -> PyResult<usize> {
    if value.too_large().is_some() {
        return Err(crate::errors::CapacityError::new_err(format!(
            "capacity exceeded: {what} {} is past any count (a request holds at most {} tokens)",
            value.shown(),
            i32::MAX
        )));
    }
    Ok(count(value, what).map_err(crate::errors::PyKvError)?)
}

/// A fraction argument (a float, or an int). Bools are refused: `True` is not a fraction.
pub struct Fraction(pub f64);

impl<'a, 'py> FromPyObject<'a, 'py> for Fraction {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.is_instance_of::<PyBool>() {
            return Err(crate::errors::PyKvError(CoreError::InvalidArgument(format!(
                "expected a fraction, got the bool {}",
                obj.repr()?
            )))
            .into());
        }
        obj.extract::<f64>().map(Fraction)
    }
}
