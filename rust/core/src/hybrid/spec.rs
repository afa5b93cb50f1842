//! `ModelKvSpec`: a model's KV memory as a list of groups sharing one page size, validated
//! once, with each group's geometry inside a page (see `hybrid.md`).

use std::ops::Range;

use crate::error::CoreError;
use crate::layout::{DType, KvLayout, KvPart, BLOCK_ALIGN_BYTES};

/// The per-token shape of an attention group: K and V of `num_kv_heads` heads per layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionShape {
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: DType,
}

/// What a group's layers keep per request, and for which tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupKind {
    /// Every token, for every later query.
    Full(AttentionShape),
    /// The query at position `p` sees the keys at `p - window + 1 ..= p`.
    SlidingWindow { window: usize, shape: AttentionShape },
    /// The query at position `p` sees the keys from the start of its chunk,
    /// `p / chunk * chunk ..= p`.
    ChunkedLocal { chunk: usize, shape: AttentionShape },
    /// Every token, as one latent vector of `latent_dim + rope_dim` elements per layer
    /// (no per-head K and V).
    MlaLatent { latent_dim: usize, rope_dim: usize, dtype: DType },
    /// No tokens: a fixed `bytes_per_layer` of recurrent state per request and layer.
    RecurrentState { bytes_per_layer: usize },
}

impl GroupKind {
    fn describe(&self) -> String {
        match self {
            GroupKind::Full(_) => "full attention".into(),
            GroupKind::SlidingWindow { window, .. } => format!("sliding window {window}"),
            GroupKind::ChunkedLocal { chunk, .. } => format!("chunked local {chunk}"),
            GroupKind::MlaLatent { latent_dim, rope_dim, .. } => {
                format!("MLA latent {latent_dim}+{rope_dim}")
            }
            GroupKind::RecurrentState { bytes_per_layer } => {
                format!("recurrent state of {bytes_per_layer} bytes per layer")
            }
        }
    }
}

/// Some layers of a model and what they keep.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvGroup {
    /// Model layer indices, in the order the group's pages hold them.
    pub layers: Vec<usize>,
    pub kind: GroupKind,
}

impl KvGroup {
    pub fn new(layers: Vec<usize>, kind: GroupKind) -> Self {
        KvGroup { layers, kind }
    }

    /// Bytes of one token over all the group's layers (`None` for a state group, or on
    /// overflow). A page of `page_bytes` holds `page_bytes / token_bytes` of its tokens.
    pub fn token_bytes(&self) -> Option<usize> {
        token_bytes_per_layer(&self.kind)?.checked_mul(self.layers.len())
    }
}

fn token_bytes_per_layer(kind: &GroupKind) -> Option<usize> {
    match kind {
        GroupKind::Full(shape)
        | GroupKind::SlidingWindow { shape, .. }
        | GroupKind::ChunkedLocal { shape, .. } => shape
            .num_kv_heads
            .checked_mul(shape.head_dim)?
            .checked_mul(2 * shape.dtype.size_bytes()),
        GroupKind::MlaLatent { latent_dim, rope_dim, dtype } => {
            latent_dim.checked_add(*rope_dim)?.checked_mul(dtype.size_bytes())
        }
        GroupKind::RecurrentState { .. } => None,
    }
}

/// Where a group's data sits inside its pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageGeometry {
    /// `[page][layer][K|V][token][kv_head][head_dim]` for attention groups and
    /// `[page][layer][token][latent | rope]` for MLA: `block_size` tokens of every layer of
    /// the group; the `page_bytes - block_size * token_bytes` after them are padding.
    Tokens {
        block_size: usize,
        /// Bytes of one token of one layer (both K and V for attention).
        token_bytes_per_layer: usize,
    },
    /// One state per request in `pages_per_slot` pages, packed as `packing` says.
    State { bytes_per_layer: usize, packing: StatePacking, pages_per_slot: usize },
}

/// How a state slot's pages hold its layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatePacking {
    /// A layer's state fits a page: page `i` of a slot holds layers `i * n ..` whole, one
    /// after the other.
    LayersPerPage(usize),
    /// A layer's state is split at page boundaries over slot pages `l * n .. (l + 1) * n`.
    PagesPerLayer(usize),
}

