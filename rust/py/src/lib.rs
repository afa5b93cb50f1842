//! `kvpool._core`: the Python face of kvpool-core. Each file binds one core type; the
//! allocator logic lives in the core crate only.

mod dlpack;
mod errors;
mod evicted;
mod external;
mod hybrid;
mod hybrid_spec;
mod ids;
mod int_array;
mod kernel_sources;
mod layout;
mod pool;
mod prefix;
mod stream;
mod tables;
mod tensor_map;
mod tier;
mod view;

use pyo3::prelude::*;

/// True when a CUDA driver and at least one device are present (never raises).
#[pyfunction]
fn cuda_available() -> bool {
    kvpool_core::slab::cuda_device_count() > 0
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<layout::PyKvLayout>()?;
    m.add_class::<pool::PyPool>()?;
    m.add_class::<view::SlabView>()?;
    m.add_class::<tables::PyBlockTables>()?;
    m.add_class::<tier::PyHostTier>()?;
    m.add_class::<hybrid_spec::PyKvGroup>()?;
    m.add_class::<hybrid_spec::PyModelKvSpec>()?;
    m.add_class::<hybrid::PyHybridTables>()?;
    m.add_class::<hybrid::PyHybridHostTier>()?;
    m.add_class::<hybrid::PyHybridAddResult>()?;
    m.add_class::<stream::CudaStream>()?;
    m.add_class::<stream::DeviceArray>()?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_sources::kernel_sources, m)?)?;
    m.add_function(wrap_pyfunction!(dlpack::dlpack_as, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_map::tensor_map_tiled, m)?)?;
    prefix::register(m)?;
    evicted::register(m)?;
    errors::register(m)?;
    m.add("MAX_NUM_BLOCKS", kvpool_core::MAX_NUM_BLOCKS)?;
    Ok(())
}
