"""Hybrid transformers models (sliding-window and full layers, attention sinks) on kvpool's
hybrid KV memory (optional extra `kvpool[transformers]`); design: hybrid_models.md.

- `spec_for_model(model_or_config)`: the `kvpool.ModelKvSpec` of a model: its
  "sliding_attention" layers one sliding-window group, its "full_attention" layers one full
  group (`layer_types`, `sliding_window`, `num_key_value_heads`, `head_dim`, the dtype).
  DeepSeek-V3 is one MLA-latent group (`kv_lora_rank` + `qk_rope_head_dim` per token and
  layer); Qwen3-Next's "linear_attention" layers a recurrent-state group (its Gated
  DeltaNet conv and recurrent states, one slot per request). What kvpool cannot hold or attend yet is refused with `UnsupportedModelError`
  naming it.
- `register()` adds the attention function "kvpool_hybrid" to transformers'
  AttentionInterface. In a packed step (`kvpool_hybrid_step=` passed down the forward, as the
  Llama path passes `kvpool_step`) each layer writes its K/V into its group's pages at the
  step's slots (HybridTables.slot_mapping) and attends over the pages its group's table holds:
  a window layer sees the last `sliding_window` keys (its table holds only those pages),
  gpt-oss's sinks (`s_aux`) join the softmax denominator, a `softcap` is applied if a model
  passes one. An MLA layer's latents are written by the step's `past_key_values` (DeepSeek-V3
  hands the cache its latent before expanding it) and attended with the projections absorbed.
  On a host pool the attention is computed with torch in float64 from the pages (gathered
  through the tables), the same reads a paged kernel makes. On a CUDA pool the pages, K/V
  writes and state slots are in device memory (kvpool.integrations.hybrid_gpu); decode rows
  run kvpool's tensor-core decode (full and window groups, sinks) or paged_mla_decode where
  the group fits them, every other row the same gather in float32 on the GPU.
- `HybridTransformersRunner(model, pool)`: the model runner of `kvpool.generation.generate`
  (pass `spec=runner.spec`): continuous batching on HybridTables.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

import numpy as np
import torch
from transformers import AttentionInterface, DynamicCache

import kvpool
from kvpool._core import ModelKvSpec, Pool
from kvpool.generation.hybrid_batch import HybridGroupStep, HybridStepBatch
from kvpool.integrations.attention import TORCH_DTYPES, check_model, pool_device, take_active
from kvpool.integrations.hybrid_gpu import (
    GroupPool,
    decode_kernel_fits,
    device_slab,
    mla_kernel_fits,
    prefill_kernel_fits,
)
from kvpool.integrations.transformers import sample
from kvpool.kernels import mla_decode_plan

NAME = "kvpool_hybrid"
FULL, SLIDING, MLA = "full_attention", "sliding_attention", "mla"
# Models whose attention module hands the cache its MLA latent (`past_key_values.update(
# kv_nope, k_rot)` before kv_b_proj expands it), read in transformers 5.17's source.
MLA_MODELS = ("deepseek_v3",)
# Models whose "linear_attention" layers keep a Gated DeltaNet state (a conv state and a
# recurrent state per layer) in transformers' LinearAttentionLayer, read in 5.17's source.
STATE_MODELS = ("qwen3_next",)
LINEAR = "linear_attention"
SUPPORTED = (
    "decoder-only models whose layers are full attention or sliding-window attention "
    "(layer_types 'full_attention' / 'sliding_attention'; gpt-oss with its sinks, Gemma 3 text, "
    "the Llama family, Mistral's window on every layer), DeepSeek-V3's MLA and Qwen3-Next's "
    "Gated DeltaNet states, K/V in float16, bfloat16 or float32"
)


class UnsupportedModelError(kvpool.LayoutError):
    """A model (config) that kvpool's hybrid path cannot hold or attend; the message names
    what is unsupported."""


def _text_config(model_or_config: Any) -> Any:
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _dtype_name(model_or_config: Any, dtype: Any) -> str:
    if dtype is None and isinstance(model_or_config, torch.nn.Module):
        dtype = next(model_or_config.parameters()).dtype
    if dtype is None:
        dtype = getattr(_text_config(model_or_config), "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = TORCH_DTYPES.get(dtype, dtype)
    names = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
    if dtype not in names:
        raise UnsupportedModelError(
            f"K/V dtype {dtype} is not supported by the hybrid path; it holds {sorted(names.values())}"
        )
    return names[dtype]


def layer_kinds(model_or_config: Any) -> list[str]:
    """Per layer "full_attention", "sliding_attention" or "mla", or UnsupportedModelError
    naming the first thing kvpool's hybrid path does not run."""
    cfg = _text_config(model_or_config)
    name = getattr(cfg, "model_type", type(cfg).__name__)
    if getattr(cfg, "kv_lora_rank", None) is not None and name in MLA_MODELS:
        return [MLA] * int(cfg.num_hidden_layers)
    for attr, what in (
        ("kv_lora_rank", f"MLA attention (kv_lora_rank) of a model other than {MLA_MODELS}"),
        *(
            ()
            if name in STATE_MODELS
            else (("linear_num_value_heads", "linear-attention state layers (Gated DeltaNet)"),)
        ),
        ("attention_chunk_size", "chunked local attention (attention_chunk_size)"),
    ):
        if getattr(cfg, attr, None) is not None:
            raise UnsupportedModelError(f"{name}: {what} is not supported; kvpool runs {SUPPORTED}")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{name}: bidirectional attention (use_bidirectional_attention) is not supported"
        )
    n = int(cfg.num_hidden_layers)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        # Without layer_types a model's window applies to every layer (Mistral passes its
        # config's sliding_window to each); the attention checks each layer's kwarg anyway.
        w = getattr(cfg, "sliding_window", None)
        if w is None or not getattr(cfg, "use_sliding_window", True):
            return [FULL] * n
        types = [SLIDING] * n
    types = list(types)
    if len(types) != n:
        raise UnsupportedModelError(
            f"{name}: {len(types)} layer_types for {n} layers (num_hidden_layers)"
        )
    other = sorted(set(types) - {FULL, SLIDING, *((LINEAR,) if name in STATE_MODELS else ())})
    if other:
        raise UnsupportedModelError(
            f"{name}: layer types {other} are not supported; kvpool runs {SUPPORTED}"
        )
    if SLIDING in types:
        w = getattr(cfg, "sliding_window", None)
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise UnsupportedModelError(
                f"{name}: sliding_attention layers need a positive int sliding_window, got {w!r}"
            )
    return types


