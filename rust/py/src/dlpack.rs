//! DLPack export (`__dlpack__` / `__dlpack_device__`) with the true element type, so
//! `torch.from_dlpack(pool.k_view(0))` is a zero-copy bfloat16 / float8_e4m3fn tensor where
//! `__array_interface__` can only offer raw integers. Both capsule kinds are produced:
//! "dltensor_versioned" (DLPack >= 1.0, when the consumer passes `max_version >= (1, 0)`) and
//! the legacy "dltensor". The tensor's manager context owns a reference to the exporting
//! Python object (a view, which holds its pool; a block table's device array, which holds its
//! tables; a host pool's NumPy view, through `dlpack_as`), so the memory outlives every
//! consumer.

use std::ffi::{c_void, CStr};

use kvpool_core::{DType, Device};
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyTuple};

// The C structs of dlpack.h (v1.x), field for field.
#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";

/// `(device_type, device_id)` as `__dlpack_device__` returns it.
pub fn dl_device(device: Device) -> (i32, i32) {
    match device {
        Device::Host => (KDL_CPU, 0),
        Device::Cuda(ordinal) => (KDL_CUDA, ordinal as i32),
    }
}

/// An element type as DLPack names it: (type code, bits).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DlType {
    code: u8,
    bits: u8,
}

impl DlType {
    /// int32 (kDLInt = 0): the block tables' element type.
    pub const INT32: DlType = DlType { code: 0, bits: 32 };

    /// A pool dtype: kDLFloat = 2, kDLBfloat = 4, kDLFloat8_e4m3fn = 10, kDLFloat8_e5m2 = 12.
    pub fn of(dtype: DType) -> DlType {
        let (code, bits) = match dtype {
            DType::Float16 => (2, 16),
            DType::Float32 => (2, 32),
            DType::BFloat16 => (4, 16),
            DType::Float8E4M3 => (10, 8),
            DType::Float8E5M2 => (12, 8),
        };
        DlType { code, bits }
    }

    fn bytes(self) -> usize {
        usize::from(self.bits) / 8
    }
}

/// DLPack 1.x's flag of a tensor the consumer must not write (`DLPACK_FLAG_BITMASK_READ_ONLY`).
const FLAG_READ_ONLY: u64 = 1;

/// What an exported tensor describes: a strided array of `dtype` at `data`.
pub struct Export {
    pub data: u64,
    pub device: Device,
    pub dtype: DlType,
    pub shape: Vec<i64>,
    /// In elements, as DLPack counts them.
    pub strides: Vec<i64>,
    /// Marked read-only in a versioned capsule (a legacy capsule has no way to say it).
    pub read_only: bool,
}

/// C-order strides (in elements) of `shape`.
pub fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// The manager context: the exporter's reference and the shape/stride storage the DLTensor
/// points into, boxed together with the managed struct itself.
struct Ctx<M> {
    managed: M,
    _owner: Py<PyAny>,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

trait Managed {
    fn tensor(&mut self) -> &mut DLTensor;
    fn set_ctx(&mut self, ctx: *mut c_void);
}

impl Managed for DLManagedTensor {
    fn tensor(&mut self) -> &mut DLTensor {
        &mut self.dl_tensor
    }
    fn set_ctx(&mut self, ctx: *mut c_void) {
        self.manager_ctx = ctx;
    }
}

impl Managed for DLManagedTensorVersioned {
    fn tensor(&mut self) -> &mut DLTensor {
        &mut self.dl_tensor
    }
    fn set_ctx(&mut self, ctx: *mut c_void) {
        self.manager_ctx = ctx;
    }
}

/// Boxes the context, points the tensor at its shape/strides and the manager at the box, and
/// returns the address of the managed struct (what the capsule carries). Freed by the deleter.
fn leak<M: Managed>(
    managed: M,
    owner: Py<PyAny>,
    shape: Vec<i64>,
    strides: Vec<i64>,
) -> *mut c_void {
    let raw = Box::into_raw(Box::new(Ctx { managed, _owner: owner, shape, strides }));
    // SAFETY: `raw` is a fresh, unique pointer from Box::into_raw; nothing else sees it yet,
    // and the Vec buffers it points into never move (the Vecs are not touched again).
    unsafe {
        let ctx = &mut *raw;
        let (shape_ptr, strides_ptr) = (ctx.shape.as_mut_ptr(), ctx.strides.as_mut_ptr());
        let t = ctx.managed.tensor();
        t.shape = shape_ptr;
        t.strides = strides_ptr;
        ctx.managed.set_ctx(raw as *mut c_void);
        &mut ctx.managed as *mut M as *mut c_void
    }
}

/// A `max_version` or `dl_device` argument: None, or a tuple of two ints (any ints: a
/// consumer may support versions past ours, and an unknown device is refused by value). Any
/// other value is a `TypeError` naming the argument.
fn int_pair<'py>(
    value: Option<&Bound<'py, PyAny>>,
    what: &str,
) -> PyResult<Option<[Bound<'py, PyInt>; 2]>> {
    let Some(value) = value.filter(|v| !v.is_none()) else { return Ok(None) };
    let pair = value
        .cast::<PyTuple>()
        .ok()
        .filter(|t| t.len() == 2)
        .ok_or_else(|| crate::ids::wrong_type(what, "a tuple of two ints", value))?;
    Ok(Some([
        crate::ids::index(&pair.get_item(0)?, what)?,
        crate::ids::index(&pair.get_item(1)?, what)?,
    ]))
}