/// A model's KV memory: groups that cover every layer once, over pages of `page_bytes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelKvSpec {
    num_layers: usize,
    page_bytes: usize,
    groups: Vec<KvGroup>,
    geometry: Vec<PageGeometry>,
    /// Per group, what [`live_pages`](Self::live_pages) computes from, derived from
    /// `groups` and `geometry` once: a decode step asks it for every group of every request.
    live_rules: Vec<LiveRule>,
}

/// A divisor fixed when the spec is made (tokens per page, a chunk): a power of two (the
/// usual page size) divides by a shift, any other by the hardware division it replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Divisor {
    value: usize,
    /// `log2(value)` when `value` is a power of two.
    shift: Option<u32>,
}

impl Divisor {
    /// `value` must be positive (the spec checked it).
    fn new(value: usize) -> Self {
        debug_assert!(value > 0);
        Divisor { value, shift: value.is_power_of_two().then(|| value.trailing_zeros()) }
    }

    #[inline]
    pub(super) fn value(self) -> usize {
        self.value
    }

    #[inline]
    pub(super) fn div(self, n: usize) -> usize {
        match self.shift {
            Some(shift) => n >> shift,
            None => n / self.value,
        }
    }

    #[inline]
    pub(super) fn rem(self, n: usize) -> usize {
        match self.shift {
            Some(_) => n & (self.value - 1),
            None => n % self.value,
        }
    }

    #[inline]
    fn div_ceil(self, n: usize) -> usize {
        self.div(n) + (self.rem(n) != 0) as usize
    }
}

/// A group's [`live_pages`](ModelKvSpec::live_pages) rule: its kind and geometry, reduced
/// to what the rule reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LiveRule {
    /// A state group keeps its slot, `0..pages_per_slot`.
    State { pages_per_slot: usize },
    /// A token group of `block_size` tokens a page, whose queries see the keys `sees` says.
    Tokens { block_size: Divisor, sees: Lookback },
}

/// Which earlier keys a token group's queries see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lookback {
    /// Every key (full attention, MLA).
    All,
    /// The last `window` keys, the query's own included.
    Window(usize),
    /// The keys from the start of the query's chunk.
    Chunk(Divisor),
}

impl LiveRule {
    fn new(kind: &GroupKind, geometry: &PageGeometry) -> Self {
        match *geometry {
            PageGeometry::State { pages_per_slot, .. } => LiveRule::State { pages_per_slot },
            PageGeometry::Tokens { block_size, .. } => LiveRule::Tokens {
                block_size: Divisor::new(block_size),
                sees: match *kind {
                    GroupKind::SlidingWindow { window, .. } => Lookback::Window(window),
                    GroupKind::ChunkedLocal { chunk, .. } => Lookback::Chunk(Divisor::new(chunk)),
                    _ => Lookback::All,
                },
            },
        }
    }

    /// [`ModelKvSpec::live_pages`] of this group.
    #[inline]
    pub(super) fn live_pages(self, num_tokens: usize, next_query: usize) -> Range<usize> {
        match self {
            LiveRule::State { pages_per_slot } => 0..pages_per_slot,
            LiveRule::Tokens { block_size, sees } => {
                // The first token any query at `next_query` or later can see.
                let first_live = match sees {
                    Lookback::All => 0,
                    Lookback::Window(window) => next_query.saturating_add(1).saturating_sub(window),
                    Lookback::Chunk(chunk) => next_query - chunk.rem(next_query),
                };
                if first_live >= num_tokens {
                    let at = block_size.div(num_tokens);
                    return at..at;
                }
                block_size.div(first_live)..block_size.div_ceil(num_tokens)
            }
        }
    }
}

fn invalid(message: String) -> CoreError {
    CoreError::InvalidLayout(message)
}

/// `Ok` when `index < bound`, else an `InvalidArgument` with the message `describe` gives.
fn check_index(
    index: usize,
    bound: usize,
    describe: impl FnOnce() -> String,
) -> Result<(), CoreError> {
    if index < bound {
        Ok(())
    } else {
        Err(CoreError::InvalidArgument(describe()))
    }
}

