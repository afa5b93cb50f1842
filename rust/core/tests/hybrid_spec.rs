//! `ModelKvSpec`: validation with errors that name what is wrong, a uniform model's page
//! byte for byte a `KvLayout` block, the geometry of the published models that
//! `hybrid/hybrid.md` quotes, and the element offsets of attention, MLA and state groups,
//! each index checked against its bound.

use kvpool_core::hybrid::{
    AttentionShape, GroupKind, KvGroup, ModelKvSpec, PageGeometry, StatePacking,
};
use kvpool_core::layout::KvPart;
use kvpool_core::{CoreError, DType, KvLayout};

fn attention(num_kv_heads: usize, head_dim: usize) -> AttentionShape {
    AttentionShape { num_kv_heads, head_dim, dtype: DType::BFloat16 }
}

fn layers_where(num_layers: usize, keep: impl Fn(usize) -> bool) -> Vec<usize> {
    (0..num_layers).filter(|&l| keep(l)).collect()
}

fn invalid_message(result: Result<ModelKvSpec, CoreError>) -> String {
    match result {
        Err(CoreError::InvalidLayout(message)) => message,
        other => panic!("expected InvalidLayout, got {other:?}"),
    }
}

#[test]
fn a_uniform_model_is_one_full_group_whose_pages_are_the_layouts_blocks() {
    for layout in [
        KvLayout::new(32, 8, 128, 16, DType::Float16).unwrap(),
        KvLayout::new(3, 2, 64, 5, DType::Float8E4M3).unwrap(),
        KvLayout::new(1, 1, 4, 16, DType::Float16).unwrap(),
    ] {
        let spec = ModelKvSpec::uniform(&layout);
        assert_eq!(spec.num_groups(), 1);
        assert_eq!(spec.page_bytes(), layout.block_bytes());
        assert_eq!(spec.geometry(0).unwrap().block_size(), Some(layout.block_size()));
        assert!(matches!(spec.group(0).unwrap().kind, GroupKind::Full(_)));
        for page in [0, 1, 7] {
            for layer in 0..layout.num_layers() {
                for part in [KvPart::K, KvPart::V] {
                    for token in 0..layout.block_size() {
                        for head in 0..layout.num_kv_heads() {
                            for dim in [0, layout.head_dim() - 1] {
                                assert_eq!(
                                    spec.attention_offset_bytes(
                                        0, page, layer, part, token, head, dim
                                    )
                                    .unwrap(),
                                    layout
                                        .element_offset_bytes(page, layer, part, token, head, dim)
                                );
                            }
                        }
                    }
                }
            }
        }
        // A request of n tokens takes ceil(n / block_size) pages, as a uniform table does.
        for n in [0, 1, 15, 16, 17, 1000] {
            assert_eq!(spec.pages_to_add(n), n.div_ceil(layout.block_size()));
        }
    }
}

#[test]
fn groups_must_cover_every_layer_exactly_once() {
    let full = |layers: Vec<usize>| KvGroup::new(layers, GroupKind::Full(attention(1, 64)));
    let m = invalid_message(ModelKvSpec::new(4, vec![full(vec![0, 1]), full(vec![3])], 4096));
    assert!(m.contains("layer 2 is in no group"), "{m}");
    let m = invalid_message(ModelKvSpec::new(4, vec![full(vec![0, 1, 2]), full(vec![2, 3])], 4096));
    assert!(m.contains("layer 2 is in group 0 and in group 1"), "{m}");
    let m = invalid_message(ModelKvSpec::new(2, vec![full(vec![0, 1, 5])], 4096));
    assert!(m.contains("group 0 names layer 5") && m.contains("2 layers"), "{m}");
    let m = invalid_message(ModelKvSpec::new(2, vec![full(vec![0, 1]), full(vec![])], 4096));
    assert!(m.contains("group 1") && m.contains("no layers"), "{m}");
    assert!(invalid_message(ModelKvSpec::new(2, vec![], 4096)).contains("at least one"));
    // A layer count nobody could allocate a table for is an error, not an abort.
    let m = invalid_message(ModelKvSpec::new(usize::MAX, vec![full(vec![0, 1])], 4096));
    assert!(m.contains("layer 2 is in no group"), "{m}");
    assert!(invalid_message(ModelKvSpec::new(0, vec![full(vec![])], 4096)).contains("num_layers"));
}

