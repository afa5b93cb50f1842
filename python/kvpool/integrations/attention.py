"""The "kvpool" attention of transformers models over a kvpool pool (optional extra
`kvpool[transformers]`): a step's paged metadata on the model's device (`KvpoolStep`), the
per-layer write, decode and prefill attention over the pool, the attention function that
transformers calls (`kvpool_attention`, registered by `register()`), and the pool layout a
model needs (`layout_for`, `check_layout`).

Two callers run it: transformers.TransformersRunner (a packed step: `kvpool_step=` reaches the
attention function through the forward) and hf_cache.KvpoolCache (plain `model.generate`: the
cache records itself with `set_active` when transformers updates a layer, and the attention of
that layer takes it). Both import this module; it imports neither.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np
import torch
from transformers import AttentionInterface

import kvpool
from kvpool._core import KvLayout, Pool
from kvpool.generation.batch import StepBatch

NAME = "kvpool"
TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def pool_device(pool: Pool) -> torch.device:
    """The torch device of a pool ("cpu" for a host pool)."""
    d = str(pool.device)
    return (
        torch.device(d if ":" in d else "cuda:0") if d.startswith("cuda") else torch.device("cpu")
    )


def register() -> None:
    """Make attn_implementation="kvpool" available to every transformers model."""
    AttentionInterface.register(NAME, kvpool_attention)


def pool_layer(pool: Pool, layer: int, part: str) -> torch.Tensor:
    """Zero-copy torch tensor [num_blocks, block_size, kv_heads, head_dim] of the pool's
    dtype over one layer's K ("k") or V ("v"): DLPack carries bfloat16 and float8 as
    themselves, from a CUDA view and from a host pool's array view alike."""
    v = pool.k_view(layer) if part == "k" else pool.v_view(layer)
    return torch.from_dlpack(v)


def step_arrays(batch: StepBatch) -> list[np.ndarray]:
    """The host arrays a CUDA step uploads, in KvpoolStep's order after (input_ids, positions)."""
    return [
        batch.input_ids,
        batch.positions,
        batch.slot_mapping,
        batch.decode_block_table,
        batch.decode_seq_lens,
        batch.prefill_qo_indptr,
        batch.prefill_block_table,
        batch.prefill_seq_lens,
    ]


