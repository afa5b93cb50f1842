//! What the engines hand back: where a batch of copies stands, and the two slabs' geometry.

use crate::error::CoreError;

/// Where a swap's copies stand: complete already (host), or when an event fires (CUDA).
pub struct Done {
    #[cfg(feature = "cuda")]
    pub(super) event: Option<crate::driver::Event>,
}

impl Done {
    pub fn complete() -> Self {
        Done {
            #[cfg(feature = "cuda")]
            event: None,
        }
    }
    #[cfg(feature = "cuda")]
    pub fn after(event: crate::driver::Event) -> Self {
        Done { event: Some(event) }
    }
    /// Whether the copies have finished (never blocks).
    pub fn is_complete(&self) -> Result<bool, CoreError> {
        #[cfg(feature = "cuda")]
        if let Some(event) = &self.event {
            return event.query();
        }
        Ok(true)
    }
    /// Blocks until the copies have finished.
    pub fn wait(&self) -> Result<(), CoreError> {
        #[cfg(feature = "cuda")]
        if let Some(event) = &self.event {
            return event.wait();
        }
        Ok(())
    }
}

/// The two pools' geometry for one direction of a swap.
#[derive(Debug, Clone, Copy)]
pub struct Endpoints {
    pub src_base: u64,
    pub dst_base: u64,
    pub block_bytes: usize,
}
