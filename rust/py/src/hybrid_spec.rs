//! A hybrid model's KV groups and spec for Python: `KvGroup` and `ModelKvSpec` over the
//! core's `hybrid` spec (design in `rust/core/src/hybrid/hybrid.md`), with their argument
//! checks and the default page size. Apart from `hybrid.rs` (the tables and host tier over a
//! pool) so that `Pool.for_spec` (`pool.rs`) can take a spec without the pool and the
//! tables depending on each other.
//!
//! Errors as in `hybrid.rs`: a wrong type is a `TypeError`; a group, page size or spec that
//! cannot be (a window of 0, layers not covered once, a token larger than a page) is a
//! `LayoutError`; a group index or position out of range is an `InvalidArgumentError`.

use kvpool_core::hybrid::{
    AttentionShape, GroupKind, KvGroup, ModelKvSpec, PageGeometry, StatePacking,
};
use kvpool_core::layout::{KvPart, BLOCK_ALIGN_BYTES};
use kvpool_core::{CoreError, DType};
use numpy::PyUntypedArray;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::errors::{KvResult, PyKvError};
use crate::ids::{self, Int};
use crate::int_array::IntArray;
use crate::layout::PyKvLayout;

/// Tokens per page the default page size gives the largest token group (hybrid.md,
/// "Choosing `page_bytes`"): 16, or 64 for an MLA group (FlashMLA's page).
const DEFAULT_TOKENS_PER_PAGE: usize = 16;
const DEFAULT_MLA_TOKENS_PER_PAGE: usize = 64;

fn layout_error(message: String) -> PyErr {
    PyKvError(CoreError::InvalidLayout(message)).into()
}

/// A positive size of a group (`num_kv_heads`, `window`, ...): 0 or a negative int is a
/// `LayoutError` naming `what`, as `KvLayout` does for its sizes.
fn positive(value: Int, what: &str) -> PyResult<usize> {
    match ids::count(value, what) {
        Ok(0) => Err(layout_error(format!("{what} must be positive, got 0"))),
        Ok(n) => Ok(n),
        Err(CoreError::InvalidArgument(why)) => Err(layout_error(why)),
        Err(e) => Err(PyKvError(e).into()),
    }
}

/// A size that may be 0 (`rope_dim`).
fn size(value: Int, what: &str) -> PyResult<usize> {
    ids::count(value, what).map_err(|e| match e {
        CoreError::InvalidArgument(why) => layout_error(why),
        e => PyKvError(e).into(),
    })
}

/// Non-negative ints from a 1-D integer array or any iterable of ints (`what` names the
/// argument; `item` says what each int is in a message). A negative one is refused with
/// `refuse`, the error kind that fits the argument.
pub(crate) fn index_list(
    values: &Bound<'_, PyAny>,
    what: &str,
    item: &str,
    refuse: fn(String) -> CoreError,
) -> PyResult<Vec<usize>> {
    let negative = |i: usize, v: &str| {
        PyErr::from(PyKvError(refuse(format!("{what}: item {i}: {item} {v} is negative"))))
    };
    if let Ok(array) = values.cast::<PyUntypedArray>() {
        ids::check_int_array(array, what)?;
        if let Some(ints) = IntArray::of(array) {
            return ints
                .values()
                .enumerate()
                .map(|(i, v)| usize::try_from(v).map_err(|_| negative(i, &v.to_string())))
                .collect();
        }
    }
    let iter = ids::int_iter(values, what)?;
    let mut out = Vec::with_capacity(values.len().unwrap_or(0));
    for (i, value) in iter.enumerate() {
        let int = Int::of(&value?, &format!("{what}: item {i}"))?;
        if int.is_negative() {
            return Err(negative(i, &int.shown()));
        }
        out.push(ids::count(int, item).map_err(|e| match e {
            CoreError::InvalidArgument(why) => {
                PyKvError(refuse(format!("{what}: item {i}: {why}")))
            }
            e => PyKvError(e),
        })?);
    }
    Ok(out)
}

