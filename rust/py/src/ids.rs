//! Turning Python values into block ids, request ids and counts, under the binding's error
//! convention: a value of the wrong type (a float, str, None or bool where an int is
//! expected) raises `TypeError` naming the argument and the type received; an int that is no
//! valid id or count (negative, past the end, beyond any integer type) raises a `KvError`
//! subclass (`InvalidBlockError` for block ids, `InvalidArgumentError` otherwise).
//!
//! Integers are Python ints, NumPy integer scalars and anything with `__index__`. Bools
//! (Python's and NumPy's) are refused as a wrong type although `bool` subclasses `int`:
//! `True` as a count or an id is a mistake, not a 1.

use kvpool_core::CoreError;
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyInt, PyIterator, PyString};
use smallvec::SmallVec;

use crate::errors::PyKvError;
use crate::int_array::{is_numpy_bool, IntArray};

/// A value as an error message shows it: its repr, cut short (a long list's repr could be
/// megabytes).
pub fn shown(value: &Bound<'_, PyAny>) -> String {
    const MAX_CHARS: usize = 60;
    let repr = value.repr().map(|r| r.to_string()).unwrap_or_else(|_| "<unprintable>".into());
    if repr.chars().count() <= MAX_CHARS {
        return repr;
    }
    format!("{}...", repr.chars().take(MAX_CHARS).collect::<String>())
}

/// The name of a value's type, as an error message shows it.
pub fn type_name(value: &Bound<'_, PyAny>) -> String {
    value.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "<unnamed>".into())
}

/// `TypeError: {what}: must be {expected}, not {type} ({value})`. `what` names the argument
/// ("argument 'request_id'", "argument 'counts': item 2"); an empty `what` leaves the naming
/// to PyO3, which prefixes "argument '<name>': " to a TypeError raised while extracting one.
pub fn wrong_type(what: &str, expected: &str, value: &Bound<'_, PyAny>) -> PyErr {
    let prefix = if what.is_empty() { String::new() } else { format!("{what}: ") };
    PyTypeError::new_err(format!(
        "{prefix}must be {expected}, not {} ({})",
        type_name(value),
        shown(value)
    ))
}

/// Whether `value` is a bool, Python's or NumPy's.
pub fn is_bool(value: &Bound<'_, PyAny>) -> bool {
    value.is_instance_of::<PyBool>() || is_numpy_bool(value)
}

/// Whether `value` is a str, bytes or bytearray: iterable, but never a sequence of ints here.
pub fn is_text(value: &Bound<'_, PyAny>) -> bool {
    value.is_instance_of::<PyString>()
        || value.is_instance_of::<PyBytes>()
        || value.is_instance_of::<PyByteArray>()
}

/// The Python int that `value` stands for: an int itself, or what `__index__` returns (NumPy
/// integers, user types). A bool, or anything without `__index__`, is a `TypeError` naming
/// `what`; any other exception the caller's `__index__` raises propagates as it is.
pub fn index<'py>(value: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyInt>> {
    if is_bool(value) {
        return Err(wrong_type(what, "an int", value));
    }
    if let Ok(int) = value.cast::<PyInt>() {
        return Ok(int.clone());
    }
    // SAFETY: `value` is a live object while we hold the GIL; PyNumber_Index returns a new
    // reference to an int, or NULL with an exception set.
    let index = unsafe { pyo3::ffi::PyNumber_Index(value.as_ptr()) };
    // SAFETY: as above: an owned reference or NULL with the error set.
    match unsafe { Bound::from_owned_ptr_or_err(value.py(), index) } {
        // SAFETY: PyNumber_Index returns an int (an int subclass at most) or fails.
        Ok(int) => Ok(unsafe { int.cast_into_unchecked() }),
        Err(e) if e.is_instance_of::<PyTypeError>(value.py()) => {
            Err(wrong_type(what, "an int", value))
        }
        Err(e) => Err(e),
    }
}