#[test]
fn bad_kinds_and_pages_name_the_group_and_the_field() {
    let one = |kind| vec![KvGroup::new(vec![0], kind)];
    let m = invalid_message(ModelKvSpec::new(
        1,
        one(GroupKind::SlidingWindow { window: 0, shape: attention(1, 64) }),
        4096,
    ));
    assert!(
        m.contains("group 0 (sliding window 0)") && m.contains("window must be positive"),
        "{m}"
    );
    let m = invalid_message(ModelKvSpec::new(
        1,
        one(GroupKind::ChunkedLocal { chunk: 0, shape: attention(1, 64) }),
        4096,
    ));
    assert!(m.contains("chunk must be positive"), "{m}");
    let m = invalid_message(ModelKvSpec::new(1, one(GroupKind::Full(attention(0, 64))), 4096));
    assert!(m.contains("num_kv_heads must be positive"), "{m}");
    let m = invalid_message(ModelKvSpec::new(
        1,
        one(GroupKind::RecurrentState { bytes_per_layer: 0 }),
        4096,
    ));
    assert!(m.contains("recurrent state") && m.contains("bytes_per_layer must be positive"), "{m}");
    let m = invalid_message(ModelKvSpec::new(
        1,
        one(GroupKind::MlaLatent { latent_dim: 0, rope_dim: 64, dtype: DType::BFloat16 }),
        4096,
    ));
    assert!(m.contains("latent_dim must be positive"), "{m}");
    // One token of 8 heads x 128 over 4 layers is 16 KiB: more than a 4 KiB page.
    let wide = vec![KvGroup::new(vec![0, 1, 2, 3], GroupKind::Full(attention(8, 128)))];
    let m = invalid_message(ModelKvSpec::new(4, wide, 4096));
    assert!(m.contains("group 0 (full attention)") && m.contains("16384 bytes"), "{m}");
    for page_bytes in [0, 1000] {
        let m = invalid_message(ModelKvSpec::new(
            1,
            one(GroupKind::Full(attention(1, 64))),
            page_bytes,
        ));
        assert!(m.contains("page_bytes"), "{m}");
    }
}

#[test]
fn a_state_packs_layers_into_a_page_or_splits_a_layer_at_page_boundaries() {
    let state = |bytes_per_layer, layers: usize| {
        ModelKvSpec::new(
            layers,
            vec![KvGroup::new(
                (0..layers).collect(),
                GroupKind::RecurrentState { bytes_per_layer },
            )],
            4096,
        )
        .unwrap()
    };
    // 1000-byte states: four to a 4096-byte page, so ten layers take three pages.
    let packed = state(1000, 10);
    assert_eq!(
        *packed.geometry(0).unwrap(),
        PageGeometry::State {
            bytes_per_layer: 1000,
            packing: StatePacking::LayersPerPage(4),
            pages_per_slot: 3
        }
    );
    assert_eq!(packed.state_location(0, 5, 999).unwrap(), (1, 1000 + 999));
    assert_eq!(packed.state_location(0, 9, 0).unwrap(), (2, 1000));
    assert!(packed.state_location(0, 10, 0).is_err());
    assert!(packed.state_location(0, 0, 1000).is_err());
    // 10000-byte states: three pages per layer, a layer's bytes in order over its pages.
    let split = state(10_000, 2);
    assert_eq!(
        split.geometry(0).unwrap().clone(),
        PageGeometry::State {
            bytes_per_layer: 10_000,
            packing: StatePacking::PagesPerLayer(3),
            pages_per_slot: 6
        }
    );
    assert_eq!(split.state_location(0, 1, 0).unwrap(), (3, 0));
    assert_eq!(split.state_location(0, 1, 9_999).unwrap(), (5, 9_999 - 2 * 4096));
    assert_eq!(split.pages_to_add(0), 6);
    // Offsets of the wrong kind are refused, naming the group.
    assert!(split.attention_offset_bytes(0, 0, 0, KvPart::K, 0, 0, 0).is_err());
    assert!(
        matches!(split.geometry(1), Err(CoreError::InvalidArgument(m)) if m.contains("1 groups"))
    );
}

