//! A CUDA pool's device context: the primary context of its device and the pool's own
//! non-blocking stream, on which block-table uploads and the kernels that read them are
//! ordered. The memory backends only hold the context they allocate in; the stream is the
//! pool's, whatever backend its slab has.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::driver::{self, Stream};
use crate::error::CoreError;

pub struct DeviceContext {
    ctx: Arc<CudaContext>,
    stream: Stream,
}

impl DeviceContext {
    /// Retains the primary context of device `ordinal` and creates the pool's stream in it.
    pub fn new(ordinal: usize) -> Result<Self, CoreError> {
        let ctx = driver::primary_context(ordinal)?;
        let stream = Stream::new(&ctx)?;
        Ok(DeviceContext { ctx, stream })
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    pub fn stream(&self) -> &Stream {
        &self.stream
    }
}