/// A group's layers: non-empty and without repeats (whether they cover the model is the
/// spec's check).
fn group_layers(values: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let layers = index_list(values, "argument 'layers'", "layer", CoreError::InvalidLayout)?;
    if layers.is_empty() {
        return Err(layout_error("a group needs at least one layer, got none".into()));
    }
    let mut sorted = layers.clone();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(layout_error(format!("layer {} is listed twice in the group", w[0])));
    }
    Ok(layers)
}

fn attention_shape(num_kv_heads: Int, head_dim: Int, dtype: &str) -> PyResult<AttentionShape> {
    Ok(AttentionShape {
        num_kv_heads: positive(num_kv_heads, "num_kv_heads")?,
        head_dim: positive(head_dim, "head_dim")?,
        dtype: DType::parse(dtype).map_err(PyKvError)?,
    })
}

/// Some layers of a model and what they keep per request: made by `KvGroup.full`,
/// `.sliding_window`, `.chunked_local`, `.mla_latent` or `.recurrent_state`. An immutable
/// value; equal groups hash equal.
#[pyclass(module = "kvpool._core", name = "KvGroup", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyKvGroup {
    pub inner: KvGroup,
}

impl PyKvGroup {
    fn new(layers: &Bound<'_, PyAny>, kind: GroupKind) -> PyResult<Self> {
        Ok(PyKvGroup { inner: KvGroup::new(group_layers(layers)?, kind) })
    }

    fn shape(&self) -> Option<AttentionShape> {
        match self.inner.kind {
            GroupKind::Full(shape)
            | GroupKind::SlidingWindow { shape, .. }
            | GroupKind::ChunkedLocal { shape, .. } => Some(shape),
            GroupKind::MlaLatent { .. } | GroupKind::RecurrentState { .. } => None,
        }
    }
}

#[pymethods]
impl PyKvGroup {
    /// Full attention: every token, for every later query.
    #[staticmethod]
    #[pyo3(signature = (layers, num_kv_heads, head_dim, dtype = "float16"))]
    fn full(
        layers: &Bound<'_, PyAny>,
        num_kv_heads: Int,
        head_dim: Int,
        dtype: &str,
    ) -> PyResult<Self> {
        Self::new(layers, GroupKind::Full(attention_shape(num_kv_heads, head_dim, dtype)?))
    }

    /// Sliding-window attention: the query at position `p` sees the keys at
    /// `p - window + 1 ..= p`.
    #[staticmethod]
    #[pyo3(signature = (layers, window, num_kv_heads, head_dim, dtype = "float16"))]
    fn sliding_window(
        layers: &Bound<'_, PyAny>,
        window: Int,
        num_kv_heads: Int,
        head_dim: Int,
        dtype: &str,
    ) -> PyResult<Self> {
        let window = positive(window, "window")?;
        let shape = attention_shape(num_kv_heads, head_dim, dtype)?;
        Self::new(layers, GroupKind::SlidingWindow { window, shape })
    }

    /// Chunked local attention: the query at position `p` sees the keys from the start of
    /// its chunk, `p // chunk * chunk ..= p`.
    #[staticmethod]
    #[pyo3(signature = (layers, chunk, num_kv_heads, head_dim, dtype = "float16"))]
    fn chunked_local(
        layers: &Bound<'_, PyAny>,
        chunk: Int,
        num_kv_heads: Int,
        head_dim: Int,
        dtype: &str,
    ) -> PyResult<Self> {
        let chunk = positive(chunk, "chunk")?;
        let shape = attention_shape(num_kv_heads, head_dim, dtype)?;
        Self::new(layers, GroupKind::ChunkedLocal { chunk, shape })
    }