/// An int as i64, or None when it is beyond i64 (either sign).
fn as_i64(int: &Bound<'_, PyInt>) -> PyResult<Option<i64>> {
    match int.extract::<i64>() {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_instance_of::<PyOverflowError>(int.py()) => Ok(None),
        Err(e) => Err(e),
    }
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

/// One block id, checked against `0..num_blocks`; `what` names the argument.
pub fn block_id(value: &Bound<'_, PyAny>, num_blocks: usize, what: &str) -> PyResult<u32> {
    let int = index(value, what)?;
    match as_i64(&int)? {
        Some(v) => Ok(check_range(v, num_blocks).map_err(PyKvError)?),
        None => Err(PyKvError(CoreError::InvalidBlock {
            value: shown(&int),
            reason: "too large for any block id".into(),
        })
        .into()),
    }
}

/// Checks a NumPy array passed where a sequence of ints is expected: a dtype that holds no
/// integers is a `TypeError` (an object array is read element by element, like a list), an
/// array of other than one dimension `InvalidArgumentError`; `what` names the argument.
pub fn check_int_array(array: &Bound<'_, PyUntypedArray>, what: &str) -> PyResult<()> {
    let dtype = array.dtype();
    match dtype.kind() {
        b'i' | b'u' | b'O' => {}
        b'b' => {
            return Err(PyTypeError::new_err(format!(
                "{what}: must be an integer array, not a bool array"
            )))
        }
        _ => {
            return Err(PyTypeError::new_err(format!(
                "{what}: must be an integer array, not an array of dtype {}",
                dtype.str().map(|s| s.to_string()).unwrap_or_default()
            )))
        }
    }
    if array.ndim() != 1 {
        return Err(PyKvError(CoreError::InvalidArgument(format!(
            "{what}: must be one-dimensional, got an array of shape {:?}",
            array.shape()
        )))
        .into());
    }
    Ok(())
}

/// An iterator over `values`, which must be an iterable of ints: a non-iterable, a str or
/// bytes is a `TypeError` naming `what`; an exception the caller's `__iter__` raises
/// propagates as it is.
pub fn int_iter<'py>(values: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyIterator>> {
    if is_text(values) {
        return Err(wrong_type(what, "an iterable of ints", values));
    }
    values.try_iter().map_err(|e| {
        if e.is_instance_of::<PyTypeError>(values.py()) {
            wrong_type(what, "an iterable of ints", values)
        } else {
            e // raised by the caller's __iter__
        }
    })
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
/// memcpy per call on the `free_many` path that runs every scheduler step (callgrind counted
/// 852 instructions reading a 16-id `free_many`'s ids returning it, 589 with the out-parameter:
/// `bench/results/2026-12-01_c23f8bd_dev-vm/pool_round_trip_callgrind.txt`).
pub fn block_ids(values: &Bound<'_, PyAny>, num_blocks: usize, ids: &mut BlockIds) -> PyResult<()> {
    const WHAT: &str = "argument 'block_ids'";
    if let Ok(array) = values.cast::<PyUntypedArray>() {
        if array.dtype().kind() == b'b' {
            return Err(PyTypeError::new_err(format!(
                "{WHAT}: must be an integer array, not a bool array (for a mask, pass np.flatnonzero(mask))"
            )));
        }
        check_int_array(array, WHAT)?;
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
        // An unsigned, object or non-native array: read element by element below.
    }
    let iter = int_iter(values, WHAT)?;
    reserve(ids, values.len().unwrap_or(0), num_blocks)?;
    for (i, item) in iter.enumerate() {
        ids.push(block_id(&item?, num_blocks, &format!("{WHAT}: item {i}"))?);
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

/// A Python int argument for a count, size or index (an int, a NumPy integer or anything
/// with `__index__`; a bool or any other type is a `TypeError`, which PyO3 prefixes with the
/// argument's name). An int beyond i64 keeps the int itself, so that errors name what the
/// caller passed, never a clamped value.
pub struct Int {
    value: i64,
    /// The caller's int when it is beyond i64 (then `value` is i64::MIN or i64::MAX).
    big: Option<Py<PyInt>>,
}

impl Int {
    pub fn new(value: i64) -> Self {
        Int { value, big: None }
    }
    /// `value` read as an int; `what` names it in a `TypeError`.
    pub fn of(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
        let int = index(value, what)?;
        match as_i64(&int)? {
            Some(v) => Ok(Int::new(v)),
            None => {
                let value = if int.lt(0)? { i64::MIN } else { i64::MAX };
                Ok(Int { value, big: Some(int.unbind()) })
            }
        }
    }
    /// The int as the caller wrote it, in decimal.
    pub fn shown(&self) -> String {
        match &self.big {
            None => self.value.to_string(),
            Some(big) => {
                Python::attach(|py| big.bind(py).str().map(|s| s.to_string()).unwrap_or_default())
            }
        }
    }
    /// Whether the int is below zero.
    pub fn is_negative(&self) -> bool {
        self.value < 0
    }
    /// The caller's int, when it is too large for any count (beyond i64).
    pub fn too_large(&self) -> Option<&Py<PyInt>> {
        self.big.as_ref().filter(|_| self.value > 0)
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Int::of(&obj, "")
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

/// A fraction argument: a float, or an int. A bool (NumPy's too) is a `TypeError`: `True` is
/// not a fraction.
pub struct Fraction(pub f64);

impl<'a, 'py> FromPyObject<'a, 'py> for Fraction {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if is_bool(&obj) {
            return Err(wrong_type("", "a float", &obj));
        }
        obj.extract::<f64>().map(Fraction).map_err(|e| {
            if e.is_instance_of::<PyTypeError>(obj.py()) {
                wrong_type("", "a float", &obj)
            } else {
                e
            }
        })
    }
}