impl ModelKvSpec {
    /// Validates `groups` against `num_layers` layers and pages of `page_bytes` (a multiple
    /// of 256, like every block). Each token group gets `page_bytes / token_bytes` tokens
    /// per page; each state group a whole number of pages per request.
    pub fn new(
        num_layers: usize,
        groups: Vec<KvGroup>,
        page_bytes: usize,
    ) -> Result<Self, CoreError> {
        if page_bytes == 0 || page_bytes % BLOCK_ALIGN_BYTES != 0 {
            return Err(invalid(format!(
                "page_bytes must be a positive multiple of {BLOCK_ALIGN_BYTES}, got {page_bytes}"
            )));
        }
        if groups.is_empty() {
            return Err(invalid("a model needs at least one KV group".into()));
        }
        check_layer_cover(num_layers, &groups)?;
        let geometry = groups
            .iter()
            .enumerate()
            .map(|(index, group)| {
                check_kind(&group.kind)
                    .and_then(|()| group_geometry(group, page_bytes))
                    .map_err(|m| invalid(format!("group {index} ({}): {m}", group.kind.describe())))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let live_rules =
            groups.iter().zip(&geometry).map(|(g, geo)| LiveRule::new(&g.kind, geo)).collect();
        Ok(ModelKvSpec { num_layers, page_bytes, groups, geometry, live_rules })
    }

    /// A uniform model: one full-attention group over every layer of `layout`, whose pages
    /// are exactly `layout`'s blocks (same bytes, same strides, same tokens per block).
    pub fn uniform(layout: &KvLayout) -> Self {
        let shape = AttentionShape {
            num_kv_heads: layout.num_kv_heads(),
            head_dim: layout.head_dim(),
            dtype: layout.dtype(),
        };
        let group = KvGroup::new((0..layout.num_layers()).collect(), GroupKind::Full(shape));
        Self::new(layout.num_layers(), vec![group], layout.block_bytes())
            .expect("a valid KvLayout is a valid one-group model")
    }

    pub fn num_layers(&self) -> usize {
        self.num_layers
    }
    /// Bytes of every page of every group: the pool's block bytes.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }
    pub fn groups(&self) -> &[KvGroup] {
        &self.groups
    }

    /// Group `group`, or an error naming how many groups the model has.
    pub fn group(&self, group: usize) -> Result<&KvGroup, CoreError> {
        self.groups.get(group).ok_or_else(|| self.no_such_group(group))
    }

    pub fn geometry(&self, group: usize) -> Result<&PageGeometry, CoreError> {
        self.geometry.get(group).ok_or_else(|| self.no_such_group(group))
    }

    fn no_such_group(&self, group: usize) -> CoreError {
        CoreError::InvalidArgument(format!(
            "group {group} does not exist: the model has {} groups (0..{})",
            self.groups.len(),
            self.groups.len()
        ))
    }

    /// The group holding model layer `layer` and its index inside that group.
    pub fn group_of_layer(&self, layer: usize) -> Result<(usize, usize), CoreError> {
        self.groups
            .iter()
            .enumerate()
            .find_map(|(g, group)| group.layers.iter().position(|&l| l == layer).map(|i| (g, i)))
            .ok_or_else(|| {
                CoreError::InvalidArgument(format!(
                    "layer {layer} is out of range, the model has {} layers",
                    self.num_layers
                ))
            })
    }

    /// The pages (indices in the group's page sequence, page `k` holding tokens
    /// `k * block_size ..`) that a request of `num_tokens` tokens keeps for group `group`
    /// while the queries from position `next_query` on are still to run: those holding a
    /// token some such query sees. A state group keeps its slot, `0..pages_per_slot`.
    pub fn live_pages(
        &self,
        group: usize,
        num_tokens: usize,
        next_query: usize,
    ) -> Result<Range<usize>, CoreError> {
        let rule = self.live_rules.get(group).ok_or_else(|| self.no_such_group(group))?;
        Ok(rule.live_pages(num_tokens, next_query))
    }

    /// Every group's [`live_pages`](Self::live_pages) rule, in group order.
    pub(super) fn live_rules(&self) -> &[LiveRule] {
        &self.live_rules
    }

    /// The number of pages a request of `num_tokens` tokens holds right after it is added
    /// (all its tokens' queries still to run): what admitting it costs (saturating).
    pub fn pages_to_add(&self, num_tokens: usize) -> usize {
        (0..self.groups.len())
            .map(|g| self.live_pages(g, num_tokens, 0).map_or(0, |r| r.len()))
            .fold(0, usize::saturating_add)
    }
}

/// Every layer `0..num_layers` in exactly one group. Sorts the listed layers rather than
/// sizing anything by `num_layers`, which the caller gives.
fn check_layer_cover(num_layers: usize, groups: &[KvGroup]) -> Result<(), CoreError> {
    if num_layers == 0 {
        return Err(invalid("num_layers must be positive, got 0".into()));
    }
    for (g, group) in groups.iter().enumerate() {
        if group.layers.is_empty() {
            return Err(invalid(format!("group {g} ({}) has no layers", group.kind.describe())));
        }
        if let Some(&layer) = group.layers.iter().find(|&&l| l >= num_layers) {
            return Err(invalid(format!(
                "group {g} names layer {layer}, but the model has {num_layers} layers (0..{num_layers})"
            )));
        }
    }
    let mut listed: Vec<(usize, usize)> = groups
        .iter()
        .enumerate()
        .flat_map(|(g, group)| group.layers.iter().map(move |&layer| (layer, g)))
        .collect();
    listed.sort_unstable();
    if let Some(w) = listed.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(invalid(format!(
            "layer {} is in group {} and in group {}",
            w[0].0, w[0].1, w[1].1
        )));
    }
    // Sorted and without repeats: layer i is at position i unless some layer below is missing.
    let missing = listed.iter().enumerate().find(|&(i, &(layer, _))| layer != i).map(|(i, _)| i);
    match missing.or((listed.len() < num_layers).then_some(listed.len())) {
        Some(layer) => Err(invalid(format!("layer {layer} is in no group"))),
        None => Ok(()),
    }
}

fn check_kind(kind: &GroupKind) -> Result<(), String> {
    let positive = |name: &str, value: usize| {
        if value == 0 {
            Err(format!("{name} must be positive, got 0"))
        } else {
            Ok(())
        }
    };
    match *kind {
        GroupKind::Full(shape) => check_shape(shape),
        GroupKind::SlidingWindow { window, shape } => {
            positive("window", window).and_then(|()| check_shape(shape))
        }
        GroupKind::ChunkedLocal { chunk, shape } => {
            positive("chunk", chunk).and_then(|()| check_shape(shape))
        }
        GroupKind::MlaLatent { latent_dim, .. } => positive("latent_dim", latent_dim),
        GroupKind::RecurrentState { bytes_per_layer } => {
            positive("bytes_per_layer", bytes_per_layer)
        }
    }
}

fn check_shape(shape: AttentionShape) -> Result<(), String> {
    for (name, value) in [("num_kv_heads", shape.num_kv_heads), ("head_dim", shape.head_dim)] {
        if value == 0 {
            return Err(format!("{name} must be positive, got 0"));
        }
    }
    Ok(())
}

fn group_geometry(group: &KvGroup, page_bytes: usize) -> Result<PageGeometry, String> {
    let num_layers = group.layers.len();
    if let GroupKind::RecurrentState { bytes_per_layer } = group.kind {
        let (packing, pages_per_slot) = if bytes_per_layer <= page_bytes {
            let layers_per_page = page_bytes / bytes_per_layer;
            (StatePacking::LayersPerPage(layers_per_page), num_layers.div_ceil(layers_per_page))
        } else {
            let pages_per_layer = bytes_per_layer.div_ceil(page_bytes);
            let pages = pages_per_layer.checked_mul(num_layers).ok_or("the state overflows")?;
            (StatePacking::PagesPerLayer(pages_per_layer), pages)
        };
        return Ok(PageGeometry::State { bytes_per_layer, packing, pages_per_slot });
    }
    let per_layer = token_bytes_per_layer(&group.kind).ok_or("one token's bytes overflow")?;
    let token_bytes = group.token_bytes().ok_or("one token's bytes overflow")?;
    if token_bytes > page_bytes {
        return Err(format!(
            "one token of its {num_layers} layers takes {token_bytes} bytes, more than a page of \
             {page_bytes} bytes; split the group or use larger pages"
        ));
    }
    Ok(PageGeometry::Tokens {
        block_size: page_bytes / token_bytes,
        token_bytes_per_layer: per_layer,
    })
}

impl PageGeometry {
    /// Tokens per page (`None` for a state group).
    pub fn block_size(&self) -> Option<usize> {
        match *self {
            PageGeometry::Tokens { block_size, .. } => Some(block_size),
            PageGeometry::State { .. } => None,
        }
    }