def spec_for_model(
    model_or_config: Any, *, dtype: Any = None, page_bytes: int | None = None
) -> ModelKvSpec:
    """The ModelKvSpec holding a transformers model's K/V: one full group (its
    "full_attention" layers) and one sliding-window group (its "sliding_attention" layers,
    window `sliding_window`), in the model's parameter dtype (a config: `dtype=` or the
    config's dtype, else float32). page_bytes: ModelKvSpec's default (16 tokens of the
    largest group) unless given. UnsupportedModelError for what the hybrid path cannot run."""
    cfg = _text_config(model_or_config)
    types = layer_kinds(cfg)
    dt = _dtype_name(model_or_config, dtype)
    if types[0] == MLA:  # one latent of kv_lora_rank + qk_rope_head_dim per token and layer
        group = kvpool.KvGroup.mla_latent(
            range(len(types)), int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim), dt
        )
        return kvpool.ModelKvSpec([group], page_bytes, num_layers=len(types))
    name = getattr(cfg, "model_type", type(cfg).__name__)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise UnsupportedModelError(
            f"{name}: {heads} query heads are not a multiple of {kv_heads} KV heads"
        )
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    groups = []
    linear = [i for i, t in enumerate(types) if t == LINEAR]
    if linear:
        groups.append(kvpool.KvGroup.recurrent_state(linear, state_layout(cfg, dt).nbytes))
    full = [i for i, t in enumerate(types) if t == FULL]
    sliding = [i for i, t in enumerate(types) if t == SLIDING]
    if full:
        groups.append(kvpool.KvGroup.full(full, kv_heads, head_dim, dt))
    if sliding:
        groups.append(
            kvpool.KvGroup.sliding_window(sliding, int(cfg.sliding_window), kv_heads, head_dim, dt)
        )
    return kvpool.ModelKvSpec(groups, page_bytes, num_layers=len(types))


class StateLayout(NamedTuple):
    """A Gated DeltaNet layer's state in its slot: the conv state [conv_dim, kernel] in the
    model's dtype, then the recurrent state [v_heads, k_dim, v_dim] in float32 (what the
    model's chunked and recurrent rules return), packed as bytes."""

    conv_shape: tuple[int, int]
    conv_dtype: torch.dtype
    recurrent_shape: tuple[int, int, int]

    @property
    def conv_bytes(self) -> int:
        n = self.conv_shape[0] * self.conv_shape[1]
        return n * torch.empty((), dtype=self.conv_dtype).element_size()

    @property
    def nbytes(self) -> int:
        h, k, v = self.recurrent_shape
        return self.conv_bytes + 4 * h * k * v


def state_layout(model_or_config: Any, dtype: str) -> StateLayout:
    """The state layout of a Qwen3-Next linear-attention layer (config fields
    linear_num_key_heads, linear_key_head_dim, linear_num_value_heads,
    linear_value_head_dim, linear_conv_kernel_dim)."""
    cfg = _text_config(model_or_config)
    key_dim = int(cfg.linear_num_key_heads) * int(cfg.linear_key_head_dim)
    value_dim = int(cfg.linear_num_value_heads) * int(cfg.linear_value_head_dim)
    return StateLayout(
        (2 * key_dim + value_dim, int(cfg.linear_conv_kernel_dim)),
        TORCH_DTYPES[dtype],
        (
            int(cfg.linear_num_value_heads),
            int(cfg.linear_key_head_dim),
            int(cfg.linear_value_head_dim),
        ),
    )