    /// MLA: every token as one latent vector of `latent_dim + rope_dim` elements per layer.
    #[staticmethod]
    #[pyo3(
        signature = (layers, latent_dim = Int::new(512), rope_dim = Int::new(64), dtype = "float16"),
        text_signature = "(layers, latent_dim=512, rope_dim=64, dtype='float16')"
    )]
    fn mla_latent(
        layers: &Bound<'_, PyAny>,
        latent_dim: Int,
        rope_dim: Int,
        dtype: &str,
    ) -> PyResult<Self> {
        let kind = GroupKind::MlaLatent {
            latent_dim: positive(latent_dim, "latent_dim")?,
            rope_dim: size(rope_dim, "rope_dim")?,
            dtype: DType::parse(dtype).map_err(PyKvError)?,
        };
        Self::new(layers, kind)
    }

    /// A recurrent state (Mamba, Gated DeltaNet): `bytes_per_layer` bytes per request and
    /// layer, whatever the request's length.
    #[staticmethod]
    fn recurrent_state(layers: &Bound<'_, PyAny>, bytes_per_layer: Int) -> PyResult<Self> {
        let bytes_per_layer = positive(bytes_per_layer, "bytes_per_layer")?;
        Self::new(layers, GroupKind::RecurrentState { bytes_per_layer })
    }

    /// `"full"`, `"sliding_window"`, `"chunked_local"`, `"mla_latent"` or `"recurrent_state"`.
    #[getter]
    fn kind(&self) -> &'static str {
        kind_name(&self.inner.kind)
    }
    /// Model layer indices, in the order the group's pages hold them.
    #[getter]
    fn layers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.inner.layers)
    }
    #[getter]
    fn window(&self) -> Option<usize> {
        match self.inner.kind {
            GroupKind::SlidingWindow { window, .. } => Some(window),
            _ => None,
        }
    }
    #[getter]
    fn chunk(&self) -> Option<usize> {
        match self.inner.kind {
            GroupKind::ChunkedLocal { chunk, .. } => Some(chunk),
            _ => None,
        }
    }
    #[getter]
    fn num_kv_heads(&self) -> Option<usize> {
        self.shape().map(|s| s.num_kv_heads)
    }
    #[getter]
    fn head_dim(&self) -> Option<usize> {
        self.shape().map(|s| s.head_dim)
    }
    #[getter]
    fn latent_dim(&self) -> Option<usize> {
        match self.inner.kind {
            GroupKind::MlaLatent { latent_dim, .. } => Some(latent_dim),
            _ => None,
        }
    }
    #[getter]
    fn rope_dim(&self) -> Option<usize> {
        match self.inner.kind {
            GroupKind::MlaLatent { rope_dim, .. } => Some(rope_dim),
            _ => None,
        }
    }
    /// The element type (None for a state group, which is bytes).
    #[getter]
    fn dtype(&self) -> Option<&'static str> {
        match self.inner.kind {
            GroupKind::MlaLatent { dtype, .. } => Some(dtype.name()),
            GroupKind::RecurrentState { .. } => None,
            _ => self.shape().map(|s| s.dtype.name()),
        }
    }
    #[getter]
    fn bytes_per_layer(&self) -> Option<usize> {
        match self.inner.kind {
            GroupKind::RecurrentState { bytes_per_layer } => Some(bytes_per_layer),
            _ => None,
        }
    }
    /// Bytes of one token over all the group's layers (None for a state group).
    #[getter]
    fn token_bytes(&self) -> KvResult<Option<usize>> {
        if matches!(self.inner.kind, GroupKind::RecurrentState { .. }) {
            return Ok(None);
        }
        self.inner.token_bytes().map(Some).ok_or_else(|| {
            CoreError::InvalidLayout("one token's bytes overflow a usize".into()).into()
        })
    }

    fn __repr__(&self) -> String {
        let layers = &self.inner.layers;
        let layers = if layers.len() > 1 && layers.windows(2).all(|w| w[1] == w[0] + 1) {
            format!("range({}, {})", layers[0], layers[layers.len() - 1] + 1)
        } else {
            format!("{layers:?}")
        };
        match self.inner.kind {
            GroupKind::Full(s) => format!(
                "KvGroup.full({layers}, num_kv_heads={}, head_dim={}, dtype='{}')",
                s.num_kv_heads,
                s.head_dim,
                s.dtype.name()
            ),
            GroupKind::SlidingWindow { window, shape: s } => format!(
                "KvGroup.sliding_window({layers}, window={window}, num_kv_heads={}, \
                 head_dim={}, dtype='{}')",
                s.num_kv_heads,
                s.head_dim,
                s.dtype.name()
            ),
            GroupKind::ChunkedLocal { chunk, shape: s } => format!(
                "KvGroup.chunked_local({layers}, chunk={chunk}, num_kv_heads={}, head_dim={}, \
                 dtype='{}')",
                s.num_kv_heads,
                s.head_dim,
                s.dtype.name()
            ),
            GroupKind::MlaLatent { latent_dim, rope_dim, dtype } => format!(
                "KvGroup.mla_latent({layers}, latent_dim={latent_dim}, rope_dim={rope_dim}, \
                 dtype='{}')",
                dtype.name()
            ),
            GroupKind::RecurrentState { bytes_per_layer } => {
                format!("KvGroup.recurrent_state({layers}, bytes_per_layer={bytes_per_layer})")
            }
        }
    }
}