#[test]
fn an_mla_page_is_layer_major_latent_then_rope() {
    let kind = GroupKind::MlaLatent { latent_dim: 512, rope_dim: 64, dtype: DType::BFloat16 };
    let spec = ModelKvSpec::new(2, vec![KvGroup::new(vec![0, 1], kind)], 64 * 2 * 1152).unwrap();
    assert_eq!(spec.geometry(0).unwrap().block_size(), Some(64));
    assert_eq!(spec.latent_offset_bytes(0, 0, 0, 0, 512).unwrap(), 1024);
    assert_eq!(spec.latent_offset_bytes(0, 0, 0, 1, 0).unwrap(), 1152);
    assert_eq!(spec.latent_offset_bytes(0, 0, 1, 0, 0).unwrap(), 64 * 1152);
    // The last element of a page's last token ends the page.
    assert_eq!(spec.latent_offset_bytes(0, 3, 1, 63, 575).unwrap() + 2, 4 * spec.page_bytes());
    assert!(spec.latent_offset_bytes(0, 0, 2, 0, 0).is_err());
}

#[test]
fn an_fp8_mla_page_holds_one_byte_an_element() {
    // The fp8 (e4m3) latent cache of the MLA kernel: 576-byte rows, 64 tokens of two layers a
    // page, the rope part at byte 512 of each row.
    let kind = GroupKind::MlaLatent { latent_dim: 512, rope_dim: 64, dtype: DType::Float8E4M3 };
    let spec = ModelKvSpec::new(2, vec![KvGroup::new(vec![0, 1], kind)], 64 * 2 * 576).unwrap();
    assert_eq!(spec.geometry(0).unwrap().block_size(), Some(64));
    assert_eq!(spec.latent_offset_bytes(0, 0, 0, 0, 512).unwrap(), 512);
    assert_eq!(spec.latent_offset_bytes(0, 0, 0, 1, 0).unwrap(), 576);
    assert_eq!(spec.latent_offset_bytes(0, 0, 1, 0, 0).unwrap(), 64 * 576);
    assert_eq!(spec.latent_offset_bytes(0, 3, 1, 63, 575).unwrap() + 1, 4 * spec.page_bytes());
}

