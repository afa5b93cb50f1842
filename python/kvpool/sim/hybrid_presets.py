"""Hybrid models for the simulator: a model's layers as groups that keep different things.

A `HybridModel` is what `rust/core/src/hybrid/hybrid.md` calls a list of KV groups: layers
with full attention, a sliding window, chunked local attention, an MLA latent, or a
recurrent state. `HybridModel.kv_spec()` turns it into the core's `kvpool.ModelKvSpec` (the
page scheme of hybrid.md: `block_size` tokens of the group with the largest token bytes per
page). The presets' numbers are the fields of each model's published `config.json`, named
as the config names them (the comment above each preset); `hybrid_config.py` reads the same
fields from a config.json file.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL = "full"
SLIDING_WINDOW = "sliding_window"
CHUNKED_LOCAL = "chunked_local"
MLA_LATENT = "mla_latent"
RECURRENT_STATE = "recurrent_state"
KINDS = (FULL, SLIDING_WINDOW, CHUNKED_LOCAL, MLA_LATENT, RECURRENT_STATE)
ATTENTION_KINDS = (FULL, SLIDING_WINDOW, CHUNKED_LOCAL)


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Some layers of a model and what they keep (one `kvpool.KvGroup`).

    Attention kinds use `num_kv_heads` and `head_dim` (K and V per head); `window` is the
    sliding window or the chunk, in tokens. MLA uses `latent_dim + rope_dim` elements per
    token and layer. A recurrent state keeps `state_bytes_per_layer` bytes per request and
    layer, whatever the length.
    """

    kind: str
    layers: tuple[int, ...]
    num_kv_heads: int = 0
    head_dim: int = 0
    window: int = 0
    latent_dim: int = 0
    rope_dim: int = 0
    state_bytes_per_layer: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"group kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.layers:
            raise ValueError(f"a {self.kind} group needs at least one layer")
        needs = {
            FULL: ("num_kv_heads", "head_dim"),
            SLIDING_WINDOW: ("num_kv_heads", "head_dim", "window"),
            CHUNKED_LOCAL: ("num_kv_heads", "head_dim", "window"),
            MLA_LATENT: ("latent_dim",),
            RECURRENT_STATE: ("state_bytes_per_layer",),
        }[self.kind]
        for name in needs:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"a {self.kind} group needs {name} >= 1, got {value!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def token_bytes_per_layer(self, elem_bytes: int) -> int | None:
        """Bytes of one token of one layer (K and V for attention); None for a state."""
        if self.kind in ATTENTION_KINDS:
            return 2 * self.num_kv_heads * self.head_dim * elem_bytes
        if self.kind == MLA_LATENT:
            return (self.latent_dim + self.rope_dim) * elem_bytes
        return None

    def token_bytes(self, elem_bytes: int) -> int | None:
        """Bytes of one token over all the group's layers; None for a state."""
        per_layer = self.token_bytes_per_layer(elem_bytes)
        return None if per_layer is None else per_layer * self.num_layers

    def first_live_token(self, next_query: int) -> int:
        """The first token a query at `next_query` or later sees (hybrid.md's table)."""
        if self.kind == SLIDING_WINDOW:
            return max(0, next_query + 1 - self.window)
        if self.kind == CHUNKED_LOCAL:
            return next_query // self.window * self.window
        return 0

    def live_tokens(self, num_tokens: int, next_query: int) -> int:
        """Tokens whose KV some query from `next_query` on still reads (0 for a state)."""
        if self.kind == RECURRENT_STATE:
            return 0
        return max(0, num_tokens - self.first_live_token(next_query))

    def describe(self) -> str:
        n = self.num_layers
        if self.kind == FULL:
            return f"{n} full ({self.num_kv_heads} x {self.head_dim})"
        if self.kind == SLIDING_WINDOW:
            return f"{n} sliding window {self.window} ({self.num_kv_heads} x {self.head_dim})"
        if self.kind == CHUNKED_LOCAL:
            return f"{n} chunked local {self.window} ({self.num_kv_heads} x {self.head_dim})"
        if self.kind == MLA_LATENT:
            return f"{n} MLA latent {self.latent_dim} + {self.rope_dim}"
        return f"{n} recurrent states of {self.state_bytes_per_layer:,} bytes"