    /// Bytes of a page that hold data (the rest is padding), over all of a slot's pages for
    /// a state group.
    pub fn used_bytes(&self, num_layers: usize) -> usize {
        match *self {
            PageGeometry::Tokens { block_size, token_bytes_per_layer } => {
                block_size * token_bytes_per_layer * num_layers
            }
            PageGeometry::State { bytes_per_layer, .. } => bytes_per_layer * num_layers,
        }
    }
}

/// Where the bytes of one element live: the formulas a kernel applies to a page id.
impl ModelKvSpec {
    /// Byte offset from the slab base of element `dim` (`< head_dim`) of `kv_head`
    /// (`< num_kv_heads`) of `part` of token `token` (`< block_size`) of the `layer`-th
    /// layer of attention group `group`, in page `page_id`:
    /// [`KvLayout::element_offset_bytes`] with the group's tokens per page and the page
    /// stride `page_bytes`. Each index past its bound is an error (it would address another
    /// token, head or layer), and so is a page whose offset does not fit a `usize`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_offset_bytes(
        &self,
        group: usize,
        page_id: usize,
        layer: usize,
        part: KvPart,
        token: usize,
        kv_head: usize,
        dim: usize,
    ) -> Result<usize, CoreError> {
        let shape = match self.group(group)?.kind {
            GroupKind::Full(shape)
            | GroupKind::SlidingWindow { shape, .. }
            | GroupKind::ChunkedLocal { shape, .. } => shape,
            kind => {
                return Err(CoreError::InvalidArgument(format!(
                    "group {group} ({}) has no K and V heads",
                    kind.describe()
                )))
            }
        };
        let block_size = self.check_token_index(group, layer, token)?;
        check_index(kv_head, shape.num_kv_heads, || {
            format!(
                "kv_head {kv_head} is out of range, group {group} has {} KV heads",
                shape.num_kv_heads
            )
        })?;
        check_index(dim, shape.head_dim, || {
            format!("dim {dim} is out of range, group {group} has head_dim {}", shape.head_dim)
        })?;
        // With every index in range the offset inside the page is below `used_bytes`, which
        // is at most `page_bytes`: only the page's own offset can overflow.
        let elem = shape.dtype.size_bytes();
        let head_stride = shape.head_dim * elem;
        let token_stride = shape.num_kv_heads * head_stride;
        let kv_stride = block_size * token_stride;
        let in_page = layer * 2 * kv_stride
            + part as usize * kv_stride
            + token * token_stride
            + kv_head * head_stride
            + dim * elem;
        self.page_offset(page_id, in_page)
    }

