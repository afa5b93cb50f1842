//! Turning Python values into block ids and counts. Anything that is not a valid id
//! (negative, past the end, too big for any integer type, not an integer at all) becomes
//! `InvalidBlockError`, never a bare `OverflowError` or `TypeError`.

use kvpool_core::CoreError;
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt};
use smallvec::SmallVec;

use crate::errors::PyKvError;
use crate::int_array::{is_numpy_bool, IntArray};

fn invalid(value: &Bound<'_, PyAny>, reason: impl Into<String>) -> CoreError {
    let shown = value.repr().map(|r| r.to_string()).unwrap_or_else(|_| "<unprintable>".into());
    CoreError::InvalidBlock { value: shown, reason: reason.into() }
}

fn check_range(value: i64, num_blocks: usize) -> Result<u32, CoreError> {
    if value < 0 {
        return Err(CoreError::InvalidBlock {
            value: value.to_string(),
            reason: "negative".into(),
        });
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
        Err(_) if is_numpy_bool(value) => Err(invalid(value, "a bool is not a block id")),
        Err(e)
            if e.is_instance_of::<PyOverflowError>(value.py())
                || value.is_instance_of::<PyInt>() =>
        {
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

/// Batches at least this large run with the GIL released. Below it, the release and
/// re-acquire (~0.1 us) would cost more than the allocation itself, and the ids of one call
/// sit on the stack ([`BlockIds`]).
pub const DETACH_MIN_BLOCKS: usize = 64;

/// Block ids of one call: up to `DETACH_MIN_BLOCKS` on the stack, so a scheduler's
/// per-step batch costs no heap allocation.
pub type BlockIds = SmallVec<[u32; DETACH_MIN_BLOCKS]>;

/// A sequence of block ids, into `ids` (empty): a 1-D int32/int64 NumPy array (fast path,
/// read in place) or any iterable of ints. An exception the caller's iterable raises
/// propagates as it is.
///
/// `ids` is filled in place rather than returned: returned inside a `PyResult`, the inline
/// buffer (64 ids, 256 bytes) is built in this frame and copied out to the caller's, a
/// memcpy per call on the `free_many` path that runs every scheduler step (callgrind on the
/// dev VM counted 852 instructions for a 16-id `free_many` returning it, 589 with the
/// out-parameter).
pub fn block_ids(values: &Bound<'_, PyAny>, num_blocks: usize, ids: &mut BlockIds) -> PyResult<()> {
    if let Ok(array) = values.cast::<PyUntypedArray>() {
        if array.ndim() != 1 {
            return Err(PyKvError(CoreError::InvalidArgument(format!(
                "block ids must be one-dimensional, got an array of shape {:?}",
                array.shape()
            )))
            .into());
        }
        if let Some(ints) = IntArray::of(array) {
            reserve(ids, ints.len(), num_blocks)?;
            let mut first_bad = None;
            ids.extend(ints.values().map(|v| {
                // A negative id wraps past any count.
                if v as u64 >= num_blocks as u64 && first_bad.is_none() {
                    first_bad = Some(v);
                }
                v as u32
            }));
            if let Some(bad) = first_bad {
                check_range(bad, num_blocks).map_err(PyKvError)?; // refuses it, naming why
            }
            return Ok(());
        }
        if array.dtype().kind() == b'b' {
            return Err(PyKvError(invalid(
                values,
                "a bool is not a block id (for a mask, pass np.flatnonzero(mask))",
            ))
            .into());
        }
    }
    let iter = values.try_iter().map_err(|e| {
        if !e.is_instance_of::<PyTypeError>(values.py()) {
            return e; // raised by the caller's __iter__
        }
        PyKvError(CoreError::InvalidArgument(format!(
            "block ids must be an iterable of ints, got {}",
            values.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        )))
        .into()
    })?;
    reserve(ids, values.len().unwrap_or(0), num_blocks)?;
    for item in iter {
        ids.push(block_id(&item?, num_blocks).map_err(PyKvError)?);
    }
    Ok(())
}

/// Room for `len` ids, sized by the caller's sequence, so fallibly; more than
/// `num_blocks + 1` ids hold a repeat or a stray id (refused later), so more room than that
/// is never needed up front.
fn reserve(ids: &mut BlockIds, len: usize, num_blocks: usize) -> PyResult<()> {
    let room = len.min(num_blocks.saturating_add(1));
    ids.try_reserve_exact(room).map_err(|_| {
        PyKvError(CoreError::OutOfMemory {
            requested_bytes: room.saturating_mul(4),
            device: "host".into(),
        })
        .into()
    })
}

/// A Python int argument for a count, size or index. An int beyond i64 keeps the int
/// itself, so that errors name what the caller passed, never a clamped value. A bool
/// (Python's or NumPy's) is kept too and refused by [`count`] and [`tokens`], whose errors
/// name the argument.
pub struct Int {
    value: i64,
    given: Given,
}

/// What the caller passed for an [`Int`], when it is not simply `value`.
enum Given {
    /// An int that fits i64: `value` itself.
    Fits,
    /// An int beyond i64 (then `value` is i64::MIN or i64::MAX).
    Big(Py<PyAny>),
    /// A bool, refused wherever an `Int` is used.
    Bool(Py<PyAny>),
}

impl Int {
    pub fn new(value: i64) -> Self {
        Int { value, given: Given::Fits }
    }
    /// The int as the caller wrote it, in decimal (a bool as its repr).
    pub fn shown(&self) -> String {
        match &self.given {
            Given::Fits => self.value.to_string(),
            Given::Big(big) => {
                Python::attach(|py| big.bind(py).str().map(|s| s.to_string()).unwrap_or_default())
            }
            Given::Bool(b) => {
                Python::attach(|py| b.bind(py).repr().map(|s| s.to_string()).unwrap_or_default())
            }
        }
    }
    /// The caller's int, when it is too large for any count (beyond i64).
    pub fn too_large(&self) -> Option<&Py<PyAny>> {
        match &self.given {
            Given::Big(big) if self.value > 0 => Some(big),
            _ => None,
        }
    }
    /// Refuses a bool (`True` would otherwise count as 1), naming the argument.
    pub fn refuse_bool(&self, what: &str) -> Result<(), CoreError> {
        match self.given {
            Given::Bool(_) => Err(CoreError::InvalidArgument(format!(
                "{what} must be an int, not a bool (got {})",
                self.shown()
            ))),
            _ => Ok(()),
        }
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.is_instance_of::<PyBool>() {
            return Ok(Int { value: 0, given: Given::Bool(obj.to_owned().unbind()) });
        }
        match obj.extract::<i64>() {
            Ok(v) => Ok(Int::new(v)),
            Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
                let value = if obj.lt(0)? { i64::MIN } else { i64::MAX };
                Ok(Int { value, given: Given::Big(obj.to_owned().unbind()) })
            }
            Err(_) if is_numpy_bool(&obj) => {
                Ok(Int { value: 0, given: Given::Bool(obj.to_owned().unbind()) })
            }
            Err(e) => Err(e),
        }
    }
}

/// A non-negative count of blocks (or tokens, or layers) that fits the machine's words.
pub fn count(value: Int, what: &str) -> Result<usize, CoreError> {
    value.refuse_bool(what)?;
    if value.too_large().is_some() {
        return Err(CoreError::InvalidArgument(format!(
            "{what} {} is out of range (at most {})",
            value.shown(),
            i64::MAX
        )));
    }
    usize::try_from(value.value).map_err(|_| {
        CoreError::InvalidArgument(format!("{what} must be >= 0, got {}", value.shown()))
    })
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

/// A fraction argument (a float, or an int). Bools (NumPy's too) are refused: `True` is not
/// a fraction.
pub struct Fraction(pub f64);

impl<'a, 'py> FromPyObject<'a, 'py> for Fraction {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.is_instance_of::<PyBool>() || is_numpy_bool(&obj) {
            return Err(crate::errors::PyKvError(CoreError::InvalidArgument(format!(
                "expected a fraction, got the bool {}",
                obj.repr()?
            )))
            .into());
        }
        obj.extract::<f64>().map(Fraction)
    }
}