@dataclass(frozen=True, slots=True)
class HybridModel:
    """A model's KV memory as groups of layers, and what the cost model needs of it.

    `num_params` are the weights a step reads (all experts of an MoE: a batch of hundreds
    touches nearly all of them); `active_params` the weights one token multiplies (2 x
    active_params FLOPs per token). `block_size` is the tokens per page of the group with
    the largest token bytes (hybrid.md: 16, or 64 for MLA as FlashMLA's pages).
    """

    name: str
    num_layers: int
    groups: tuple[LayerGroup, ...]
    num_q_heads: int
    num_params: float
    active_params: float
    block_size: int = 16
    source: str = ""  # where the numbers come from

    def __post_init__(self) -> None:
        listed = sorted(layer for g in self.groups for layer in g.layers)
        if listed != list(range(self.num_layers)):
            raise ValueError(
                f"{self.name}: the groups must cover layers 0..{self.num_layers - 1} once each"
            )

    def token_groups(self) -> list[LayerGroup]:
        return [g for g in self.groups if g.kind != RECURRENT_STATE]

    def page_bytes(self, elem_bytes: int = 2) -> int:
        """`block_size` tokens of the group with the largest token bytes (hybrid.md)."""
        return self.block_size * max(g.token_bytes(elem_bytes) or 0 for g in self.token_groups())

    def state_bytes(self) -> int:
        """Bytes of every recurrent state of one request."""
        return sum(
            g.state_bytes_per_layer * g.num_layers for g in self.groups if g.kind == RECURRENT_STATE
        )

    def needed_bytes(self, num_tokens: int, next_query: int, elem_bytes: int = 2) -> int:
        """Bytes a request's live tokens and states need (no page rounding)."""
        out = self.state_bytes()
        for g in self.token_groups():
            out += g.live_tokens(num_tokens, next_query) * (g.token_bytes(elem_bytes) or 0)
        return out

    def all_full_token_bytes(self, elem_bytes: int = 2) -> int | None:
        """Bytes per token if every attention layer were full attention (a uniform pool);
        None where some layer has no K and V (a recurrent state)."""
        if any(g.kind == RECURRENT_STATE for g in self.groups):
            return None
        return sum(g.token_bytes(elem_bytes) or 0 for g in self.groups)

    def describe(self) -> str:
        return ", ".join(g.describe() for g in self.groups)


def layers_where(num_layers: int, keep) -> tuple[int, ...]:
    return tuple(i for i in range(num_layers) if keep(i))


def gated_deltanet_state_bytes(
    linear_num_value_heads: int,
    linear_num_key_heads: int,
    linear_key_head_dim: int,
    linear_value_head_dim: int,
    linear_conv_kernel_dim: int,
    dtype_bytes: int = 2,
) -> int:
    """One Gated DeltaNet layer's state (Qwen3-Next): the recurrent state, one key_dim x
    value_dim matrix per value head, and the causal conv's last kernel - 1 inputs of q, k
    and v (2 x key heads x key_dim + value heads x value_dim channels)."""
    recurrent = linear_num_value_heads * linear_key_head_dim * linear_value_head_dim
    conv_channels = (
        2 * linear_num_key_heads * linear_key_head_dim
        + linear_num_value_heads * linear_value_head_dim
    )
    return (recurrent + (linear_conv_kernel_dim - 1) * conv_channels) * dtype_bytes


def _gpt_oss(name: str, num_hidden_layers: int, num_params: float, active: float) -> HybridModel:
    # openai/gpt-oss-20b and -120b config.json: num_hidden_layers 24 / 36, layer_types
    # "sliding_attention", "full_attention" alternating from layer 0, sliding_window 128,
    # num_key_value_heads 8, head_dim 64, num_attention_heads 64. Parameters (total /
    # active per token): the model card's 20.9B / 3.6B and 116.8B / 5.1B.
    n = num_hidden_layers
    return HybridModel(
        name=name,
        num_layers=n,
        groups=(
            LayerGroup(SLIDING_WINDOW, layers_where(n, lambda i: i % 2 == 0), 8, 64, window=128),
            LayerGroup(FULL, layers_where(n, lambda i: i % 2 == 1), 8, 64),
        ),
        num_q_heads=64,
        num_params=num_params,
        active_params=active,
        source="config.json: num_hidden_layers, layer_types, sliding_window 128, "
        "num_key_value_heads 8, head_dim 64, num_attention_heads 64; params: model card",
    )