class KvpoolStep:
    """One step's paged metadata on the model's device, built once per forward and shared by
    every layer. `device_arrays` are the CUDA copies of (slot_mapping, decode_block_table,
    decode_seq_lens, prefill_qo_indptr, prefill_block_table, prefill_seq_lens); a captured
    decode step also fixes the decode plan: max_seq_len (a bound), num_splits and workspace."""

    def __init__(
        self,
        pool: Pool,
        batch: StepBatch,
        device: torch.device,
        prefill: str = "kernel",
        device_arrays: list[torch.Tensor] | None = None,
        *,
        max_seq_len: int | None = None,
        num_splits: int | None = None,
        workspace: torch.Tensor | None = None,
    ) -> None:
        self.pool, self.batch, self.device = pool, batch, device
        self.prefill = PREFILL[prefill]
        self._plans: dict[tuple[str, float], Any] = {}  # the step's kernel plans, per scale
        self.cuda = device.type == "cuda"
        self.num_decode = batch.num_decode
        self.block_size = pool.layout.block_size
        self.num_splits, self.workspace = num_splits, workspace
        if self.cuda:
            if device_arrays is None:
                raise ValueError("a CUDA step needs its metadata on the device (device_arrays)")
            (
                self.slot_mapping,
                self.decode_block_table,
                self.decode_seq_lens,
                self.qo_indptr,
                self.prefill_block_table,
                self.prefill_seq_lens,
            ) = device_arrays
            if max_seq_len is None:
                max_seq_len = int(batch.decode_seq_lens.max()) if batch.num_decode else 0
            self.max_decode_len = max_seq_len
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._views.get(layer)
        if kv is None:
            kv = self._views[layer] = (
                pool_layer(self.pool, layer, "k"),
                pool_layer(self.pool, layer, "v"),
            )
        return kv

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, kv_heads, head_dim] into the pool at the step's slots."""
        if self.cuda:
            kvpool.append_kv(
                k,
                v,
                self.pool,
                layer,
                self.slot_mapping,
                stream=torch.cuda.current_stream(self.device),
            )
        else:  # CPU tensors are read as NumPy views of their bits (bfloat16 included)
            kvpool.append_kv(k, v, self.pool, layer, self.batch.slot_mapping)

    def decode(self, layer: int, q: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """Attention of the decode rows q[:num_decode] ([n, q_heads, head_dim]) into out."""
        n, b = self.num_decode, self.batch
        plan = self._plans.get(("decode", scale))
        if plan is None:
            if self.cuda:
                plan = kvpool.decode_plan(
                    self.pool,
                    self.decode_block_table,
                    self.decode_seq_lens,
                    q.shape[1],
                    max_seq_len=self.max_decode_len,
                    num_splits=self.num_splits,
                    scale=scale,
                    stream=torch.cuda.current_stream(self.device),
                    workspace=self.workspace,
                )
            else:
                plan = kvpool.decode_plan(
                    self.pool, b.decode_block_table, b.decode_seq_lens, q.shape[1], scale=scale
                )
            self._plans["decode", scale] = plan
        if self.cuda:
            plan.run(q[:n], layer, out=out[:n])
        else:  # the float64 reference; a tensor of q's dtype back
            out[:n] = plan.run(q[:n], layer)


def prefill_kernel(
    step: KvpoolStep, layer: int, q: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """Causal attention of every prefill chunk over its cached prefix and itself with
    kvpool's prefill kernel (one launch per layer; the plan is made once per step)."""
    b, n0 = step.batch, step.num_decode
    if b.num_prefill == 0:
        return
    plan = step._plans.get(("prefill", scale))
    if plan is None:
        tables = step.prefill_block_table if step.cuda else b.prefill_block_table
        stream = torch.cuda.current_stream(step.device) if step.cuda else None
        plan = step._plans["prefill", scale] = kvpool.prefill_plan(
            step.pool,
            b.prefill_qo_indptr,
            tables,
            b.prefill_seq_lens,
            q.shape[1],
            scale=scale,
            stream=stream,
        )
    if step.cuda:
        plan.run(q[n0:], layer, out=out[n0:])
    else:
        out[n0:] = plan.run(q[n0:], layer)


def prefill_sdpa(
    step: KvpoolStep, layer: int, q: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """The same attention with torch SDPA over K/V gathered from the pool's blocks, one chunk
    at a time: the cross-check of the kernel and a fallback (`prefill="sdpa"`)."""
    b = step.batch
    if b.num_prefill == 0:
        return
    kc, vc = step.kv_cache(layer)
    bs, n0 = step.block_size, step.num_decode
    ptr, lens = b.prefill_qo_indptr.tolist(), b.prefill_seq_lens.tolist()
    table = torch.from_numpy(b.prefill_block_table).to(q.device, non_blocking=True).long()
    for i in range(b.num_prefill):
        lo, hi, total = n0 + ptr[i], n0 + ptr[i + 1], lens[i]
        rows = torch.arange(total, device=q.device)
        blocks = table[i][rows // bs]
        k = kc[blocks, rows % bs].transpose(0, 1)  # [kv_heads, total, head_dim]
        v = vc[blocks, rows % bs].transpose(0, 1)
        qi = q[lo:hi].transpose(0, 1)  # [q_heads, n, head_dim]
        start = total - (hi - lo)
        mask = rows[None, :] <= (start + torch.arange(hi - lo, device=q.device))[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            qi[None],
            k[None].to(q.dtype),
            v[None].to(q.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[lo:hi] = o[0].transpose(0, 1)


def attend_packed(
    step: KvpoolStep, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One layer of a packed step: q [num_tokens, q_heads, D], k/v [num_tokens, kv_heads, D]
    (decode rows first). Writes k/v into the pool; returns the attention [num_tokens,
    q_heads, D]."""
    step.write(layer, k, v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if step.num_decode:
        step.decode(layer, q, scale, out)
    step.prefill(step, layer, q, scale, out)
    return out


class _CacheAttention(Protocol):
    """What the attention function asks of a cache that ran its layer's update
    (hf_cache.KvpoolCache)."""

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        position_ids: Any,
    ) -> torch.Tensor: ...


_ACTIVE = threading.local()  # .entry: (cache, layer) of the last update on this thread


def set_active(cache: _CacheAttention, layer_idx: int) -> None:
    """Record that `cache` updated `layer_idx` on this thread (the attention of that layer
    comes next in the same forward)."""
    _ACTIVE.entry = (cache, layer_idx)


def take_active(layer_idx: int) -> _CacheAttention | None:
    """The cache whose update of `layer_idx` is the last one on this thread, once: the entry is
    cleared, so a later forward without a kvpool cache never sees a stale one."""
    entry = getattr(_ACTIVE, "entry", None)
    _ACTIVE.entry = None
    return entry[0] if entry is not None and entry[1] == layer_idx else None


def kvpool_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    kvpool_step: KvpoolStep | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function. With `kvpool_step` (TransformersRunner): a packed step,
    query [1, q_heads, T, D], key/value [1, kv_heads, T, D]. Without it, the forward of a model
    whose past_key_values is a KvpoolCache (generate): a padded batch [B, heads, T, D].
    Returns ([B, T, q_heads, D], None)."""
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    layer_idx = int(module.layer_idx)  # type: ignore[arg-type]  # an int on every attention module
    if kvpool_step is None:
        cache = take_active(layer_idx)
        if cache is None:
            raise ValueError(
                "attn_implementation='kvpool' needs a kvpool cache: pass past_key_values="
                "KvpoolCache(...) to generate / forward, or run the model through "
                "kvpool.integrations.transformers.TransformersRunner"
            )
        return cache.attend(module, query, key, value, scale, kwargs.get("position_ids")), None
    if query.shape[0] != 1:
        raise ValueError(
            f"kvpool attention takes a packed batch [1, num_tokens], got {query.shape[0]} rows"
        )
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    return attend_packed(kvpool_step, layer_idx, q, k, v, scale)[None], None


PREFILL = {"kernel": prefill_kernel, "sdpa": prefill_sdpa}


SUPPORTED_MODELS = (
    "decoder-only causal LMs with a `model.model.layers` decoder and an `lm_head` whose layers "
    "call transformers' AttentionInterface (the Llama, Mistral, Qwen2 and Qwen3 families)"
)


def check_model(model: Any) -> None:
    """Raise TypeError unless `model` is of the kind kvpool runs (SUPPORTED_MODELS)."""
    decoder = getattr(model, "model", None)
    if not (hasattr(model, "lm_head") and hasattr(decoder, "layers") and hasattr(model, "config")):
        raise TypeError(
            f"kvpool's transformers integration runs {SUPPORTED_MODELS}; "
            f"{type(model).__name__} is not one"
        )


def attn_implementation(model: Any) -> Any:
    """The attention implementation the model's forward will look up."""
    return model.config._attn_implementation


class attention_switched:
    """A context in which `model` (and every model sharing its config object, which is where
    transformers keeps the choice) attends with "kvpool"; the previous implementation comes
    back on exit, also when the forward raises."""

    def __init__(self, model: Any) -> None:
        self.config = model.config

    def __enter__(self) -> None:
        self.previous = self.config._attn_implementation
        if self.previous != NAME:
            self.config._attn_implementation = NAME

    def __exit__(self, *exc: object) -> None:
        if self.config._attn_implementation != self.previous:
            self.config._attn_implementation = self.previous


def check_layout(model: Any, pool: Pool) -> None:
    """Raise LayoutError unless the pool's layout holds `model`'s KV cache."""
    want = layout_for(model, pool.layout.block_size)
    lay = pool.layout
    got = (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype)
    if got != (want.num_layers, want.num_kv_heads, want.head_dim, want.dtype):
        raise kvpool.LayoutError(f"pool layout {got} does not fit the model {want}")


def layout_for(model: Any, block_size: int = 16) -> KvLayout:
    """The kvpool.KvLayout that holds `model`'s KV cache in its parameters' dtype."""
    cfg = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    param_dtype = next(model.parameters()).dtype
    dtype = {v: k for k, v in TORCH_DTYPES.items()}.get(param_dtype)
    if dtype is None:
        raise kvpool.LayoutError(
            f"the model's parameters are {param_dtype}; a pool holds {sorted(TORCH_DTYPES)}"
        )
    return kvpool.KvLayout(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
