//! The pool of a hybrid model, made from its spec's page bytes on any backend:
//! `Pool::new(&spec, ..)`, `Pool::new_growable(&spec, ..)`, `Pool::with_chunk_backend(&spec,
//! ..)` and `Pool::new_host_tier(&spec, ..)` take the spec where a `KvLayout` goes.

use crate::hybrid::spec::ModelKvSpec;
use crate::pool::PoolGeometry;

impl From<&ModelKvSpec> for PoolGeometry {
    /// Pages of the spec's `page_bytes`. Not a `KvLayout`, even for a uniform spec: where a
    /// group's bytes are inside a page is the spec's to say, so views come from it.
    fn from(spec: &ModelKvSpec) -> Self {
        PoolGeometry::pages(spec.page_bytes())
            .expect("ModelKvSpec::new accepts only positive multiples of BLOCK_ALIGN_BYTES")
    }
}
