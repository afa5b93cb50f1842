//! The CUDA kernel sources, embedded at build time from the repository's `cuda/` folder
//! (see `build.rs`); `kvpool.kernels` compiles them at run time.

use pyo3::prelude::*;
use pyo3::types::PyDict;

include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));

/// `{file name: source text}` of every `.cu` and `.cuh` file this build embedded.
#[pyfunction]
pub fn kernel_sources(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let sources = PyDict::new(py);
    for (name, text) in KERNEL_SOURCES {
        sources.set_item(name, text)?;
    }
    Ok(sources)
}