fn kind_name(kind: &GroupKind) -> &'static str {
    match kind {
        GroupKind::Full(_) => "full",
        GroupKind::SlidingWindow { .. } => "sliding_window",
        GroupKind::ChunkedLocal { .. } => "chunked_local",
        GroupKind::MlaLatent { .. } => "mla_latent",
        GroupKind::RecurrentState { .. } => "recurrent_state",
    }
}

/// The page size hybrid.md recommends for `groups`: 16 tokens (64 for an MLA group) of the
/// token group that needs the most bytes for them, rounded up to the block alignment (256
/// bytes), so every token group holds at least 16 tokens a page (64 for MLA) and a page of
/// the largest one is at least 15/16 full. A model of state groups only gets one layer's
/// state, rounded up alike, so each layer's state fills one page.
pub fn default_page_bytes(groups: &[KvGroup]) -> Result<usize, CoreError> {
    let overflow = || CoreError::InvalidLayout("the default page size overflows a usize".into());
    if groups.is_empty() {
        return Err(CoreError::InvalidLayout("a model needs at least one KV group".into()));
    }
    let mut largest = 0usize;
    for group in groups {
        let bytes = match group.kind {
            GroupKind::RecurrentState { bytes_per_layer } => {
                if groups.iter().any(|g| !matches!(g.kind, GroupKind::RecurrentState { .. })) {
                    continue; // the token groups set the page
                }
                bytes_per_layer
            }
            GroupKind::MlaLatent { .. } => group
                .token_bytes()
                .and_then(|b| b.checked_mul(DEFAULT_MLA_TOKENS_PER_PAGE))
                .ok_or_else(overflow)?,
            _ => group
                .token_bytes()
                .and_then(|b| b.checked_mul(DEFAULT_TOKENS_PER_PAGE))
                .ok_or_else(overflow)?,
        };
        largest = largest.max(bytes);
    }
    largest.checked_next_multiple_of(BLOCK_ALIGN_BYTES).filter(|&b| b > 0).ok_or_else(overflow)
}

/// A model's KV memory: groups that cover every layer once, over pages of `page_bytes`
/// (every page of every group, and every block of the pool, has that size).
///
/// `page_bytes=None` picks 16 tokens (64 for MLA) of the token group with the largest
/// token, rounded up to 256 bytes (see `default_page_bytes`). `num_layers` defaults to one
/// past the highest layer any group names; give it to have a missing last layer refused.
#[pyclass(module = "kvpool._core", name = "ModelKvSpec", frozen, eq)]
#[derive(Clone, PartialEq, Eq)]
pub struct PyModelKvSpec {
    pub inner: ModelKvSpec,
}

