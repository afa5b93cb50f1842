//! NumPy int32 arrays out and 1-D int32/int64 arrays in, without rust-numpy's per-call costs
//! on the scheduler's hot path (a few dozen ids per call, every decode step):
//!
//! - In: `PyReadonlyArray` registers each borrow in a process-wide table (a hash-map insert
//!   and removal per call) and extracting one per dtype raises and discards an exception for
//!   each dtype that does not match. Here the dtype is checked once, from the descriptor,
//!   and the elements are copied out through raw pointers.
//! - Out: `PyArray::from_vec` wraps the Vec in a Python object that owns it, one more object
//!   to create and destroy per array. Here NumPy allocates the array at its final size and
//!   the ids are written into it.

use kvpool_core::CoreError;
use numpy::npyffi::{npy_intp, NpyTypes, PY_ARRAY_API};
use numpy::{Element, PyArray1, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyMemoryError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors::PyKvError;

/// A 1-D NumPy array of native-endian int32 or int64 whose elements are read in place.
pub struct IntArray<'a, 'py> {
    /// Held so the buffer outlives every read.
    _array: &'a Bound<'py, PyUntypedArray>,
    data: *const u8,
    len: usize,
    stride_bytes: isize,
    wide: bool,
}

impl<'a, 'py> IntArray<'a, 'py> {
    /// The array's elements, when it is 1-D with a native int32 or int64 dtype (the dtypes
    /// `np.array(..., dtype=np.int32 / np.int64)` and NumPy's default int make); None otherwise.
    pub fn of(array: &'a Bound<'py, PyUntypedArray>) -> Option<Self> {
        let dtype = array.dtype();
        let wide = match dtype.itemsize() {
            4 => false,
            8 => true,
            _ => return None,
        };
        if array.ndim() != 1 || dtype.kind() != b'i' || dtype.is_native_byteorder() == Some(false) {
            return None;
        }
        let raw = array.as_array_ptr();
        // SAFETY: `raw` points to the live array object we hold; a 1-D array has one entry in
        // `strides` and `dimensions` (`shape()` reads the latter the same way).
        let (data, stride_bytes) = unsafe { ((*raw).data as *const u8, *(*raw).strides) };
        Some(IntArray { _array: array, data, len: array.shape()[0], stride_bytes, wide })
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The elements, in order, as i64.
    pub fn values(&self) -> impl ExactSizeIterator<Item = i64> + '_ {
        (0..self.len).map(move |i| {
            let at = self.data.wrapping_offset(i as isize * self.stride_bytes);
            // SAFETY: `i < len`, so `at` is an element: NumPy keeps every
            // `data + i * strides[0]` with `i < shape[0]` inside the buffer, which lives while
            // we hold the array, and the width is the dtype's (checked in `of`). The reads
            // tolerate misalignment (a view of a byte buffer can be misaligned) and every bit
            // pattern is a valid integer. We hold the GIL and call no Python code while
            // reading, so no Python thread writes the buffer meanwhile, and we form no Rust
            // reference to it (a borrow another extension holds through rust-numpy is not
            // aliased); a write by native code that released the GIL would be the caller's
            // race, as with any reader of a NumPy buffer.
            unsafe {
                if self.wide {
                    at.cast::<i64>().read_unaligned()
                } else {
                    i64::from(at.cast::<i32>().read_unaligned())
                }
            }
        })
    }
}

/// A new 1-D int32 array of block ids, made by NumPy once at its final size before the ids
/// exist (so a failure to make it leaves nothing to undo), and shown to Python code only once
/// [`fill`](Self::fill) has written every element.
pub struct NewIdArray<'py> {
    array: Bound<'py, PyArray1<i32>>,
    len: usize,
}

impl<'py> NewIdArray<'py> {
    /// Room for `len` ids. NumPy's MemoryError becomes `OutOfMemoryError`, as for any buffer
    /// sized by a caller's count.
    pub fn new(py: Python<'py>, len: usize) -> PyResult<Self> {
        let mut dims = [len as npy_intp];
        // SAFETY: the arguments are those PyArray_NewFromDescr documents for a new C-ordered
        // 1-D array whose memory NumPy allocates: the array type, a new dtype reference
        // (stolen), one dimension, no strides, no data, no flags, no base object.
        let ptr = unsafe {
            PY_ARRAY_API.PyArray_NewFromDescr(
                py,
                PY_ARRAY_API.get_type_object(py, NpyTypes::PyArray_Type),
                i32::get_dtype(py).into_dtype_ptr(),
                1,
                dims.as_mut_ptr(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                std::ptr::null_mut(),
            )
        };
        // SAFETY: a new reference (or NULL with the error set) to an int32 array of one dimension.
        match unsafe { Bound::from_owned_ptr_or_err(py, ptr.cast::<ffi::PyObject>()) } {
            // SAFETY: as above, the object is a 1-D int32 array.
            Ok(array) => Ok(NewIdArray { array: unsafe { array.cast_into_unchecked() }, len }),
            Err(e) if e.is_instance_of::<PyMemoryError>(py) => {
                Err(PyKvError(CoreError::OutOfMemory {
                    requested_bytes: len.saturating_mul(4),
                    device: "host".into(),
                })
                .into())
            }
            Err(e) => Err(e),
        }
    }

    /// The array holding `ids`, exactly as many as it was made for. Ids are below
    /// `MAX_NUM_BLOCKS = i32::MAX`, so each converts exactly.
    pub fn fill(self, ids: &[u32]) -> Bound<'py, PyArray1<i32>> {
        debug_assert_eq!(ids.len(), self.len, "an id array filled with a different count");
        // SAFETY: the array is ours alone (not yet returned), C-contiguous, of `len` elements.
        let data = unsafe { (*self.array.as_array_ptr()).data as *mut i32 };
        for (i, &id) in ids.iter().take(self.len).enumerate() {
            // SAFETY: `i < len`: inside the array's buffer. Unaligned-tolerant, as NumPy's
            // allocator may be replaced by one with weaker alignment.
            unsafe { data.add(i).write_unaligned(id as i32) };
        }
        self.array
    }
}

/// Whether `value` is a NumPy bool scalar (`np.True_`): refused wherever a count, index or id
/// is expected, as `True` is.
pub fn is_numpy_bool(value: &Bound<'_, PyAny>) -> bool {
    // SAFETY: the type object comes from NumPy's C API table (loaded once; NumPy is a
    // dependency of the package); both pointers are live objects while we hold the GIL.
    unsafe {
        let numpy_bool = PY_ARRAY_API.get_type_object(value.py(), NpyTypes::PyBoolArrType_Type);
        ffi::PyObject_TypeCheck(value.as_ptr(), numpy_bool) != 0
    }
}