    /// Byte offset from the slab base of element `dim` (latent first, then rope, so
    /// `< latent_dim + rope_dim`) of token `token` (`< block_size`) of the `layer`-th layer of
    /// MLA group `group`, in page `page_id`: `[page][layer][token][latent | rope]`. Each
    /// index past its bound is an error, and so is a page whose offset does not fit a `usize`.
    pub fn latent_offset_bytes(
        &self,
        group: usize,
        page_id: usize,
        layer: usize,
        token: usize,
        dim: usize,
    ) -> Result<usize, CoreError> {
        let GroupKind::MlaLatent { latent_dim, rope_dim, dtype } = self.group(group)?.kind else {
            return Err(CoreError::InvalidArgument(format!(
                "group {group} ({}) is not an MLA latent group",
                self.groups[group].kind.describe()
            )));
        };
        let block_size = self.check_token_index(group, layer, token)?;
        // `ModelKvSpec::new` checked that one token's bytes fit a page, so this sum does not
        // overflow; as above, neither does the offset inside the page.
        let token_dim = latent_dim + rope_dim;
        check_index(dim, token_dim, || {
            format!(
                "dim {dim} is out of range, group {group} has {latent_dim} + {rope_dim} \
                 (latent_dim + rope_dim) elements per token"
            )
        })?;
        let token_stride = token_dim * dtype.size_bytes();
        let in_page =
            layer * block_size * token_stride + token * token_stride + dim * dtype.size_bytes();
        self.page_offset(page_id, in_page)
    }