/// Checks the consumer's requests (a copy or another device cannot be honoured: a view is
/// always the pool's own memory; DLPack's `BufferError` says so) and returns a capsule over
/// `export`: versioned when `max_version`'s major is 1 or more.
pub fn to_capsule(
    py: Python<'_>,
    owner: Py<PyAny>,
    export: Export,
    max_version: Option<&Bound<'_, PyAny>>,
    dl_device_req: Option<&Bound<'_, PyAny>>,
    copy: Option<bool>,
) -> PyResult<Py<PyAny>> {
    let max_version = int_pair(max_version, "argument 'max_version'")?;
    let dl_device_req = int_pair(dl_device_req, "argument 'dl_device'")?;
    if copy == Some(true) {
        return Err(PyBufferError::new_err(
            "a kvpool view is never copied; copy=True cannot be honoured",
        ));
    }
    if let Some([device_type, device_id]) = dl_device_req {
        let (own_type, own_id) = dl_device(export.device);
        // An int past i64 is no device: a mismatch, like any other.
        let is = |int: &Bound<'_, PyInt>, own: i32| int.extract::<i64>().ok() == Some(own.into());
        if !is(&device_type, own_type) || !is(&device_id, own_id) {
            return Err(PyBufferError::new_err(format!(
                "the view lives on DLPack device ({own_type}, {own_id}), not ({device_type}, {device_id})"
            )));
        }
    }
    let versioned = match max_version {
        Some([major, _]) => major.ge(1)?,
        None => false,
    };
    let (device_type, device_id) = dl_device(export.device);
    let (data, ndim, dtype) = (export.data as *mut c_void, export.shape.len() as i32, export.dtype);
    let read_only = export.read_only;
    let tensor = |shape: *mut i64, strides: *mut i64| DLTensor {
        data,
        device: DLDevice { device_type, device_id },
        ndim,
        dtype: DLDataType { code: dtype.code, bits: dtype.bits, lanes: 1 },
        shape,
        strides,
        byte_offset: 0,
    };
    let (shape, strides) = (export.shape, export.strides);
    let null = std::ptr::null_mut();
    let managed_ptr = if versioned {
        let managed = DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx: null,
            deleter: Some(delete_versioned),
            flags: if read_only { FLAG_READ_ONLY } else { 0 },
            dl_tensor: tensor(null as *mut i64, null as *mut i64),
        };
        leak(managed, owner, shape, strides)
    } else {
        let managed = DLManagedTensor {
            dl_tensor: tensor(null as *mut i64, null as *mut i64),
            manager_ctx: null,
            deleter: Some(delete_legacy),
        };
        leak(managed, owner, shape, strides)
    };
    let name = if versioned { VERSIONED } else { LEGACY };
    // SAFETY: `managed_ptr` is valid until its deleter runs; the name is a static C string;
    // the destructor only touches capsules that still carry that name (unconsumed ones).
    let capsule =
        unsafe { ffi::PyCapsule_New(managed_ptr, name.as_ptr(), Some(capsule_destructor)) };
    if capsule.is_null() {
        // SAFETY: nothing consumed the tensor; free it through its own deleter.
        unsafe { call_deleter(managed_ptr, versioned) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: PyCapsule_New returned a new (owned) reference.
    Ok(unsafe { Py::from_owned_ptr(py, capsule) })
}

/// A DLPack capsule over a host NumPy array's own memory, labelled `dtype` (a pool dtype of
/// the array's element size): what NumPy cannot say for bfloat16 and float8, whose bits it
/// holds as 2- and 1-byte integers. Only the array's `__array_interface__` is read (its pointer,
/// shape, strides and writability), and the capsule holds the array, so the memory outlives
/// the consumer exactly as with NumPy's own export. A wrong type is a `TypeError`; an element
/// type that is not raw bits of `dtype`'s size (or `dtype` itself), `InvalidArgumentError`.
#[pyfunction]
#[pyo3(signature = (array, dtype, *, max_version=None, dl_device=None, copy=None))]
pub fn dlpack_as(
    array: &Bound<'_, PyAny>,
    dtype: &str,
    max_version: Option<&Bound<'_, PyAny>>,
    dl_device: Option<&Bound<'_, PyAny>>,
    copy: Option<bool>,
) -> PyResult<Py<PyAny>> {
    let py = array.py();
    let dtype = DType::parse(dtype).map_err(crate::errors::PyKvError)?;
    let dl = DlType::of(dtype);
    let iface = array.getattr("__array_interface__").map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err("dlpack_as takes a NumPy array (host memory)")
    })?;
    let typestr: String = iface.get_item("typestr")?.extract()?;
    let item: usize = typestr.get(2..).and_then(|n| n.parse().ok()).unwrap_or(0);
    let kind = typestr.as_bytes().get(1).copied().unwrap_or(b'?');
    // Raw bits (unsigned, signed or void items of the right size), or the dtype itself.
    let same_float = kind == b'f' && matches!(dtype, DType::Float16 | DType::Float32);
    if item != dl.bytes() || !(matches!(kind, b'u' | b'i' | b'V') || same_float) {
        return Err(invalid(format!(
            "an array of {typestr} cannot hold {}: it needs {}-byte items",
            dtype.name(),
            dl.bytes()
        )));
    }
    let (data, read_only): (u64, bool) = iface.get_item("data")?.extract()?;
    let shape: Vec<i64> = iface.get_item("shape")?.extract()?;
    let strides = match iface.get_item("strides")?.extract::<Option<Vec<i64>>>()? {
        None => contiguous_strides(&shape),
        Some(bytes) => {
            let item = item as i64;
            if bytes.iter().any(|b| b % item != 0) {
                return Err(invalid("the array's strides are not whole elements".into()));
            }
            bytes.iter().map(|b| b / item).collect()
        }
    };
    let export = Export { data, device: Device::Host, dtype: dl, shape, strides, read_only };
    to_capsule(py, array.clone().unbind(), export, max_version, dl_device, copy)
}