def check_spec(model: Any, spec: ModelKvSpec) -> None:
    """Raise LayoutError unless `spec` holds every layer of `model` as its attention reads
    it: a full layer in a full group, a window layer in a window group at least as wide
    (a wider window only keeps more pages), KV heads, head_dim and dtype equal."""
    want = spec_for_model(model)
    if spec.num_layers != want.num_layers:
        raise kvpool.LayoutError(
            f"the spec has {spec.num_layers} layers, the model {want.num_layers}"
        )
    for layer in range(want.num_layers):
        wg = want.groups[want.group_of_layer(layer)[0]]
        g = spec.groups[spec.group_of_layer(layer)[0]]
        shape = (g.num_kv_heads, g.head_dim, g.latent_dim, g.rope_dim, g.dtype, g.bytes_per_layer)
        wshape = (
            wg.num_kv_heads,
            wg.head_dim,
            wg.latent_dim,
            wg.rope_dim,
            wg.dtype,
            wg.bytes_per_layer,
        )
        if g.kind != wg.kind or shape != wshape or (g.window or 0) < (wg.window or 0):
            raise kvpool.LayoutError(
                f"layer {layer}: the spec holds it as {g!r}, the model needs {wg!r}"
            )


def register() -> None:
    """Make attn_implementation="kvpool_hybrid" available to every transformers model."""
    AttentionInterface.register(NAME, hybrid_attention)


