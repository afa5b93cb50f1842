"""The three ways the hybrid simulation holds one model's KV in the same bytes.

- **hybrid** (`hybrid_spec`): kvpool's page scheme (`rust/core/src/hybrid/hybrid.md`): one
  `kvpool.ModelKvSpec` with a group per layer kind, pages of `block_size` tokens of the
  largest token group, window and chunk groups dropping the pages no later query sees, a
  state group one slot per request.
- **all full** (`AllFullScheme`): what a uniform pool must do: every attention layer keeps
  every token (a sliding-window or chunked layer is stored as a full one), one `KvLayout`
  block holding all of them. A recurrent state has no K and V to store as full attention;
  a uniform pool cannot hold it at all, so the engine keeps it beside the pool in a static
  reserve of one state slot per request that may run (vLLM's V0 `MambaCacheManager`, sized
  by max_num_seqs), taken out of the same bytes; the pool holds the attention layers only.
- **uniform page** (`uniform_page_spec`): vLLM's hybrid allocator, where every group's page
  has the same bytes. Layers of one kind are cut into groups of `group_size` layers (the
  fewest layers of any kind, or the most when they are within 25 % of each other; vLLM's
  `_get_kv_cache_groups_uniform_page_size`), the last group of a kind padded with unused
  layers; a page holds `block_size` tokens of every layer of its group. With a recurrent
  state the attention block is raised until one layer's page holds one layer's state,
  rounded up to a multiple of 16 tokens, and the state is padded to that page
  (`HybridAttentionMambaModelConfig.verify_and_update_config`): 544 tokens for Qwen3-Next.
  It is built as a `ModelKvSpec` too (the padding layers as extra layer indices of the last
  group), so the same allocator and tables serve it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import kvpool
from kvpool.sim.hybrid_presets import (
    CHUNKED_LOCAL,
    FULL,
    MLA_LATENT,
    RECURRENT_STATE,
    SLIDING_WINDOW,
    HybridModel,
    LayerGroup,
)

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
# vLLM rounds the raised attention block of a Mamba hybrid up to this many tokens.
VLLM_BLOCK_ALIGNMENT = 16


def elem_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"KV dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


def kv_group(
    group: LayerGroup, dtype: str, layers: tuple[int, ...] | None = None
) -> kvpool.KvGroup:
    """The `kvpool.KvGroup` of `group` (over `layers` instead of its own, if given)."""
    layers = group.layers if layers is None else layers
    if group.kind == FULL:
        return kvpool.KvGroup.full(layers, group.num_kv_heads, group.head_dim, dtype)
    if group.kind == SLIDING_WINDOW:
        return kvpool.KvGroup.sliding_window(
            layers, group.window, group.num_kv_heads, group.head_dim, dtype
        )
    if group.kind == CHUNKED_LOCAL:
        return kvpool.KvGroup.chunked_local(
            layers, group.window, group.num_kv_heads, group.head_dim, dtype
        )
    if group.kind == MLA_LATENT:
        return kvpool.KvGroup.mla_latent(layers, group.latent_dim, group.rope_dim, dtype)
    return kvpool.KvGroup.recurrent_state(layers, group.state_bytes_per_layer)


def hybrid_spec(model: HybridModel, dtype: str = "bfloat16") -> kvpool.ModelKvSpec:
    """kvpool's page scheme for `model`: `model.block_size` tokens of its largest token group
    per page (hybrid.md, "Choosing page_bytes")."""
    groups = [kv_group(g, dtype) for g in model.groups]
    return kvpool.ModelKvSpec(
        groups, model.page_bytes(elem_bytes(dtype)), num_layers=model.num_layers
    )


@dataclass(frozen=True, slots=True)
class AllFullScheme:
    """A uniform pool of `block_size`-token blocks of `token_bytes` per token, beside a static
    reserve of `state_slots` recurrent states of `state_bytes` each (none for attention-only
    models)."""

    token_bytes: int
    block_size: int
    state_bytes: int
    state_slots: int

    @property
    def block_bytes(self) -> int:
        return self.token_bytes * self.block_size

    @property
    def reserve_bytes(self) -> int:
        return self.state_bytes * self.state_slots

    def num_blocks(self, kv_memory_bytes: int) -> int:
        return max(0, kv_memory_bytes - self.reserve_bytes) // self.block_bytes


def all_full_scheme(model: HybridModel, dtype: str, max_running_seqs: int) -> AllFullScheme:
    """Every attention layer as full attention; recurrent states in a static reserve of one
    slot per possible running request (the module's docstring says why)."""
    e = elem_bytes(dtype)
    token_bytes = sum(g.token_bytes(e) or 0 for g in model.groups)
    if token_bytes == 0:
        raise ValueError(f"{model.name} has no attention layer for a uniform pool to hold")
    state = model.state_bytes()
    return AllFullScheme(token_bytes, model.block_size, state, max_running_seqs if state else 0)


@dataclass(frozen=True, slots=True)
class UniformPagePlan:
    """vLLM's grouping of `model`: per layer kind, groups of `group_size` layers; every
    attention layer's page holds `block_size` tokens, every state layer's page one state
    padded to the attention layer's page."""

    group_size: int
    block_size: int
    groups: tuple[LayerGroup, ...]  # each of group_size layers (padding layers included)
    num_padding_layers: int
    layer_page_bytes: int  # one layer's page: block_size tokens of one attention layer

    @property
    def page_bytes(self) -> int:
        return self.group_size * self.layer_page_bytes


def _kind_key(g: LayerGroup) -> tuple:
    return (g.kind, g.num_kv_heads, g.head_dim, g.window, g.latent_dim, g.rope_dim)


def uniform_page_plan(model: HybridModel, dtype: str = "bfloat16") -> UniformPagePlan:
    e = elem_bytes(dtype)
    token_groups = model.token_groups()
    per_layer = {g.token_bytes_per_layer(e) or 0 for g in token_groups}
    if len(per_layer) != 1:
        raise ValueError(
            f"{model.name}: layers of different token bytes ({sorted(per_layer)}) have no "
            "common page in vLLM's uniform-page scheme"
        )
    token_bytes_per_layer = per_layer.pop()
    block_size = model.block_size
    state_layer_bytes = max(
        (g.state_bytes_per_layer for g in model.groups if g.kind == RECURRENT_STATE), default=0
    )
    if state_layer_bytes > block_size * token_bytes_per_layer:
        # The attention block grows until one layer's page holds one layer's state.
        a = VLLM_BLOCK_ALIGNMENT
        block_size = a * math.ceil(state_layer_bytes / (a * token_bytes_per_layer))
    counts = [g.num_layers for g in model.groups]
    group_size = min(counts)
    if max(counts) < 1.25 * group_size:
        group_size = max(counts)
    next_layer = model.num_layers  # padding layers get indices after the model's own
    groups = []
    padding = 0
    for g in model.groups:
        for start in range(0, g.num_layers, group_size):
            layers = g.layers[start : start + group_size]
            missing = group_size - len(layers)
            layers = layers + tuple(range(next_layer, next_layer + missing))
            next_layer += missing
            padding += missing
            groups.append(_with_layers(g, layers, block_size * token_bytes_per_layer))
    return UniformPagePlan(
        group_size, block_size, tuple(groups), padding, block_size * token_bytes_per_layer
    )


def _with_layers(g: LayerGroup, layers: tuple[int, ...], layer_page_bytes: int) -> LayerGroup:
    if g.kind == RECURRENT_STATE:  # padded to one attention layer's page
        return LayerGroup(RECURRENT_STATE, layers, state_bytes_per_layer=layer_page_bytes)
    return LayerGroup(
        g.kind, layers, g.num_kv_heads, g.head_dim, g.window, g.latent_dim, g.rope_dim
    )


def uniform_page_spec(model: HybridModel, dtype: str = "bfloat16") -> kvpool.ModelKvSpec:
    """vLLM's uniform-page scheme for `model` as a `kvpool.ModelKvSpec` (padding layers
    included, so a padded group's pages carry their unused bytes as vLLM's do)."""
    plan = uniform_page_plan(model, dtype)
    groups = [kv_group(g, dtype) for g in plan.groups]
    num_layers = model.num_layers + plan.num_padding_layers
    return kvpool.ModelKvSpec(groups, plan.page_bytes, num_layers=num_layers)


# On the host the simulation needs the allocator, not the bytes (as runner.proxy_layout for a
# uniform pool): a hybrid pool is made over a proxy spec, the real one with every byte size
# divided by the same power of two, whose pages hold the same tokens per group and whose
# state slots take the same pages, so the tables take and release the same pages call for
# call, and 64 GiB of modelled KV costs 64 GiB / scale of address space. Bytes are accounted
# with the real spec.
MAX_PROXY_SCALE = 4096


def _scaled_group(g: LayerGroup, scale: int) -> LayerGroup | None:
    """`g` with its bytes per token or per state divided by `scale` (one KV head holding all
    its heads' width), or None where they do not divide."""
    if g.kind == RECURRENT_STATE:
        return LayerGroup(
            RECURRENT_STATE, g.layers, state_bytes_per_layer=-(-g.state_bytes_per_layer // scale)
        )
    width = g.latent_dim + g.rope_dim if g.kind == MLA_LATENT else g.num_kv_heads * g.head_dim
    if width % scale:
        return None
    if g.kind == MLA_LATENT:
        return LayerGroup(MLA_LATENT, g.layers, latent_dim=width // scale)
    return LayerGroup(g.kind, g.layers, 1, width // scale, window=g.window)


def same_geometry(a: kvpool.ModelKvSpec, b: kvpool.ModelKvSpec) -> bool:
    """Whether two specs' groups hold the same tokens per page and pages per state slot."""
    return a.num_groups == b.num_groups and all(
        a.block_size(g) == b.block_size(g) and a.pages_per_slot(g) == b.pages_per_slot(g)
        for g in range(a.num_groups)
    )


def proxy_spec(
    groups: tuple[LayerGroup, ...], real: kvpool.ModelKvSpec, dtype: str
) -> tuple[kvpool.ModelKvSpec, int]:
    """(the smallest proxy of `real`, the spec of `groups`, and its scale): see
    MAX_PROXY_SCALE's comment. Scale 1 (the spec itself) where nothing divides."""
    scale = MAX_PROXY_SCALE
    while scale > 1:
        scaled = [_scaled_group(g, scale) for g in groups]
        if real.page_bytes % (256 * scale) == 0 and all(g is not None for g in scaled):
            kv_groups = [kv_group(g, dtype) for g in scaled if g is not None]
            proxy = kvpool.ModelKvSpec(
                kv_groups, real.page_bytes // scale, num_layers=real.num_layers
            )
            if same_geometry(proxy, real):
                return proxy, scale
        scale //= 2
    return real, 1


def scheme_groups(model: HybridModel, scheme: str, dtype: str) -> tuple[LayerGroup, ...]:
    """The groups of the `hybrid` or the `uniform_page` spec of `model`."""
    if scheme == "hybrid":
        return model.groups
    return uniform_page_plan(model, dtype).groups


def page_pool(spec: kvpool.ModelKvSpec, num_pages: int) -> kvpool.Pool:
    """A host pool of `num_pages` pages of `spec` (HybridTables' requirement)."""
    return kvpool.Pool.for_spec(spec, num_pages, device="host")