def _gemma3_27b() -> HybridModel:
    # google/gemma-3-27b config.json text_config: num_hidden_layers 62,
    # sliding_window_pattern 6 (layer i global when (i + 1) % 6 == 0), sliding_window 1024,
    # num_key_value_heads 16, head_dim 128, num_attention_heads 32; 27.4B parameters (dense).
    n = 62
    return HybridModel(
        name="gemma-3-27b",
        num_layers=n,
        groups=(
            LayerGroup(
                SLIDING_WINDOW, layers_where(n, lambda i: (i + 1) % 6 != 0), 16, 128, window=1024
            ),
            LayerGroup(FULL, layers_where(n, lambda i: (i + 1) % 6 == 0), 16, 128),
        ),
        num_q_heads=32,
        num_params=27.4e9,
        active_params=27.4e9,
        source="config.json text_config: num_hidden_layers 62, sliding_window_pattern 6, "
        "sliding_window 1024, num_key_value_heads 16, head_dim 128, num_attention_heads 32",
    )


def _llama4_scout() -> HybridModel:
    # meta-llama/Llama-4-Scout-17B-16E config.json text_config: num_hidden_layers 48,
    # attention_chunk_size 8192, no_rope_layers 1 (RoPE, chunked) on three layers of four and
    # 0 (NoPE, global) where (i + 1) % 4 == 0, num_key_value_heads 8, head_dim 128,
    # num_attention_heads 40; 109B parameters, 17B active.
    n = 48
    return HybridModel(
        name="llama-4-scout",
        num_layers=n,
        groups=(
            LayerGroup(
                CHUNKED_LOCAL, layers_where(n, lambda i: (i + 1) % 4 != 0), 8, 128, window=8192
            ),
            LayerGroup(FULL, layers_where(n, lambda i: (i + 1) % 4 == 0), 8, 128),
        ),
        num_q_heads=40,
        num_params=109e9,
        active_params=17e9,
        source="config.json text_config: num_hidden_layers 48, attention_chunk_size 8192, "
        "no_rope_layers, num_key_value_heads 8, head_dim 128, num_attention_heads 40",
    )


# Qwen/Qwen3-Next-80B-A3B config.json: linear_num_value_heads 32, linear_num_key_heads 16,
# linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4 (bf16).
QWEN3_NEXT_STATE_BYTES = gated_deltanet_state_bytes(32, 16, 128, 128, 4)


def _qwen3_next() -> HybridModel:
    # Qwen/Qwen3-Next-80B-A3B config.json: num_hidden_layers 48, full_attention_interval 4
    # (layer i full attention when (i + 1) % 4 == 0, Gated DeltaNet otherwise),
    # num_key_value_heads 2, head_dim 256, num_attention_heads 16; 80B parameters, 3B active.
    n = 48
    return HybridModel(
        name="qwen3-next-80b-a3b",
        num_layers=n,
        groups=(
            LayerGroup(
                RECURRENT_STATE,
                layers_where(n, lambda i: (i + 1) % 4 != 0),
                state_bytes_per_layer=QWEN3_NEXT_STATE_BYTES,
            ),
            LayerGroup(FULL, layers_where(n, lambda i: (i + 1) % 4 == 0), 2, 256),
        ),
        num_q_heads=16,
        num_params=80e9,
        active_params=3e9,
        source="config.json: num_hidden_layers 48, full_attention_interval 4, "
        "num_key_value_heads 2, head_dim 256, num_attention_heads 16, linear_num_value_heads 32, "
        "linear_num_key_heads 16, linear_key_head_dim 128, linear_value_head_dim 128, "
        "linear_conv_kernel_dim 4",
    )


def _deepseek_v3() -> HybridModel:
    # deepseek-ai/DeepSeek-V3 config.json: num_hidden_layers 61, kv_lora_rank 512,
    # qk_rope_head_dim 64, num_attention_heads 128; 671B parameters, 37B active; 64-token
    # pages (FlashMLA's).
    return HybridModel(
        name="deepseek-v3",
        num_layers=61,
        groups=(LayerGroup(MLA_LATENT, tuple(range(61)), latent_dim=512, rope_dim=64),),
        num_q_heads=128,
        num_params=671e9,
        active_params=37e9,
        block_size=64,
        source="config.json: num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64, "
        "num_attention_heads 128",
    )


HYBRID_PRESETS: dict[str, HybridModel] = {
    m.name: m
    for m in (
        _gpt_oss("gpt-oss-20b", 24, 20.9e9, 3.6e9),
        _gpt_oss("gpt-oss-120b", 36, 116.8e9, 5.1e9),
        _gemma3_27b(),
        _llama4_scout(),
        _qwen3_next(),
        _deepseek_v3(),
    )
}
