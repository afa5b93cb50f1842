//! `KvLayout`: the geometry of one KV block, and the only place its strides are computed.
//!
//! A block holds all layers of `block_size` tokens, block-major:
//! `[block][layer][K|V][token][kv_head][head_dim]` (NHD inside a layer). One block is one
//! contiguous region, so a per-layer K or V view is the strided tensor
//! `[num_blocks, block_size, num_kv_heads, head_dim]` with strides
//! `[block_bytes, token_stride, head_stride, elem_bytes]`.

use crate::error::CoreError;

/// Block sizes must be a multiple of this so every block starts 256-byte aligned
/// (what 16-byte vector loads and the CUDA allocator's alignment need, with room to spare).
pub const BLOCK_ALIGN_BYTES: usize = 256;

/// Element type of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    Float16,
    BFloat16,
    Float32,
    Float8E4M3,
    Float8E5M2,
}

impl DType {
    pub const ALL: [DType; 5] =
        [DType::Float16, DType::BFloat16, DType::Float32, DType::Float8E4M3, DType::Float8E5M2];

    pub fn size_bytes(self) -> usize {
        match self {
            DType::Float16 | DType::BFloat16 => 2,
            DType::Float32 => 4,
            DType::Float8E4M3 | DType::Float8E5M2 => 1,
        }
    }

    /// The canonical name (PyTorch's spelling).
    pub fn name(self) -> &'static str {
        match self {
            DType::Float16 => "float16",
            DType::BFloat16 => "bfloat16",
            DType::Float32 => "float32",
            DType::Float8E4M3 => "float8_e4m3fn",
            DType::Float8E5M2 => "float8_e5m2",
        }
    }

    /// Accepts the canonical names and the common aliases.
    pub fn parse(name: &str) -> Result<DType, CoreError> {
        match name.to_ascii_lowercase().as_str() {
            "float16" | "fp16" | "half" | "f2" | "<f2" => Ok(DType::Float16),
            "bfloat16" | "bf16" => Ok(DType::BFloat16),
            "float32" | "fp32" | "float" | "f4" | "<f4" => Ok(DType::Float32),
            "float8_e4m3fn" | "float8_e4m3" | "fp8_e4m3" | "e4m3" | "fp8" => Ok(DType::Float8E4M3),
            "float8_e5m2" | "fp8_e5m2" | "e5m2" => Ok(DType::Float8E5M2),
            _ => Err(CoreError::InvalidLayout(format!(
                "unsupported dtype {name:?}; supported: float16, bfloat16, float32, float8_e4m3fn, \
                 float8_e5m2"
            ))),
        }
    }
}

/// Geometry of a KV block. Construct with [`KvLayout::new`], which validates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    num_layers: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    dtype: DType,
}

/// Which half of a layer's block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvPart {
    K = 0,
    V = 1,
}

