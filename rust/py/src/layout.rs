//! `KvLayout` for Python: a frozen value object over the core layout.

use kvpool_core::{CoreError, DType, KvLayout};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::KvResult;
use crate::ids::{self, Int};

/// Geometry of a KV block: `[layer][K|V][token][kv_head][head_dim]` per block.
#[pyclass(module = "kvpool._core", name = "KvLayout", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyKvLayout {
    pub inner: KvLayout,
}

#[pymethods]
impl PyKvLayout {
    #[new]
    #[pyo3(signature = (num_layers, num_kv_heads, head_dim, block_size, dtype = "float16"))]
    fn new(
        num_layers: Int,
        num_kv_heads: Int,
        head_dim: Int,
        block_size: Int,
        dtype: &str,
    ) -> KvResult<Self> {
        let dtype = DType::parse(dtype)?;
        let size = |value: Int, what: &str| {
            if value.is_negative() {
                return Err(CoreError::InvalidLayout(format!(
                    "{what} must be positive, got {}",
                    value.shown()
                )));
            }
            match ids::count(value, what) {
                Ok(0) => Err(CoreError::InvalidLayout(format!("{what} must be positive, got 0"))),
                Ok(n) => Ok(n),
                Err(CoreError::InvalidArgument(why)) => Err(CoreError::InvalidLayout(why)),
                Err(e) => Err(e),
            }
        };
        Ok(PyKvLayout {
            inner: KvLayout::new(
                size(num_layers, "num_layers")?,
                size(num_kv_heads, "num_kv_heads")?,
                size(head_dim, "head_dim")?,
                size(block_size, "block_size")?,
                dtype,
            )?,
        })
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }
    #[getter]
    fn num_kv_heads(&self) -> usize {
        self.inner.num_kv_heads()
    }
    #[getter]
    fn head_dim(&self) -> usize {
        self.inner.head_dim()
    }
    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype().name()
    }
    #[getter]
    fn elem_bytes(&self) -> usize {
        self.inner.elem_bytes()
    }
    #[getter]
    fn block_bytes(&self) -> usize {
        self.inner.block_bytes()
    }

    /// The layout of one rank's shard under tensor parallelism over `tp_size` ranks:
    /// `num_kv_heads / tp_size` heads, or one head when `tp_size` is a multiple of
    /// `num_kv_heads` (replicated heads). Any other pair raises `LayoutError` naming both.
    fn tp_shard(&self, tp_size: Int) -> KvResult<Self> {
        Ok(PyKvLayout { inner: self.inner.tp_shard(ids::count(tp_size, "tp_size")?)? })
    }

    /// `(first, stop)`: the KV heads of this layout that rank `rank` of `tp_size` holds.
    fn tp_head_range(&self, tp_size: Int, rank: Int) -> KvResult<(usize, usize)> {
        let range =
            self.inner.tp_head_range(ids::count(tp_size, "tp_size")?, ids::count(rank, "rank")?)?;
        Ok((range.start, range.end))
    }

    /// Byte strides of the block-major layout: block, layer, kv (K to V), token, head, elem.
    fn strides<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let l = &self.inner;
        let d = PyDict::new(py);
        d.set_item("block", l.block_bytes())?;
        d.set_item("layer", l.layer_stride_bytes())?;
        d.set_item("kv", l.kv_stride_bytes())?;
        d.set_item("token", l.token_stride_bytes())?;
        d.set_item("head", l.head_stride_bytes())?;
        d.set_item("elem", l.elem_bytes())?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let l = &self.inner;
        format!(
            "KvLayout(num_layers={}, num_kv_heads={}, head_dim={}, block_size={}, dtype='{}')",
            l.num_layers(),
            l.num_kv_heads(),
            l.head_dim(),
            l.block_size(),
            l.dtype().name()
        )
    }

    fn __getnewargs__(&self) -> (usize, usize, usize, usize, &'static str) {
        let l = &self.inner;
        (l.num_layers(), l.num_kv_heads(), l.head_dim(), l.block_size(), l.dtype().name())
    }
}