fn argument_message<T: std::fmt::Debug>(result: Result<T, CoreError>) -> String {
    match result {
        Err(CoreError::InvalidArgument(message)) => message,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn an_attention_offset_refuses_each_index_past_its_bound() {
    // Two layers of 2 heads of 64 fp16 elements: 1024 bytes a token, 4 tokens a page.
    let kind =
        GroupKind::Full(AttentionShape { num_kv_heads: 2, head_dim: 64, dtype: DType::Float16 });
    let spec = ModelKvSpec::new(2, vec![KvGroup::new(vec![0, 1], kind)], 4096).unwrap();
    let offset = |page, layer, part, token, head, dim| {
        spec.attention_offset_bytes(0, page, layer, part, token, head, dim)
    };
    // The last element of the last token of the last layer ends the page.
    assert_eq!(offset(0, 1, KvPart::V, 3, 1, 63).unwrap() + 2, 4096);
    // Each index one past its bound would address a neighbour (token 4 of layer 0's K is
    // token 0 of its V), so each is refused, naming the index and its bound.
    let m = argument_message(offset(0, 0, KvPart::K, 4, 0, 0));
    assert!(m.contains("token 4") && m.contains("4 tokens per page"), "{m}");
    let m = argument_message(offset(0, 0, KvPart::K, 0, 2, 0));
    assert!(m.contains("kv_head 2") && m.contains("2 KV heads"), "{m}");
    let m = argument_message(offset(0, 0, KvPart::K, 0, 0, 64));
    assert!(m.contains("dim 64") && m.contains("head_dim 64"), "{m}");
    let m = argument_message(offset(0, 2, KvPart::K, 0, 0, 0));
    assert!(m.contains("layer index 2") && m.contains("2 layers"), "{m}");
    // A page id whose offset does not fit a usize is an error, not an overflow.
    let m = argument_message(offset(usize::MAX, 0, KvPart::K, 0, 0, 0));
    assert!(m.contains(&format!("page_id {}", usize::MAX)), "{m}");
    // The last page that fits is addressed up to its last element.
    let last_page = usize::MAX / 4096;
    assert_eq!(offset(last_page, 1, KvPart::V, 3, 1, 63).unwrap(), usize::MAX - 1);
    assert!(offset(last_page + 1, 0, KvPart::K, 0, 0, 0).is_err());
    // 768-byte pages (3 tokens of 256 bytes) do not divide 2^64: the last page's base
    // fits, 255 bytes below `usize::MAX`, and so does its second token's K (128 bytes on),
    // but not its third's.
    let kind =
        GroupKind::Full(AttentionShape { num_kv_heads: 1, head_dim: 64, dtype: DType::Float16 });
    let odd = ModelKvSpec::new(1, vec![KvGroup::new(vec![0], kind)], 768).unwrap();
    let last_page = usize::MAX / 768;
    let at = |token| odd.attention_offset_bytes(0, last_page, 0, KvPart::K, token, 0, 0);
    assert_eq!(at(0).unwrap(), usize::MAX - 255);
    assert_eq!(at(1).unwrap(), usize::MAX - 127);
    assert!(argument_message(at(2)).contains("page_id"));
}

#[test]
fn a_latent_offset_refuses_each_index_past_its_bound() {
    let kind = GroupKind::MlaLatent { latent_dim: 512, rope_dim: 64, dtype: DType::BFloat16 };
    let spec = ModelKvSpec::new(2, vec![KvGroup::new(vec![0, 1], kind)], 64 * 2 * 1152).unwrap();
    // Token 64 of layer 0 would be token 0 of layer 1; dim 576 the next token's latent.
    let m = argument_message(spec.latent_offset_bytes(0, 0, 0, 64, 0));
    assert!(m.contains("token 64") && m.contains("64 tokens per page"), "{m}");
    let m = argument_message(spec.latent_offset_bytes(0, 0, 0, 0, 576));
    assert!(m.contains("dim 576") && m.contains("512 + 64"), "{m}");
    let m = argument_message(spec.latent_offset_bytes(0, usize::MAX, 0, 0, 0));
    assert!(m.contains("page_id"), "{m}");
    // A state slot's location checks its layer and byte the same way.
    let state = ModelKvSpec::new(
        1,
        vec![KvGroup::new(vec![0], GroupKind::RecurrentState { bytes_per_layer: 1000 })],
        4096,
    )
    .unwrap();
    let m = argument_message(state.state_location(0, 1, 0));
    assert!(m.contains("layer index 1") && m.contains("1 layers"), "{m}");
    let m = argument_message(state.state_location(0, 0, 1000));
    assert!(m.contains("byte 1000") && m.contains("1000 bytes"), "{m}");
}

/// A model as its published config describes it, and the page the note recommends:
/// `block_size` tokens of its largest token group.
struct Model {
    spec: ModelKvSpec,
    /// Bytes per token over every attention layer if all were full attention (the uniform
    /// pool's cost); `None` where some layers hold no K and V at all.
    all_full_token_bytes: Option<usize>,
}

fn model(num_layers: usize, groups: Vec<KvGroup>, block_size: usize) -> ModelKvSpec {
    let largest = groups.iter().filter_map(KvGroup::token_bytes).max().unwrap();
    ModelKvSpec::new(num_layers, groups, block_size * largest).unwrap()
}

/// gpt-oss-20b / 120b config.json: num_hidden_layers 24 / 36, layer_types alternating
/// "sliding_attention", "full_attention" from layer 0, sliding_window 128,
/// num_key_value_heads 8, head_dim 64.
fn gpt_oss(num_layers: usize) -> Model {
    let window = GroupKind::SlidingWindow { window: 128, shape: attention(8, 64) };
    let groups = vec![
        KvGroup::new(layers_where(num_layers, |l| l % 2 == 0), window),
        KvGroup::new(layers_where(num_layers, |l| l % 2 == 1), GroupKind::Full(attention(8, 64))),
    ];
    Model { spec: model(num_layers, groups, 16), all_full_token_bytes: Some(num_layers * 2048) }
}

/// Gemma 3 27B config.json text_config: num_hidden_layers 62, sliding_window_pattern 6
/// (layer i is global when (i + 1) % 6 == 0), sliding_window 1024, num_key_value_heads 16,
/// head_dim 128.
fn gemma3_27b() -> Model {
    let window = GroupKind::SlidingWindow { window: 1024, shape: attention(16, 128) };
    let groups = vec![
        KvGroup::new(layers_where(62, |l| (l + 1) % 6 != 0), window),
        KvGroup::new(layers_where(62, |l| (l + 1) % 6 == 0), GroupKind::Full(attention(16, 128))),
    ];
    Model { spec: model(62, groups, 16), all_full_token_bytes: Some(62 * 8192) }
}

/// Llama 4 Scout config.json text_config: num_hidden_layers 48, attention_chunk_size 8192,
/// every 4th layer global (no_rope_layers), num_key_value_heads 8,
/// head_dim 128.
fn llama4_scout() -> Model {
    let chunked = GroupKind::ChunkedLocal { chunk: 8192, shape: attention(8, 128) };
    let groups = vec![
        KvGroup::new(layers_where(48, |l| (l + 1) % 4 != 0), chunked),
        KvGroup::new(layers_where(48, |l| (l + 1) % 4 == 0), GroupKind::Full(attention(8, 128))),
    ];
    Model { spec: model(48, groups, 16), all_full_token_bytes: Some(48 * 4096) }
}

/// Gated DeltaNet state of Qwen3-Next-80B-A3B per layer, bf16: the recurrent state
/// linear_num_value_heads 32 x linear_key_head_dim 128 x linear_value_head_dim 128, and the
/// conv state (linear_conv_kernel_dim 4 - 1) x (2 x 16 key heads x 128 + 32 value heads x 128).
const QWEN3_NEXT_STATE_BYTES: usize = (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) * 2;

/// Qwen3-Next-80B-A3B config.json: num_hidden_layers 48, full_attention_interval 4 (layer i
/// full when (i + 1) % 4 == 0, linear attention otherwise), num_key_value_heads 2,
/// head_dim 256.
fn qwen3_next() -> Model {
    let state = GroupKind::RecurrentState { bytes_per_layer: QWEN3_NEXT_STATE_BYTES };
    let groups = vec![
        KvGroup::new(layers_where(48, |l| (l + 1) % 4 != 0), state),
        KvGroup::new(layers_where(48, |l| (l + 1) % 4 == 0), GroupKind::Full(attention(2, 256))),
    ];
    Model { spec: model(48, groups, 16), all_full_token_bytes: None }
}

/// DeepSeek-V3 config.json: num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64;
/// 64-token pages (FlashMLA's).
fn deepseek_v3() -> Model {
    let kind = GroupKind::MlaLatent { latent_dim: 512, rope_dim: 64, dtype: DType::BFloat16 };
    let groups = vec![KvGroup::new((0..61).collect(), kind)];
    Model { spec: model(61, groups, 64), all_full_token_bytes: None }
}

/// Bytes requests of `num_tokens .. num_tokens + 256` tokens in steady decode (the last
/// token's query still to run) hold under the page scheme, and the bytes their live tokens
/// and states need, each summed over the 256 lengths (so that partly filled pages count
/// as they do on average).
fn held_and_needed(spec: &ModelKvSpec, num_tokens: usize) -> (usize, usize) {
    (num_tokens..num_tokens + 256)
        .map(|n| held_and_needed_at(spec, n))
        .fold((0, 0), |(h, n), (dh, dn)| (h + dh, n + dn))
}

fn held_and_needed_at(spec: &ModelKvSpec, num_tokens: usize) -> (usize, usize) {
    let next_query = num_tokens - 1;
    let (mut held, mut needed) = (0, 0);
    for (g, group) in spec.groups().iter().enumerate() {
        held += spec.live_pages(g, num_tokens, next_query).unwrap().len() * spec.page_bytes();
        needed += match group.kind {
            GroupKind::RecurrentState { bytes_per_layer } => bytes_per_layer * group.layers.len(),
            GroupKind::SlidingWindow { window, .. } => {
                num_tokens.min(window) * group.token_bytes().unwrap()
            }
            GroupKind::ChunkedLocal { chunk, .. } => {
                (num_tokens - next_query / chunk * chunk) * group.token_bytes().unwrap()
            }
            _ => num_tokens * group.token_bytes().unwrap(),
        };
    }
    (held, needed)
}

/// Per group: tokens per page and the percentage of the page (or slot) that holds data.
fn fill(spec: &ModelKvSpec) -> Vec<(Option<usize>, f64)> {
    (0..spec.num_groups())
        .map(|g| {
            let geometry = spec.geometry(g).unwrap();
            let pages = spec.live_pages(g, 1, 0).unwrap().len().max(1);
            let used = geometry.used_bytes(spec.group(g).unwrap().layers.len());
            let used_per_page = if geometry.block_size().is_some() { used } else { used / pages };
            (geometry.block_size(), 100.0 * used_per_page as f64 / spec.page_bytes() as f64)
        })
        .collect()
}

fn assert_close(actual: f64, expected: f64, what: &str) {
    assert!((actual - expected).abs() < 0.05, "{what}: {actual:.2}, the note says {expected:.2}");
}

/// One row of the waste table in `hybrid/hybrid.md`.
struct NoteRow {
    name: &'static str,
    model: Model,
    page_bytes: usize,
    /// Per group: tokens per page (`None` for a state) and the % of a page holding data.
    groups: Vec<(Option<usize>, f64)>,
    /// Bytes held over bytes needed, minus 1, in %, around 32k tokens.
    held_over_needed_pct: f64,
    /// The all-full-attention pool's bytes over ours around 32k tokens.
    all_full_over_ours: Option<f64>,
}

fn row(
    name: &'static str,
    model: Model,
    page_bytes: usize,
    groups: Vec<(Option<usize>, f64)>,
    held_over_needed_pct: f64,
    all_full_over_ours: Option<f64>,
) -> NoteRow {
    NoteRow { name, model, page_bytes, groups, held_over_needed_pct, all_full_over_ours }
}

/// The figures of the waste table in `hybrid/hybrid.md`: page bytes, tokens per page, page
/// fill, and for requests around 32k tokens in decode the bytes held over the bytes needed
/// and the all-full-attention pool's bytes over ours.
#[test]
fn the_published_models_match_the_notes_waste_table() {
    let full_16 = (Some(16), 100.0);
    let table = [
        row("gpt-oss-20b", gpt_oss(24), 393_216, vec![full_16, full_16], 0.07, Some(1.99)),
        row("gpt-oss-120b", gpt_oss(36), 589_824, vec![full_16, full_16], 0.07, Some(1.99)),
        row(
            "gemma-3-27b",
            gemma3_27b(),
            6_815_744,
            vec![full_16, (Some(83), 99.76)],
            0.52,
            Some(5.31),
        ),
        row(
            "llama-4-scout",
            llama4_scout(),
            2_359_296,
            vec![full_16, (Some(48), 100.0)],
            0.14,
            Some(3.94),
        ),
        row("qwen3-next-80b-a3b", qwen3_next(), 393_216, vec![(None, 93.06), full_16], 0.37, None),
        row("deepseek-v3", deepseek_v3(), 4_497_408, vec![(Some(64), 100.0)], 0.10, None),
    ];
    for NoteRow { name, model: m, page_bytes, groups, held_over_needed_pct, all_full_over_ours } in
        table
    {
        assert_eq!(m.spec.page_bytes(), page_bytes, "{name}");
        for (g, ((block_size, pct), (want_block_size, want_pct))) in
            fill(&m.spec).into_iter().zip(groups).enumerate()
        {
            assert_eq!(block_size, want_block_size, "{name} group {g}");
            assert_close(pct, want_pct, &format!("{name} group {g} fill"));
        }
        let (held, needed) = held_and_needed(&m.spec, 32_768);
        assert_close(100.0 * (held as f64 / needed as f64 - 1.0), held_over_needed_pct, name);
        if let (Some(bytes), Some(ratio)) = (m.all_full_token_bytes, all_full_over_ours) {
            let all_full = bytes * (32_768 * 256 + 255 * 128);
            assert_close(all_full as f64 / held as f64, ratio, &format!("{name} all-full"));
        }
    }
}