fn invalid(message: String) -> PyErr {
    crate::errors::PyKvError(kvpool_core::CoreError::InvalidArgument(message)).into()
}

/// # Safety
/// `managed` is an unconsumed DLManagedTensor(Versioned) made by `to_capsule`.
unsafe fn call_deleter(managed: *mut c_void, versioned: bool) {
    if versioned {
        // SAFETY: per the contract, a live versioned tensor.
        unsafe { delete_versioned(managed as *mut DLManagedTensorVersioned) }
    } else {
        // SAFETY: per the contract, a live legacy tensor.
        unsafe { delete_legacy(managed as *mut DLManagedTensor) }
    }
}

/// Runs when the capsule dies. A consumer renames the capsule ("used_dltensor...") and owns
/// the deleter call; a capsule that still has its name was never consumed, so free it here.
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    for (name, versioned) in [(VERSIONED, true), (LEGACY, false)] {
        // SAFETY: `capsule` is the capsule being destroyed; IsValid sets no error.
        if unsafe { ffi::PyCapsule_IsValid(capsule, name.as_ptr()) } == 1 {
            // SAFETY: the name matched, so the pointer is the unconsumed tensor we stored.
            let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, name.as_ptr()) };
            // SAFETY: unconsumed, made by to_capsule.
            unsafe { call_deleter(managed, versioned) };
            return;
        }
    }
}

/// Frees a context made by `leak`. Dropping it releases the owner's reference, which needs
/// the interpreter: `attach` takes the GIL (or reuses the held one). Once the interpreter is
/// finalizing (`Py_IsInitialized` is 0 from the start of `Py_FinalizeEx`, while it still
/// frees module globals: a module-level `np.from_dlpack(view)` is released there) no Python
/// call may be made, so the context and its reference are left to the process's exit.
///
/// # Safety
/// `ctx` is a live context from `leak`, not freed before (DLPack calls a deleter once).
unsafe fn free_ctx<M>(ctx: *mut Ctx<M>) {
    // SAFETY: Py_IsInitialized may be called at any time, with or without the GIL.
    if unsafe { ffi::Py_IsInitialized() } == 0 {
        return;
    }
    // SAFETY: per the contract, a live Box made by `leak`, freed once.
    Python::attach(|_| drop(unsafe { Box::from_raw(ctx) }));
}

unsafe extern "C" fn delete_legacy(managed: *mut DLManagedTensor) {
    // SAFETY: manager_ctx is the Box<Ctx<DLManagedTensor>> leaked in to_capsule, and the
    // deleter runs once.
    unsafe { free_ctx((*managed).manager_ctx as *mut Ctx<DLManagedTensor>) }
}

unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    // SAFETY: as in delete_legacy, for the versioned struct.
    unsafe { free_ctx((*managed).manager_ctx as *mut Ctx<DLManagedTensorVersioned>) }
}
