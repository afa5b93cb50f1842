//! The memory region of a caller's buffer for `Pool.from_external`: read from its
//! `__cuda_array_interface__` (device memory) or `__array_interface__` (host memory; other
//! buffer-protocol objects go through `numpy.asarray`, which shares their memory).

use kvpool_core::{CoreError, Device};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::PyKvError;

/// Where a caller's buffer lies, and the object that keeps it alive.
pub struct Region {
    pub ptr: u64,
    pub len_bytes: usize,
    pub device: Device,
    pub owner: Py<PyAny>,
}

fn invalid(message: String) -> PyErr {
    PyKvError(CoreError::InvalidArgument(message)).into()
}

/// Reads `buffer`'s interface. `device` must name a CUDA device for device memory and be
/// None or host-like for host memory.
pub fn region(buffer: &Bound<'_, PyAny>, device: Option<&str>) -> PyResult<Region> {
    let py = buffer.py();
    let device = device.map(Device::parse).transpose().map_err(PyKvError)?;
    if let Ok(iface) = buffer.getattr("__cuda_array_interface__") {
        let Some(device @ Device::Cuda(_)) = device else {
            return Err(invalid(
                "a buffer with __cuda_array_interface__ needs device=\"cuda:N\" (the device that holds it)".into(),
            ));
        };
        let (ptr, len_bytes) = read_interface(&iface, "__cuda_array_interface__")?;
        return Ok(Region { ptr, len_bytes, device, owner: buffer.clone().unbind() });
    }
    if let Some(Device::Cuda(_)) = device {
        return Err(invalid(format!(
            "device={device:?} needs a buffer with __cuda_array_interface__; this one has none"
        )));
    }
    let not_memory = || {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "Pool.from_external needs an object with __cuda_array_interface__, __array_interface__ or the buffer protocol, got {}",
            buffer.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    };
    // The array keeps the original object alive (as its base), so it is the owner.
    let array = if buffer.hasattr("__array_interface__")? {
        buffer.clone()
    } else {
        // A buffer-protocol object only: NumPy would wrap anything else in an object array.
        let view = py
            .import("builtins")?
            .getattr("memoryview")?
            .call1((buffer,))
            .map_err(|_| not_memory())?;
        py.import("numpy")?.call_method1("asarray", (view,)).map_err(|_| not_memory())?
    };
    let iface = array.getattr("__array_interface__")?;
    let (ptr, len_bytes) = read_interface(&iface, "__array_interface__")?;
    Ok(Region { ptr, len_bytes, device: Device::Host, owner: array.unbind() })
}

/// `(address, bytes)` of a C-contiguous, writable array interface.
fn read_interface(iface: &Bound<'_, PyAny>, what: &str) -> PyResult<(u64, usize)> {
    let d = iface.cast::<PyDict>().map_err(|_| invalid(format!("{what} is not a dict")))?;
    let get = |key: &str| -> PyResult<Bound<'_, PyAny>> {
        d.get_item(key)?.ok_or_else(|| invalid(format!("{what} has no {key:?}")))
    };
    let (ptr, readonly): (u64, bool) = get("data")?
        .extract()
        .map_err(|_| invalid(format!("{what}['data'] is not (int, bool)")))?;
    if readonly {
        return Err(invalid(format!("the buffer is read-only ({what}); a pool writes its blocks")));
    }
    let shape: Vec<usize> =
        get("shape")?.extract().map_err(|_| invalid(format!("{what}['shape'] is not a tuple")))?;
    let typestr: String = get("typestr")?.extract()?;
    let itemsize: usize = typestr
        .get(2..)
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| invalid(format!("{what}['typestr'] {typestr:?} has no item size")))?;
    let strides = d.get_item("strides")?.filter(|s| !s.is_none());
    if let Some(strides) = strides {
        let strides: Vec<isize> = strides.cast::<PyTuple>()?.extract()?;
        let mut expected = itemsize as isize;
        for (dim, &stride) in shape.iter().zip(&strides).rev() {
            if *dim > 1 && stride != expected {
                return Err(invalid(format!(
                    "the buffer is not C-contiguous (strides {strides:?} for shape {shape:?})"
                )));
            }
            expected *= *dim as isize;
        }
    }
    let len_bytes = shape
        .iter()
        .try_fold(itemsize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| invalid(format!("the buffer's shape {shape:?} overflows")))?;
    Ok((ptr, len_bytes))
}