impl KvLayout {
    pub fn new(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        dtype: DType,
    ) -> Result<Self, CoreError> {
        for (name, value) in [
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
        ] {
            if value == 0 {
                return Err(CoreError::InvalidLayout(format!("{name} must be positive, got 0")));
            }
        }
        let block_bytes = [num_layers, 2, block_size, num_kv_heads, head_dim, dtype.size_bytes()]
            .iter()
            .try_fold(1usize, |acc, &x| acc.checked_mul(x))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                CoreError::InvalidLayout("block_bytes overflows the address space".into())
            })?;
        if block_bytes % BLOCK_ALIGN_BYTES != 0 {
            return Err(CoreError::InvalidLayout(format!(
                "block_bytes = {block_bytes} (num_layers {num_layers} x 2 x block_size {block_size} x \
                 num_kv_heads {num_kv_heads} x head_dim {head_dim} x {} bytes) is not a multiple of \
                 {BLOCK_ALIGN_BYTES}",
                dtype.size_bytes()
            )));
        }
        Ok(KvLayout { num_layers, num_kv_heads, head_dim, block_size, dtype })
    }

    pub fn num_layers(&self) -> usize {
        self.num_layers
    }
    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn elem_bytes(&self) -> usize {
        self.dtype.size_bytes()
    }

    /// Bytes between consecutive head_dim vectors of one token.
    pub fn head_stride_bytes(&self) -> usize {
        self.head_dim * self.elem_bytes()
    }
    /// Bytes between consecutive tokens of one layer's K (or V).
    pub fn token_stride_bytes(&self) -> usize {
        self.num_kv_heads * self.head_stride_bytes()
    }
    /// Bytes from a layer's K to its V inside a block.
    pub fn kv_stride_bytes(&self) -> usize {
        self.block_size * self.token_stride_bytes()
    }
    /// Bytes between consecutive layers inside a block.
    pub fn layer_stride_bytes(&self) -> usize {
        2 * self.kv_stride_bytes()
    }
    /// Bytes of one block (all layers, K and V): also the stride between blocks.
    pub fn block_bytes(&self) -> usize {
        self.num_layers * self.layer_stride_bytes()
    }

    /// The layout of one rank's shard under tensor parallelism over `tp_size` ranks, as vLLM
    /// shards KV heads: `num_kv_heads / tp_size` heads per rank when `tp_size` divides
    /// `num_kv_heads`; one head per rank when `num_kv_heads` divides `tp_size` (each head is
    /// then replicated on `tp_size / num_kv_heads` ranks, as for MQA/GQA models with more
    /// ranks than KV heads). Any other pair is refused, naming both numbers.
    pub fn tp_shard(&self, tp_size: usize) -> Result<KvLayout, CoreError> {
        let heads = self.tp_heads_per_rank(tp_size)?;
        KvLayout::new(self.num_layers, heads, self.head_dim, self.block_size, self.dtype).map_err(
            |e| match e {
                CoreError::InvalidLayout(m) => CoreError::InvalidLayout(format!(
                    "the shard of {} KV heads over {tp_size} ranks: {m}",
                    self.num_kv_heads
                )),
                e => e,
            },
        )
    }

    /// The KV heads of this (unsharded) layout that rank `rank` of `tp_size` holds, as a
    /// range `first..first + count` (see [`tp_shard`](Self::tp_shard)).
    pub fn tp_head_range(
        &self,
        tp_size: usize,
        rank: usize,
    ) -> Result<std::ops::Range<usize>, CoreError> {
        let heads = self.tp_heads_per_rank(tp_size)?;
        if rank >= tp_size {
            return Err(CoreError::InvalidArgument(format!(
                "rank {rank} is out of range for tp_size {tp_size}"
            )));
        }
        let first = if tp_size <= self.num_kv_heads {
            rank * heads
        } else {
            rank / (tp_size / self.num_kv_heads)
        };
        Ok(first..first + heads)
    }

    fn tp_heads_per_rank(&self, tp_size: usize) -> Result<usize, CoreError> {
        let h = self.num_kv_heads;
        if tp_size == 0 {
            return Err(CoreError::InvalidArgument("tp_size must be positive, got 0".into()));
        }
        if h % tp_size == 0 {
            Ok(h / tp_size)
        } else if tp_size % h == 0 {
            Ok(1)
        } else {
            Err(CoreError::InvalidLayout(format!(
                "num_kv_heads {h} cannot be sharded over tp_size {tp_size}: one must divide the other \
                 ({h} % {tp_size} = {}, {tp_size} % {h} = {})",
                h % tp_size,
                tp_size % h
            )))
        }
    }

    /// Byte offset of `(layer, part)` inside any block.
    pub fn part_offset_bytes(&self, layer: usize, part: KvPart) -> Result<usize, CoreError> {
        if layer >= self.num_layers {
            return Err(CoreError::InvalidArgument(format!(
                "layer {layer} is out of range, the layout has {} layers",
                self.num_layers
            )));
        }
        Ok(layer * self.layer_stride_bytes() + part as usize * self.kv_stride_bytes())
    }

    /// Byte offset of one element from the slab base.
    pub fn element_offset_bytes(
        &self,
        block_id: usize,
        layer: usize,
        part: KvPart,
        token: usize,
        kv_head: usize,
        dim: usize,
    ) -> usize {
        block_id * self.block_bytes()
            + layer * self.layer_stride_bytes()
            + part as usize * self.kv_stride_bytes()
            + token * self.token_stride_bytes()
            + kv_head * self.head_stride_bytes()
            + dim * self.elem_bytes()
    }

    /// Shape and byte strides of the per-layer K or V view over `num_blocks` blocks:
    /// `[num_blocks, block_size, num_kv_heads, head_dim]`.
    pub fn view_shape_strides(&self, num_blocks: usize) -> ([usize; 4], [usize; 4]) {
        (
            [num_blocks, self.block_size, self.num_kv_heads, self.head_dim],
            [
                self.block_bytes(),
                self.token_stride_bytes(),
                self.head_stride_bytes(),
                self.elem_bytes(),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama8b() -> KvLayout {
        KvLayout::new(32, 8, 128, 16, DType::Float16).unwrap()
    }

    #[test]
    fn strides_follow_block_major_nhd() {
        let l = llama8b();
        assert_eq!(l.head_stride_bytes(), 256);
        assert_eq!(l.token_stride_bytes(), 8 * 256);
        assert_eq!(l.kv_stride_bytes(), 16 * 8 * 256);
        assert_eq!(l.layer_stride_bytes(), 2 * 16 * 8 * 256);
        assert_eq!(l.block_bytes(), 32 * 2 * 16 * 8 * 128 * 2);
        // The last element of a block is one element before the next block starts.
        let last = l.element_offset_bytes(0, 31, KvPart::V, 15, 7, 127);
        assert_eq!(last + l.elem_bytes(), l.block_bytes());
        assert_eq!(l.element_offset_bytes(3, 0, KvPart::K, 0, 0, 0), 3 * l.block_bytes());
    }

    #[test]
    fn rejects_zero_sizes_and_misaligned_blocks() {
        assert!(
            matches!(KvLayout::new(0, 8, 128, 16, DType::Float16), Err(CoreError::InvalidLayout(m)) if m.contains("num_layers"))
        );
        assert!(
            matches!(KvLayout::new(1, 1, 8, 1, DType::Float16), Err(CoreError::InvalidLayout(m)) if m.contains("multiple of 256"))
        );
        assert!(KvLayout::new(usize::MAX, 8, 128, 16, DType::Float16).is_err());
    }

    #[test]
    fn dtype_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::parse(d.name()).unwrap(), d);
        }
        assert!(DType::parse("int8").is_err());
    }

    #[test]
    fn tp_shards_split_or_replicate_heads() {
        let l = llama8b();
        let s = l.tp_shard(2).unwrap();
        assert_eq!((s.num_kv_heads(), s.block_bytes() * 2), (4, l.block_bytes()));
        assert_eq!(l.tp_head_range(2, 1).unwrap(), 4..8);
        // 16 ranks over 8 heads: each head on two ranks.
        assert_eq!(l.tp_shard(16).unwrap().num_kv_heads(), 1);
        assert_eq!(l.tp_head_range(16, 5).unwrap(), 2..3);
        assert_eq!(l.tp_head_range(8, 7).unwrap(), 7..8);
        assert!(l.tp_head_range(2, 2).is_err());
        assert!(
            matches!(l.tp_shard(3), Err(CoreError::InvalidLayout(m)) if m.contains("num_kv_heads 8") && m.contains("tp_size 3"))
        );
        assert!(matches!(l.tp_shard(12), Err(CoreError::InvalidLayout(_))));
        assert!(l.tp_shard(0).is_err());
    }

    #[test]
    fn part_offset_checks_layer() {
        let l = llama8b();
        assert_eq!(
            l.part_offset_bytes(1, KvPart::V).unwrap(),
            l.layer_stride_bytes() + l.kv_stride_bytes()
        );
        assert!(l.part_offset_bytes(32, KvPart::K).is_err());
    }
}