    /// `page_id * page_bytes + in_page`, or an error where that does not fit a `usize`.
    fn page_offset(&self, page_id: usize, in_page: usize) -> Result<usize, CoreError> {
        page_id.checked_mul(self.page_bytes).and_then(|base| base.checked_add(in_page)).ok_or_else(
            || {
                CoreError::InvalidArgument(format!(
                    "page_id {page_id} is out of range: its offset of {page_id} pages of {} bytes \
                     does not fit a usize",
                    self.page_bytes
                ))
            },
        )
    }

    /// Where byte `byte` of the `layer`-th layer's state of state group `group` lies: the
    /// index of the page in the request's slot, and the offset inside that page.
    pub fn state_location(
        &self,
        group: usize,
        layer: usize,
        byte: usize,
    ) -> Result<(usize, usize), CoreError> {
        let PageGeometry::State { bytes_per_layer, packing, .. } = *self.geometry(group)? else {
            return Err(CoreError::InvalidArgument(format!(
                "group {group} ({}) holds tokens, not a state",
                self.groups[group].kind.describe()
            )));
        };
        self.check_layer_index(group, layer)?;
        if byte >= bytes_per_layer {
            return Err(CoreError::InvalidArgument(format!(
                "byte {byte} is past the {bytes_per_layer} bytes of a layer's state"
            )));
        }
        Ok(match packing {
            StatePacking::LayersPerPage(n) => (layer / n, layer % n * bytes_per_layer + byte),
            StatePacking::PagesPerLayer(n) => {
                (layer * n + byte / self.page_bytes, byte % self.page_bytes)
            }
        })
    }

    /// Checks the layer index and the token (inside its page) of token group `group`, and
    /// returns the group's tokens per page.
    fn check_token_index(
        &self,
        group: usize,
        layer: usize,
        token: usize,
    ) -> Result<usize, CoreError> {
        self.check_layer_index(group, layer)?;
        let block_size = self.geometry[group].block_size().expect("token groups have a block size");
        check_index(token, block_size, || {
            format!(
                "token {token} is out of range, group {group} holds {block_size} tokens per page"
            )
        })?;
        Ok(block_size)
    }

    fn check_layer_index(&self, group: usize, layer: usize) -> Result<(), CoreError> {
        let num_layers = self.groups[group].layers.len();
        if layer >= num_layers {
            return Err(CoreError::InvalidArgument(format!(
                "layer index {layer} is out of range, group {group} has {num_layers} layers"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_divisor_divides_like_the_hardware_division() {
        let divisors = (1..=70).chain([1 << 10, 1000, 8192, 1 << 40, usize::MAX]);
        let large = [1 << 40, (1 << 40) + 7, usize::MAX / 3, usize::MAX - 1, usize::MAX];
        for d in divisors {
            let divisor = Divisor::new(d);
            for n in (0..300).chain(large) {
                assert_eq!(divisor.div(n), n / d, "{n} / {d}");
                assert_eq!(divisor.rem(n), n % d, "{n} % {d}");
                assert_eq!(divisor.div_ceil(n), n.div_ceil(d), "{n} / {d} rounded up");
            }
        }
    }
}
