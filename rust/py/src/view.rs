//! Per-layer K/V views of the slab: `__array_interface__` on the host,
//! `__cuda_array_interface__` (v3) on CUDA, so NumPy, CuPy and PyTorch see the pool's
//! memory without a copy. A view holds its pool, so the slab outlives every view, and pins
//! its extent (the blocks that existed when it was made; `Pool::pin_view_extent`) until it is
//! dropped, so a shrink never unmaps memory that a live view covers.

use kvpool_core::layout::KvPart;
use kvpool_core::{DType, Device};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::pool::PyPool;

/// NumPy/CUDA typestr of the stored elements. NumPy has no bfloat16 or float8, so those
/// views expose their raw storage (`<u2`, `|u1`); a host pool's array view
/// (`kvpool.PoolArray`) and DLPack carry the true dtype.
fn typestr(dtype: DType) -> &'static str {
    match dtype {
        DType::Float16 => "<f2",
        DType::Float32 => "<f4",
        DType::BFloat16 => "<u2",
        DType::Float8E4M3 | DType::Float8E5M2 => "|u1",
    }
}

/// `[extent, block_size, num_kv_heads, head_dim]` over one layer's K or V, where `extent` is
/// the pool's `num_blocks` when the view was made (a view does not follow later growth; take a
/// new one).
#[pyclass(module = "kvpool._core", name = "SlabView", frozen)]
pub struct SlabView {
    pool: Py<PyPool>,
    layer: usize,
    part: KvPart,
    /// Blocks covered, pinned with the pool until drop.
    extent: usize,
}

impl SlabView {
    pub fn new(pool: Py<PyPool>, layer: usize, part: KvPart) -> Self {
        let extent = pool.get().inner.pin_view_extent();
        SlabView { pool, layer, part, extent }
    }

    fn interface<'py>(&self, py: Python<'py>, version: u32) -> PyResult<Bound<'py, PyDict>> {
        let pool = &self.pool.get().inner;
        let layout = pool.layout().map_err(crate::errors::PyKvError)?;
        let offset =
            layout.part_offset_bytes(self.layer, self.part).map_err(crate::errors::PyKvError)?;
        let (shape, strides) = layout.view_shape_strides(self.extent);
        let d = PyDict::new(py);
        d.set_item("shape", PyTuple::new(py, shape)?)?;
        d.set_item("strides", PyTuple::new(py, strides)?)?;
        d.set_item("typestr", typestr(layout.dtype()))?;
        d.set_item("data", (pool.base_ptr() + offset as u64, false))?;
        d.set_item("version", version)?;
        Ok(d)
    }

    /// The view as DLPack sees it: the true dtype, strides in elements.
    fn export(&self) -> PyResult<crate::dlpack::Export> {
        let pool = &self.pool.get().inner;
        let layout = pool.layout().map_err(crate::errors::PyKvError)?;
        let offset =
            layout.part_offset_bytes(self.layer, self.part).map_err(crate::errors::PyKvError)?;
        let (shape, strides) = layout.view_shape_strides(self.extent);
        let elem = layout.elem_bytes();
        Ok(crate::dlpack::Export {
            data: pool.base_ptr() + offset as u64,
            device: pool.device(),
            dtype: crate::dlpack::DlType::of(layout.dtype()),
            shape: shape.iter().map(|&n| n as i64).collect(),
            strides: strides.iter().map(|&b| (b / elem) as i64).collect(),
            read_only: false,
        })
    }
}

impl Drop for SlabView {
    fn drop(&mut self) {
        // `get` needs no GIL (the pool class is frozen); the unpin takes a short mutex only.
        self.pool.get().inner.unpin_view_extent(self.extent);
    }
}

#[pymethods]
impl SlabView {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        if self.pool.get().inner.device() != Device::Host {
            return Err(pyo3::exceptions::PyAttributeError::new_err(
                "a CUDA pool's view has no __array_interface__; use __cuda_array_interface__",
            ));
        }
        self.interface(py, 3)
    }

    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        if self.pool.get().inner.device() == Device::Host {
            return Err(pyo3::exceptions::PyAttributeError::new_err(
                "a host pool's view has no __cuda_array_interface__; use numpy.asarray",
            ));
        }
        let d = self.interface(py, 3)?;
        // The pool writes device memory only synchronously (the zeroing memset at creation),
        // so there is no stream for a consumer to wait on.
        d.set_item("stream", py.None())?;
        Ok(d)
    }

    /// A DLPack capsule over the view (zero-copy; bfloat16 and float8_e4m3fn as themselves),
    /// e.g. for `torch.from_dlpack`. The pool issues no asynchronous writes, so `stream` needs
    /// no synchronisation; a host view takes none (DLPack's rule for CPU data).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        slf: &Bound<'_, Self>,
        stream: Option<Bound<'_, PyAny>>,
        max_version: Option<&Bound<'_, PyAny>>,
        dl_device: Option<&Bound<'_, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let this = slf.get();
        if stream.is_some() && this.pool.get().inner.device() == Device::Host {
            return Err(pyo3::exceptions::PyBufferError::new_err("a host view takes no stream"));
        }
        let owner = slf.clone().into_any().unbind();
        crate::dlpack::to_capsule(slf.py(), owner, this.export()?, max_version, dl_device, copy)
    }

    /// `(device_type, device_id)`: (1, 0) for a host pool, (2, ordinal) for a CUDA pool.
    fn __dlpack_device__(&self) -> (i32, i32) {
        crate::dlpack::dl_device(self.pool.get().inner.device())
    }

    #[getter]
    fn layer(&self) -> usize {
        self.layer
    }

    #[getter]
    fn kind(&self) -> &'static str {
        match self.part {
            KvPart::K => "k",
            KvPart::V => "v",
        }
    }

    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyPool> {
        self.pool.clone_ref(py)
    }
}

impl PyPool {
    /// The view of one layer's K or V (`Pool.k_view` / `v_view`): a NumPy array over a host
    /// pool (a `kvpool.PoolArray`, which exports DLPack with the pool's dtype), the view itself
    /// (`__cuda_array_interface__`, DLPack) over a CUDA pool. Here, beside the view, so that
    /// the pool's module does not depend on this one.
    pub(crate) fn view(slf: &Bound<'_, Self>, layer: usize, part: KvPart) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let pool = &slf.get().inner;
        // A pool of hybrid pages has no layout: refused here, before a view pins anything.
        let layout = pool.layout().map_err(crate::errors::PyKvError)?;
        layout.part_offset_bytes(layer, part).map_err(crate::errors::PyKvError)?;
        let view = Py::new(py, SlabView::new(slf.clone().unbind(), layer, part))?;
        if pool.device() == Device::Host {
            // A NumPy array whose base is the view, which holds the pool alive; the subclass
            // knows the pool's dtype (bfloat16, float8) that NumPy holds as raw integers.
            let dtype = layout.dtype().name();
            let wrap = py.import("kvpool._pool_array")?.getattr("pool_array")?;
            Ok(wrap.call1((view, dtype))?.unbind())
        } else {
            Ok(view.into_any())
        }
    }
}