impl PyModelKvSpec {
    fn geometry(&self, group: Int) -> KvResult<(usize, &PageGeometry)> {
        let group = ids::count(group, "group")?;
        Ok((group, self.inner.geometry(group)?))
    }
}

#[pymethods]
impl PyModelKvSpec {
    #[new]
    #[pyo3(signature = (groups, page_bytes = None, *, num_layers = None))]
    fn new(
        groups: &Bound<'_, PyAny>,
        page_bytes: Option<Int>,
        num_layers: Option<Int>,
    ) -> PyResult<Self> {
        const WHAT: &str = "argument 'groups'";
        if ids::is_text(groups) {
            return Err(ids::wrong_type(WHAT, "an iterable of KvGroup", groups));
        }
        let iter = groups.try_iter().map_err(|e| {
            if e.is_instance_of::<pyo3::exceptions::PyTypeError>(groups.py()) {
                ids::wrong_type(WHAT, "an iterable of KvGroup", groups)
            } else {
                e
            }
        })?;
        let mut list = Vec::new();
        for (i, item) in iter.enumerate() {
            let item = item?;
            let group = item
                .cast::<PyKvGroup>()
                .map_err(|_| ids::wrong_type(&format!("{WHAT}: item {i}"), "a KvGroup", &item))?;
            list.push(group.get().inner.clone());
        }
        let num_layers = match num_layers {
            Some(n) => size(n, "num_layers")?,
            None => list.iter().flat_map(|g| g.layers.iter()).max().map_or(0, |&l| l + 1),
        };
        let page_bytes = match page_bytes {
            Some(b) => size(b, "page_bytes")?,
            None => default_page_bytes(&list).map_err(PyKvError)?,
        };
        Ok(PyModelKvSpec {
            inner: ModelKvSpec::new(num_layers, list, page_bytes).map_err(PyKvError)?,
        })
    }

    /// A uniform model: one full-attention group over every layer of `layout`, whose pages
    /// are exactly `layout`'s blocks.
    #[staticmethod]
    fn uniform(layout: PyRef<'_, PyKvLayout>) -> Self {
        PyModelKvSpec { inner: ModelKvSpec::uniform(&layout.inner) }
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }
    /// Bytes of every page of every group: the pool's block bytes.
    #[getter]
    fn page_bytes(&self) -> usize {
        self.inner.page_bytes()
    }
    #[getter]
    fn num_groups(&self) -> usize {
        self.inner.num_groups()
    }
    #[getter]
    fn groups(&self) -> Vec<PyKvGroup> {
        self.inner.groups().iter().map(|g| PyKvGroup { inner: g.clone() }).collect()
    }

    /// Tokens per page of group `group` (None for a state group).
    fn block_size(&self, group: Int) -> KvResult<Option<usize>> {
        Ok(self.geometry(group)?.1.block_size())
    }

    /// Pages per request of state group `group` (None for a token group).
    fn pages_per_slot(&self, group: Int) -> KvResult<Option<usize>> {
        Ok(match *self.geometry(group)?.1 {
            PageGeometry::State { pages_per_slot, .. } => Some(pages_per_slot),
            PageGeometry::Tokens { .. } => None,
        })
    }

    /// How a state group's slot holds its layers: `("layers_per_page", n)` (each layer whole
    /// in one page, `n` a page) or `("pages_per_layer", n)` (a layer split over `n` pages);
    /// None for a token group.
    fn state_packing(&self, group: Int) -> KvResult<Option<(&'static str, usize)>> {
        Ok(match *self.geometry(group)?.1 {
            PageGeometry::State { packing: StatePacking::LayersPerPage(n), .. } => {
                Some(("layers_per_page", n))
            }
            PageGeometry::State { packing: StatePacking::PagesPerLayer(n), .. } => {
                Some(("pages_per_layer", n))
            }
            PageGeometry::Tokens { .. } => None,
        })
    }