class PageViews:
    """Typed torch views over a pool's pages (host or CUDA): per layer its K and V as
    [num_pages, block_size, kv_heads, head_dim] with the page stride (hybrid.md's page
    scheme: [layer][K|V][token][kv_head][head_dim] inside each page). A pool made by
    Pool.for_spec has no KvLayout and so no k_view; the slab is read through its address
    (host memory through ctypes, device memory through __cuda_array_interface__), which the
    view keeps alive by holding the pool."""

    def __init__(self, pool: Pool, spec: ModelKvSpec) -> None:
        if pool.growable:
            raise kvpool.InvalidArgumentError("the hybrid attention needs a pool of fixed size")
        if pool.block_bytes != spec.page_bytes:
            raise kvpool.LayoutError(
                f"the pool's blocks are {pool.block_bytes} bytes, the spec's pages "
                f"{spec.page_bytes}"
            )
        self.pool, self.spec = pool, spec
        self.device = pool_device(pool)
        if self.device.type == "cuda":
            self.slab = device_slab(pool, self.device)
        else:
            n = pool.num_blocks * spec.page_bytes
            buf = (ctypes.c_uint8 * n).from_address(pool.base_ptr)
            self.slab = torch.frombuffer(buf, dtype=torch.uint8)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._latents: dict[int, torch.Tensor] = {}

    def state_segments(self, layer: int, slot: np.ndarray, nbytes: int) -> list[tuple[int, int]]:
        """(slab offset, length) of the byte runs holding `nbytes` of a state layer's bytes
        in the slot `slot` (its page ids): a layer's bytes run in order over its pages,
        split at page boundaries (ModelKvSpec.state_location)."""
        g, index = self.spec.group_of_layer(layer)
        runs, at, page_bytes = [], 0, self.spec.page_bytes
        while at < nbytes:
            page, off = self.spec.state_location(g, index, at)
            take = min(nbytes - at, page_bytes - off)
            runs.append((int(slot[page]) * page_bytes + off, take))
            at += take
        return runs

    def read_state(self, layer: int, slot: np.ndarray, nbytes: int) -> torch.Tensor:
        """A copy of a state layer's bytes (uint8 [nbytes]) from its slot."""
        runs = self.state_segments(layer, slot, nbytes)
        return torch.cat([self.slab[o : o + n] for o, n in runs])

    def write_state(self, layer: int, slot: np.ndarray, data: torch.Tensor) -> None:
        """A state layer's bytes (uint8) into its slot."""
        at = 0
        for o, n in self.state_segments(layer, slot, int(data.numel())):
            self.slab[o : o + n] = data[at : at + n]
            at += n

    def latent(self, layer: int) -> torch.Tensor:
        """An MLA layer's latents [num_pages, block_size, latent_dim + rope_dim] (the page
        scheme's [layer][token][latent | rope])."""
        view = self._latents.get(layer)
        if view is None:
            g, index = self.spec.group_of_layer(layer)
            group = self.spec.groups[g]
            dtype = TORCH_DTYPES[group.dtype]  # type: ignore[index]
            elem = torch.empty((), dtype=dtype).element_size()
            width = int(group.latent_dim) + int(group.rope_dim)  # type: ignore[arg-type]
            bs = int(self.spec.block_size(g))  # type: ignore[arg-type]
            off = self.spec.latent_offset_bytes(g, 0, index, 0, 0)
            view = self.slab.view(dtype).as_strided(
                (self.pool.num_blocks, bs, width),
                (self.spec.page_bytes // elem, width, 1),
                off // elem,
            )
            self._latents[layer] = view
        return view

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._views.get(layer)
        if kv is None:
            g, index = self.spec.group_of_layer(layer)
            group = self.spec.groups[g]
            dtype = TORCH_DTYPES[group.dtype]  # type: ignore[index]
            elem = torch.empty((), dtype=dtype).element_size()
            heads, dim = int(group.num_kv_heads), int(group.head_dim)  # type: ignore[arg-type]
            bs = int(self.spec.block_size(g))  # type: ignore[arg-type]
            typed = self.slab.view(dtype)
            size = (self.pool.num_blocks, bs, heads, dim)
            stride = (self.spec.page_bytes // elem, heads * dim, dim, 1)
            parts = []
            for part in ("k", "v"):
                off = self.spec.attention_offset_bytes(g, 0, index, part, 0, 0, 0)
                parts.append(typed.as_strided(size, stride, off // elem))
            kv = self._views[layer] = (parts[0], parts[1])
        return kv


def check_keys_held(gs: HybridGroupStep, batch: HybridStepBatch, window: int | None) -> None:
    """InvalidArgumentError unless every key each packed row attends to (the last `window`
    keys, or all) lies in the pages its table holds: a wider window than the group's would
    read a page the table gave back."""
    seq = batch.token_seq
    first_needed = np.zeros(len(seq), np.int64)
    if window is not None:
        first_needed = np.maximum(batch.positions - window + 1, 0)
    missing = first_needed < gs.key_start[seq]
    if missing.any():
        t = int(np.flatnonzero(missing)[0])
        raise kvpool.InvalidArgumentError(
            f"request {int(batch.seq_request_ids[seq[t]])} group {gs.group}: the query at "
            f"{int(batch.positions[t])} needs the key at {int(first_needed[t])}, but its "
            f"table holds keys from {int(gs.key_start[seq[t]])} on"
        )


class _GroupGather:
    """Per token group and window, the keys each packed row reads: [num_tokens, num_keys]
    page ids and offsets into the group's pages, and which of them the row attends to."""

    def __init__(
        self, gs: HybridGroupStep, batch: HybridStepBatch, window: int | None, device: torch.device
    ) -> None:
        check_keys_held(gs, batch, window)
        bs, seq = gs.block_size, batch.token_seq
        num_keys = gs.page_ids.shape[1] * bs
        key = np.arange(num_keys, dtype=np.int64)
        pos = gs.key_start[seq][:, None] + key[None, :]  # the position of each key slot
        q = batch.positions[:, None]
        seen = (pos < gs.key_end[seq][:, None]) & (pos <= q)
        if window is not None:
            seen &= pos > q - window
        pages = gs.page_ids[seq][:, key // bs]
        self.pages = torch.from_numpy(np.where(seen, pages, 0)).to(device)
        self.offsets = torch.from_numpy(np.broadcast_to(key % bs, pages.shape).copy()).to(device)
        self.seen = torch.from_numpy(seen).to(device)


class HybridStep:
    """One packed step of a hybrid model on a host or CUDA pool: its batch, the page views,
    the per-group gathers and (CUDA) the decode rows' kernel plans, made once and shared by
    every layer.

    On the host every row is attended in float64 from the gathered pages (the reference).
    On a CUDA pool the decode rows of a full or window group run kvpool's tensor-core decode
    (sinks included) over the group's table, and those of DeepSeek-V3's MLA group
    `paged_mla_decode`, where the group fits them (hybrid_gpu.decode_kernel_fits,
    mla_kernel_fits); the other rows (prefill chunks, float32 models, softcapped scores) take
    the same gather in float32 on the GPU."""

    # Tests set this to run the decode rows through the same plans on a host pool, whose
    # runs are the kernels' float64 references: the plans' wiring checked without a GPU.
    plans_on_host = False

    def __init__(self, views: PageViews, batch: HybridStepBatch, device: torch.device) -> None:
        self.views, self.batch, self.device = views, batch, device
        self.spec = views.spec
        self.cuda = device.type == "cuda"
        self.use_plans = self.cuda or self.plans_on_host
        # float64 is the host's reference; on the GPU float64 runs at a small fraction of
        # float32's rate, and float32 sums of float32 / 16-bit products are what kernels do.
        self.compute_dtype = torch.float32 if self.cuda else torch.float64
        self._gathers: dict[tuple[int, int | None], _GroupGather] = {}
        self._checked: set[tuple[int, int | None]] = set()
        self._plans: dict[tuple[Any, ...], Any] = {}
        self._decode_tables: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}
        self._slots = {
            gs.group: (
                torch.from_numpy(gs.slot_pages).to(device),
                torch.from_numpy(gs.slot_offsets).to(device),
            )
            for gs in batch.groups
        }

    def check(self, group: int, window: int | None) -> None:
        """check_keys_held for `group` and `window`, once per step."""
        if (group, window) not in self._checked:
            check_keys_held(self.batch.group(group), self.batch, window)
            self._checked.add((group, window))

    def gather(self, group: int, window: int | None) -> _GroupGather:
        g = self._gathers.get((group, window))
        if g is None:
            g = self._gathers[group, window] = _GroupGather(
                self.batch.group(group), self.batch, window, self.device
            )
        return g

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, kv_heads, head_dim] into the layer's pages at the step's slots."""
        kc, vc = self.views.layer(layer)
        pages, offsets = self._slots[self.spec.group_of_layer(layer)[0]]
        kc[pages, offsets] = k.to(kc.dtype)
        vc[pages, offsets] = v.to(vc.dtype)

    def write_latent(self, layer: int, latent: torch.Tensor) -> None:
        """latent: [num_tokens, latent_dim + rope_dim] into the MLA layer's pages."""
        view = self.views.latent(layer)
        pages, offsets = self._slots[self.spec.group_of_layer(layer)[0]]
        view[pages, offsets] = latent.to(view.dtype)

    # -- the decode rows' kernels (CUDA) ------------------------------------------------------

    def kernel_rows(self, group: int, softcap: float | None = None) -> int:
        """How many leading rows (the decode rows) run a kvpool kernel for `group`: 0 on a
        host pool (unless plans_on_host), for a group the kernels do not fit, or with a
        softcap (no kernel takes one)."""
        if not self.use_plans or not self.batch.num_decode or softcap is not None:
            return 0
        g = self.spec.groups[group]
        if g.kind == "mla_latent":
            fits = mla_kernel_fits(g)
        else:
            fits = decode_kernel_fits(g, int(self.spec.block_size(group)))  # type: ignore[arg-type]
        return self.batch.num_decode if fits else 0

    def decode_tables(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The decode rows' (block tables int32 [num_decode, width], seq_lens int32, first
        page int32, the longest seq_len) for `group`, on the device: a decode row is a
        sequence of one token whose K/V the layer wrote before it attends, so its seq_len is
        its table's key_end."""
        t = self._decode_tables.get(group)
        if t is None:
            gs, nd = self.batch.group(group), self.batch.num_decode
            dev = self.device
            tables = torch.from_numpy(gs.page_ids[:nd].astype(np.int32)).to(dev)
            lens = torch.from_numpy(gs.key_end[:nd].astype(np.int32)).to(dev)
            first = torch.from_numpy((gs.key_start[:nd] // gs.block_size).astype(np.int32))
            t = (tables, lens, first.to(dev), int(gs.key_end[:nd].max()))
            self._decode_tables[group] = t
        return t

    def _decode_plan(self, group: int, window: int | None, scale: float, num_q_heads: int):
        key = ("decode", group, window, scale, num_q_heads)
        plan = self._plans.get(key)
        if plan is None:
            tables, lens, first, longest = self.decode_tables(group)
            plan = self._plans[key] = kvpool.decode_plan(
                GroupPool(self.views.pool, self.spec, group, self.views),
                tables,
                lens,
                num_q_heads,
                max_seq_len=longest if self.cuda else None,
                scale=scale,
                stream=torch.cuda.current_stream(self.device) if self.cuda else None,
                window=window,
                first_page=None if self.spec.groups[group].kind == "full" else first,
            )
        return plan

    def _mla_plan(self, group: int, scale: float, num_heads: int):
        key = ("mla", group, scale, num_heads)
        plan = self._plans.get(key)
        if plan is None:
            tables, lens, _, longest = self.decode_tables(group)
            plan = self._plans[key] = mla_decode_plan(
                self.views.pool,
                self.spec,
                group,
                tables,
                lens,
                num_heads,
                scale=scale,
                max_seq_len=longest if self.cuda else None,
                stream=torch.cuda.current_stream(self.device) if self.cuda else None,
            )
        return plan

    # -- attention ----------------------------------------------------------------------------

    def attend_mla(self, module: Any, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Absorbed MLA of q [num_tokens, heads, nope + rope] over the layer's cached
        latents: the query's nope part is taken into the latent space through kv_b_proj's K
        half, scores are q_latent . latent + q_rope . k_rope, and the output leaves the
        latent space through kv_b_proj's V half. [num_tokens, heads, v_head_dim]. The decode
        rows run paged_mla_decode where it fits (kernel_rows), the rest the gather."""
        group = self.spec.group_of_layer(layer)[0]
        t, h, _ = q.shape
        nope, rank = int(module.qk_nope_head_dim), int(module.kv_lora_rank)
        cd = self.compute_dtype
        w = module.kv_b_proj.weight.to(cd).view(h, nope + int(module.v_head_dim), rank)
        w_k, w_v = w[:, :nope], w[:, nope:]  # [H, nope, rank], [H, v, rank]
        qd = q.to(cd)
        q_lat = torch.einsum("thn,hnc->thc", qd[..., :nope], w_k)
        o_lat = torch.empty((t, h, rank), dtype=cd, device=q.device)
        nd = self.kernel_rows(group)
        if nd:
            plan = self._mla_plan(group, scale, h)
            o16 = plan.run(
                q_lat[:nd].to(q.dtype).contiguous(), q[:nd, :, nope:].contiguous(), layer
            )
            o_lat[:nd] = torch.as_tensor(o16).to(device=q.device, dtype=cd)
        if nd < t:
            view = self.views.latent(layer)
            gat = self.gather(group, None)
            pages, offsets, seen = gat.pages[nd:], gat.offsets[nd:], gat.seen[nd:]
            lat = view[pages, offsets].to(cd)  # [T, L, rank + rope]
            c, k_rope = lat[..., :rank], lat[..., rank:]
            s = torch.einsum("thc,tlc->thl", q_lat[nd:], c) + torch.einsum(
                "thr,tlr->thl", qd[nd:, :, nope:], k_rope
            )
            s = (s * scale).masked_fill(~seen[:, None, :], float("-inf"))
            p = torch.softmax(s, dim=-1)
            o_lat[nd:] = torch.einsum("thl,tlc->thc", p, c)
        return torch.einsum("thc,hvc->thv", o_lat, w_v).to(q.dtype)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        window: int | None,
        scale: float,
        sinks: torch.Tensor | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """Attention [num_tokens, q_heads, D] of q [num_tokens, q_heads, D] over the keys the
        layer's group holds: causal, the last `window` keys on a window layer, the sinks'
        logits in the denominator. The decode rows run kvpool's decode kernel and the
        prefill chunks its prefill kernel where the group fits them (kernel_rows,
        prefill_kernel), other rows the gather."""
        group, index = self.spec.group_of_layer(layer)
        t, nd = q.shape[0], self.batch.num_decode
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        sinks32 = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
        if self.kernel_rows(group, softcap):
            plan = self._decode_plan(group, window, scale, q.shape[1])
            self._run(plan, q, out, 0, nd, index, sinks32)
        elif nd:
            out[:nd] = self._attend_gathered(layer, q[:nd], window, scale, sinks, softcap, 0)
        if nd == t:
            return out
        if self.prefill_kernel(group, softcap):
            plan = self._prefill_plan(group, window, scale, q.shape[1], sinks is not None)
            self._run(plan, q, out, nd, t, index, sinks32)
        else:
            out[nd:] = self._attend_gathered(layer, q[nd:], window, scale, sinks, softcap, nd)
        return out

    def _run(self, plan, q, out, lo: int, hi: int, index: int, sinks) -> None:
        """A decode or prefill plan over rows lo..hi into out (on the host: the plan's float64
        reference, plans_on_host)."""
        rows = q[lo:hi].contiguous()
        if self.cuda:
            plan.run(rows, index, out=out[lo:hi], sinks=sinks)
        else:
            out[lo:hi] = torch.as_tensor(plan.run(rows, index, sinks=sinks))

    def prefill_kernel(self, group: int, softcap: float | None = None) -> bool:
        """Whether the step's prefill chunks run kvpool's prefill kernel for `group`
        (hybrid_gpu.prefill_kernel_fits; never with a softcap)."""
        if not self.use_plans or softcap is not None:
            return False
        g = self.spec.groups[group]
        if g.kind not in ("full", "sliding_window"):
            return False
        return prefill_kernel_fits(g, int(self.spec.block_size(group)))  # type: ignore[arg-type]

    def _prefill_plan(
        self, group: int, window: int | None, scale: float, num_q_heads: int, use_sinks: bool
    ):
        key = ("prefill", group, window, scale, num_q_heads, use_sinks)
        plan = self._plans.get(key)
        if plan is None:
            gs, nd, b = self.batch.group(group), self.batch.num_decode, self.batch
            indptr = (b.seq_indptr[nd:] - b.seq_indptr[nd]).astype(np.int32)
            tables = torch.from_numpy(gs.page_ids[nd:].astype(np.int32)).to(self.device)
            first = torch.from_numpy((gs.key_start[nd:] // gs.block_size).astype(np.int32))
            plan = self._plans[key] = kvpool.prefill_plan(
                GroupPool(self.views.pool, self.spec, group, self.views),
                indptr,
                tables,
                gs.key_end[nd:].astype(np.int32),
                num_q_heads,
                scale=scale,
                stream=torch.cuda.current_stream(self.device) if self.cuda else None,
                window=window,
                first_page=None
                if self.spec.groups[group].kind == "full"
                else first.to(self.device),
                use_sinks=use_sinks,
            )
        return plan

    def _attend_gathered(
        self,
        layer: int,
        q: torch.Tensor,
        window: int | None,
        scale: float,
        sinks: torch.Tensor | None,
        softcap: float | None,
        first_row: int,
    ) -> torch.Tensor:
        """The gather path for the step's rows first_row .. first_row + len(q) (q holds those
        rows): the keys of each row's table read from the pages, in compute_dtype."""
        kc, vc = self.views.layer(layer)
        gat = self.gather(self.spec.group_of_layer(layer)[0], window)
        t, hq, d = q.shape
        rows = slice(first_row, first_row + t)
        pages, offsets, seen = gat.pages[rows], gat.offsets[rows], gat.seen[rows]
        hkv = kc.shape[2]
        cd = self.compute_dtype
        keys = kc[pages, offsets].to(cd)  # [T, L, Hkv, D]
        vals = vc[pages, offsets].to(cd)
        qf = q.to(cd).reshape(t, hkv, hq // hkv, d)  # query head h reads KV head h // G
        s = torch.einsum("thgd,tlhd->thgl", qf, keys) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~seen[:, None, None, :], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        if sinks is not None:
            sink = sinks.to(cd).reshape(1, hkv, hq // hkv, 1)
            m = torch.maximum(m, sink)
        p = torch.exp(s - m)
        den = p.sum(dim=-1, keepdim=True)
        if sinks is not None:
            den = den + torch.exp(sink - m)
        o = torch.einsum("thgl,tlhd->thgd", p / den, vals)
        return o.reshape(t, hq, d).to(q.dtype)


def hybrid_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    softcap: float | None = None,
    kvpool_hybrid_step: HybridStep | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function of a packed step: query [1, q_heads, T, D], key/value
    [1, kv_heads, T, D]; returns ([1, T, q_heads, D], None). The attention mask transformers
    built is not read: the step's positions and tables say what each row sees."""
    layer = int(module.layer_idx)  # type: ignore[arg-type]  # an int on every attention module
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    how = Attention(scale, sliding_window, s_aux, softcap)
    step = kvpool_hybrid_step
    if step is None:
        cache: Any = take_active(layer)  # a HybridKvpoolCache (hybrid_cache imports this module)
        if cache is None or not hasattr(cache, "attend_hybrid"):
            raise kvpool.InvalidArgumentError(
                "attn_implementation='kvpool_hybrid' needs a hybrid step: run the model through "
                "kvpool.integrations.hybrid_models.HybridTransformersRunner, or pass "
                "past_key_values=kvpool.integrations.hybrid_cache.HybridKvpoolCache(...)"
            )
        if cache.layer_kinds[layer] == "mla_latent":  # its latents came through update
            return cache.attend_mla(module, layer, query, scale), None
        out = cache.attend_hybrid(layer, query, key, value, how, kwargs.get("position_ids"))
        return out, None
    if query.shape[0] != 1:
        raise kvpool.InvalidArgumentError(
            f"kvpool_hybrid attention takes a packed batch [1, num_tokens], got {query.shape[0]}"
        )
    if step.spec.groups[step.spec.group_of_layer(layer)[0]].kind == "mla_latent":
        # The latents were written by the step's cache (update); key / value are the
        # model's expansion of this step's latents only, and are not read.
        return step.attend_mla(module, layer, query[0].transpose(0, 1), scale)[None], None
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    return attend_packed(step, layer, q, k, v, how)[None], None


class _StepStates(DynamicCache):
    """transformers' own cache for one sequence of a model with state layers: its
    LinearAttentionLayers hold the states for the forward (loaded from and stored back to
    kvpool's slots by the runner); an attention layer's update hands back the step's K/V
    unchanged (the kvpool_hybrid attention keeps them in the pages)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states


class _LatentWriter:
    """The `past_key_values` of an MLA model's packed step: DeepSeek-V3's attention hands
    the cache its latent (`update(kv_nope, k_rope, layer)`, [1, 1, T, rank] and [1, 1, T,
    rope]) before kv_b_proj expands it; this writes it into the step's MLA pages and hands
    the step's own latents back (the kvpool_hybrid attention reads the pages)."""

    def __init__(self, step: HybridStep) -> None:
        self.step = step

    def update(self, kv_nope, k_rope, layer_idx, *args, **kwargs):
        latent = torch.cat([kv_nope[0, 0], k_rope[0, 0]], dim=-1)
        self.step.write_latent(int(layer_idx), latent)
        return kv_nope, k_rope

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class Attention(NamedTuple):
    """What a layer's attention module asked for: the score scale, the window (None on a
    full layer), the sinks (one logit per query head) and the score softcap."""

    scale: float
    window: int | None
    sinks: torch.Tensor | None
    softcap: float | None


def attend_packed(
    step: HybridStep, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, how: Attention
) -> torch.Tensor:
    """One layer of a packed step: q [num_tokens, q_heads, D], k/v [num_tokens, kv_heads, D].
    Writes k/v into the layer's pages; returns the attention [num_tokens, q_heads, D]."""
    group = step.spec.groups[step.spec.group_of_layer(layer)[0]]
    if (how.window is None) != (group.kind == "full"):
        raise kvpool.LayoutError(
            f"layer {layer} attends with sliding_window={how.window} but the spec holds it "
            f"in a {group.kind} group"
        )
    step.check(step.spec.group_of_layer(layer)[0], how.window)  # before any write
    step.write(layer, k, v)
    return step.attend(layer, q, how.window, how.scale, how.sinks, how.softcap)


class attention_as:
    """A context in which `model` (every model sharing its config) attends with `name`; the
    previous implementation comes back on exit, also when the forward raises."""

    def __init__(self, model: Any, name: str = NAME) -> None:
        self.config, self.name = model.config, name

    def __enter__(self) -> None:
        self.previous = self.config._attn_implementation
        self.config._attn_implementation = self.name

    def __exit__(self, *exc: object) -> None:
        self.config._attn_implementation = self.previous


def lm_logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits of hidden states as the model's head makes them (lm_head, then
    final_logit_softcapping where the config has one, as Gemma's)."""
    logits = model.lm_head(hidden)
    cap = getattr(_text_config(model), "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


class HybridTransformersRunner:
    """A kvpool.generation ModelRunner over a hybrid transformers causal LM (SUPPORTED) on a
    pool of the spec's pages on the model's device (`kvpool.Pool.for_spec(runner.spec, n,
    device="host")` for a model on the CPU, `device="cuda"` for one on the GPU).
    spec defaults to spec_for_model(model); a given one must hold the model (check_spec).
    The model attends with "kvpool_hybrid" only inside the runner's forwards. With CUDA
    graphs of the decode step: kvpool.integrations.hybrid_graphs.HybridGraphsRunner."""

    def __init__(self, model: Any, pool: Pool, spec: ModelKvSpec | None = None) -> None:
        check_model(model)
        self.spec = spec_for_model(model) if spec is None else spec
        check_spec(model, self.spec)
        self.views = PageViews(pool, self.spec)
        device = next(model.parameters()).device
        if device.type != self.views.device.type or (
            device.type == "cuda" and device.index not in (None, self.views.device.index)
        ):
            raise kvpool.InvalidArgumentError(
                f"the model is on {device} but the pool on {self.views.device}"
            )
        device = self.views.device
        register()
        self.model, self.pool, self.device = model, pool, device
        self.state_layers = [
            layer for g in self.spec.groups if g.kind == "recurrent_state" for layer in g.layers
        ]
        self.state = state_layout(model, _dtype_name(model, None)) if self.state_layers else None

    @torch.inference_mode()
    def hidden(self, batch: HybridStepBatch) -> torch.Tensor:
        """Last hidden states [num_tokens, hidden] of one packed step (writes the step's KV)."""
        if not isinstance(batch, HybridStepBatch):
            raise TypeError(f"a hybrid runner runs a HybridStepBatch, not {type(batch).__name__}")
        if self.state_layers:
            # A Gated DeltaNet layer runs its recurrence over the whole [1, T] row: packed
            # sequences would flow into each other's state, so each sequence runs alone.
            rows = [self._hidden_alone(batch.select(k)) for k in range(batch.num_seqs)]
            return torch.cat(rows)
        step = HybridStep(self.views, batch, self.device)
        ids = torch.from_numpy(batch.input_ids)[None].to(self.device)
        pos = torch.from_numpy(batch.positions)[None].to(self.device)
        mla = self.spec.groups[0].kind == "mla_latent"
        with attention_as(self.model):
            out = self.model.model(
                input_ids=ids,
                position_ids=pos,
                use_cache=mla,
                past_key_values=_LatentWriter(step) if mla else None,
                kvpool_hybrid_step=step,
            )
        return out.last_hidden_state[0]

    def _hidden_alone(self, seq: HybridStepBatch) -> torch.Tensor:
        """One sequence of a model with state layers: its states are loaded from its slots
        into transformers' own LinearAttentionLayers (a continuing sequence; a sequence at
        position 0 starts from none), the model runs, and the states go back to the slots."""
        lay, spec = self.state, self.spec
        assert lay is not None
        step = HybridStep(self.views, seq, self.device)
        states = _StepStates(config=self.model.config)
        slots = {s.group: s.slots[0] for s in seq.states}
        if int(seq.positions[0]) > 0:
            for layer in self.state_layers:
                raw = self.views.read_state(layer, slots[spec.group_of_layer(layer)[0]], lay.nbytes)
                conv = raw[: lay.conv_bytes].clone().view(lay.conv_dtype).view(lay.conv_shape)
                rec = raw[lay.conv_bytes :].clone().view(torch.float32).view(lay.recurrent_shape)
                cache_layer = states.layers[layer]
                cache_layer.lazy_initialization(
                    conv_states=conv[None],
                    recurrent_states=rec[None],
                    conv_kernel_size=lay.conv_shape[1],
                )
                cache_layer.conv_states[0].copy_(conv[None])
                cache_layer.recurrent_states[0].copy_(rec[None])
                cache_layer.has_previous_state[0] = True
        ids = torch.from_numpy(seq.input_ids)[None].to(self.device)
        pos = torch.from_numpy(seq.positions)[None].to(self.device)
        with attention_as(self.model):
            out = self.model.model(
                input_ids=ids,
                position_ids=pos,
                use_cache=True,
                past_key_values=states,
                kvpool_hybrid_step=step,
            )
        for layer in self.state_layers:
            cache_layer = states.layers[layer]
            conv = cache_layer.conv_states[0][0].to(lay.conv_dtype).contiguous()
            rec = cache_layer.recurrent_states[0][0].to(torch.float32).contiguous()
            if tuple(conv.shape) != lay.conv_shape or tuple(rec.shape) != lay.recurrent_shape:
                raise kvpool.LayoutError(
                    f"layer {layer}: the model's state is conv {tuple(conv.shape)}, recurrent "
                    f"{tuple(rec.shape)}; its slot holds {lay.conv_shape}, {lay.recurrent_shape}"
                )
            data = torch.cat([conv.view(-1).view(torch.uint8), rec.view(-1).view(torch.uint8)])
            self.views.write_state(layer, slots[spec.group_of_layer(layer)[0]], data)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def logits(self, batch: HybridStepBatch) -> torch.Tensor:
        """float32 logits [num_tokens, vocab] of every token of the step."""
        return lm_logits(self.model, self.hidden(batch))

    @torch.inference_mode()
    def run(self, batch: HybridStepBatch) -> np.ndarray:
        rows = torch.from_numpy(batch.sample_rows).to(self.device)
        logits = lm_logits(self.model, self.hidden(batch)[rows])
        return sample(logits, batch.temperatures, batch.seeds, batch.sample_positions).cpu().numpy()


__all__ = [
    "NAME",
    "SUPPORTED",
    "Attention",
    "HybridStep",
    "HybridTransformersRunner",
    "PageViews",
    "UnsupportedModelError",
    "attend_packed",
    "check_spec",
    "hybrid_attention",
    "layer_kinds",
    "lm_logits",
    "register",
    "spec_for_model",
]