    /// Bytes of a page of group `group` that hold data (the rest is padding); for a state
    /// group, the bytes of its whole slot.
    fn used_bytes(&self, group: Int) -> KvResult<usize> {
        let (g, geometry) = self.geometry(group)?;
        Ok(geometry.used_bytes(self.inner.groups()[g].layers.len()))
    }

    /// `(group, index)`: the group holding model layer `layer`, and the layer's index in it.
    fn group_of_layer(&self, layer: Int) -> KvResult<(usize, usize)> {
        Ok(self.inner.group_of_layer(ids::count(layer, "layer")?)?)
    }

    /// `(start, stop)`: the page indices (page `k` holding tokens `k * block_size ..`) a
    /// request of `num_tokens` tokens keeps for group `group` while the queries from
    /// position `next_query` on are still to run. A state group keeps `(0, pages_per_slot)`.
    fn live_pages(&self, group: Int, num_tokens: Int, next_query: Int) -> KvResult<(usize, usize)> {
        let range = self.inner.live_pages(
            ids::count(group, "group")?,
            ids::count(num_tokens, "num_tokens")?,
            ids::count(next_query, "next_query")?,
        )?;
        Ok((range.start, range.end))
    }

    /// Pages a request of `num_tokens` tokens holds right after `HybridTables.add`: what
    /// admitting it costs.
    fn pages_to_add(&self, num_tokens: Int) -> KvResult<usize> {
        Ok(self.inner.pages_to_add(ids::count(num_tokens, "num_tokens")?))
    }

    /// Byte offset from the slab base of element `dim` of `kv_head` of `part` (`"k"` or
    /// `"v"`) of token `token` (inside the page) of the `layer`-th layer of attention group
    /// `group` in page `page_id`.
    #[allow(clippy::too_many_arguments)] // one per index of the element
    fn attention_offset_bytes(
        &self,
        group: Int,
        page_id: Int,
        layer: Int,
        part: &str,
        token: Int,
        kv_head: Int,
        dim: Int,
    ) -> KvResult<usize> {
        let part = match part {
            "k" | "K" => KvPart::K,
            "v" | "V" => KvPart::V,
            other => {
                return Err(CoreError::InvalidArgument(format!(
                    "part must be 'k' or 'v', got {other:?}"
                ))
                .into())
            }
        };
        Ok(self.inner.attention_offset_bytes(
            ids::count(group, "group")?,
            ids::count(page_id, "page_id")?,
            ids::count(layer, "layer")?,
            part,
            ids::count(token, "token")?,
            ids::count(kv_head, "kv_head")?,
            ids::count(dim, "dim")?,
        )?)
    }

    /// Byte offset from the slab base of element `dim` (latent, then rope) of token `token`
    /// of the `layer`-th layer of MLA group `group` in page `page_id`.
    fn latent_offset_bytes(
        &self,
        group: Int,
        page_id: Int,
        layer: Int,
        token: Int,
        dim: Int,
    ) -> KvResult<usize> {
        Ok(self.inner.latent_offset_bytes(
            ids::count(group, "group")?,
            ids::count(page_id, "page_id")?,
            ids::count(layer, "layer")?,
            ids::count(token, "token")?,
            ids::count(dim, "dim")?,
        )?)
    }

    /// `(slot_page, offset)`: where byte `byte` of the `layer`-th layer's state of state group
    /// `group` lies, as an index into the request's `state_slot` and a byte offset in it.
    fn state_location(&self, group: Int, layer: Int, byte: Int) -> KvResult<(usize, usize)> {
        Ok(self.inner.state_location(
            ids::count(group, "group")?,
            ids::count(layer, "layer")?,
            ids::count(byte, "byte")?,
        )?)
    }

    fn __repr__(&self) -> String {
        let groups: Vec<String> =
            self.inner.groups().iter().map(|g| PyKvGroup { inner: g.clone() }.__repr__()).collect();
        format!(
            "ModelKvSpec([{}], page_bytes={}, num_layers={})",
            groups.join(", "),
            self.inner.page_bytes(),
            self.inner.num_layers()
        )
    }
}
