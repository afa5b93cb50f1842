"""`HybridKvpoolCache`: a transformers `Cache` keeping a hybrid model's K/V (window and full
layers), MLA latents (DeepSeek-V3) and Gated DeltaNet states (Qwen3-Next) in kvpool's hybrid
memory (kvpool.integrations.hybrid_models), for plain `model.generate(...)`:

    register()  # attn_implementation "kvpool_hybrid"
    model.set_attn_implementation("kvpool_hybrid")
    cache = HybridKvpoolCache(model, pool, max_batch_size=8)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64,
                         stopping_criteria=StoppingCriteriaList([cache.release_at_eos(eos)]))
    cache.close()  # every page and state slot back to the pool

As hf_cache.KvpoolCache does for a uniform pool: each row of generate's batch is a request of
a HybridTables. A forward pre-hook on the model's decoder (torch's `register_forward_pre_hook`:
it sees generate's input ids and position ids before any layer runs) turns each padded
[batch, width] forward into a packed step (kvpool.integrations.padded_batch; left padding read
from the first forward's position ids): the rows are grown in the tables (a window table gives
back the pages its window left) before layer 0. Then per layer kind:

- attention layers: `update` marks the cache for that layer's attention call (transformers'
  attention function does not get the cache), which attends as the runner's steps do;
- MLA layers (DeepSeek-V3): `update(kv_nope, k_rot)` writes the latents into the layer's pages
  at the step's slots; the attention function attends over the pages with the projections
  absorbed;
- state layers (Qwen3-Next): transformers' own LinearAttentionLayers hold the batch's states
  for the layer's forward only: `has_previous_state` (the first thing the layer asks) loads
  every row's state from its kvpool slot, `update_recurrent_state` (the last thing it does)
  stores them back.

Rows that `release_at_eos` saw finish give their pages and slots back at once; generate keeps
feeding them padding, which the cache skips (zero outputs: generate never reads those logits).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer

import kvpool
from kvpool._core import ModelKvSpec, Pool
from kvpool.generation.hybrid_batch import build_hybrid_step
from kvpool.integrations.attention import attn_implementation, check_model, set_active
from kvpool.integrations.hf_cache import RowLifetime
from kvpool.integrations.hybrid_models import (
    NAME,
    Attention,
    HybridStep,
    PageViews,
    StateLayout,
    _dtype_name,
    attend_packed,
    check_spec,
    spec_for_model,
    state_layout,
)
from kvpool.integrations.padded_batch import PaddedStep, plan_padded_step, prompt_lens


class _HybridLayer(CacheLayerMixin):
    """One attention (or MLA) layer's view of the cache (transformers asks layers for
    lengths)."""

    is_sliding = False  # the masks transformers would build are not built ("kvpool_hybrid")
    is_croppable = False

    def __init__(self, cache: HybridKvpoolCache) -> None:
        super().__init__()
        self.cache = cache
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.seen_width + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.seen_width

    def get_max_length(self) -> int:
        return -1  # as a dynamic cache: generate's length limits apply

    def reset(self) -> None:
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("HybridKvpoolCache does not support beam search")


class _StateLayer(LinearAttentionLayer):
    """A Gated DeltaNet layer's states as transformers' own LinearAttentionLayer, but only
    the working copy of one forward: the cache overwrites them from the rows' kvpool slots
    before the layer runs and stores them back after (HybridKvpoolCache.has_previous_state,
    update_recurrent_state)."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("HybridKvpoolCache does not support beam search")


def _is_same(a: object, b: object) -> bool:
    return a is b


def _begin_forward_hook(cache_ref: weakref.ref[HybridKvpoolCache]):
    """A forward pre-hook (with kwargs) for the model's decoder: when a forward runs with
    `past_key_values=` the cache, the cache plans its step before layer 0."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        cache = cache_ref()
        if cache is None or not _is_same(kwargs.get("past_key_values"), cache):
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        source = ids if ids is not None else embeds
        if source is None:  # the model refuses a forward without input itself
            return
        shape = source.shape
        cache.begin_step(int(shape[0]), int(shape[1]), kwargs.get("position_ids"))

    return hook


class HybridKvpoolCache(RowLifetime, Cache):
    """A generate() cache over a `pool` of `spec`'s pages (spec defaults to
    spec_for_model(model)) on the model's device (a host pool, or a CUDA pool for a model on
    the GPU) for up to max_batch_size rows. The model must attend with "kvpool_hybrid": a
    forward with any other attention is refused with InvalidArgumentError before anything is
    written. One generate() per cache; close() frees what is left and takes the cache's
    forward hook off the model."""

    def __init__(
        self,
        model: Any,
        pool: Pool,
        *,
        max_batch_size: int,
        spec: ModelKvSpec | None = None,
    ) -> None:
        check_model(model)
        spec = spec_for_model(model) if spec is None else spec
        check_spec(model, spec)
        self.views = PageViews(pool, spec)
        self.model, self.pool, self.spec = model, pool, spec
        self.device = self.views.device
        self.max_rows = max_batch_size
        self.tables = kvpool.HybridTables(pool, spec)
        self.num_rows = 0
        self.seen_width = 0  # padded tokens per row so far: what generate slices its input by
        self.finished: set[int] = set()
        self.step: HybridStep | None = None
        self.plan: PaddedStep | None = None
        self._gather: torch.Tensor | None = None
        kinds = [spec.groups[spec.group_of_layer(i)[0]].kind for i in range(spec.num_layers)]
        self.layer_kinds = kinds
        self.state: StateLayout | None = None
        if "recurrent_state" in kinds:
            self.state = state_layout(model, _dtype_name(model, None))
        self._fresh = True  # this step's rows have no tokens before it (generate's first)
        self._loaded: set[int] = set()
        super().__init__(
            layers=[
                _StateLayer() if kind == "recurrent_state" else _HybridLayer(self) for kind in kinds
            ]
        )
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        self._hook = decoder.register_forward_pre_hook(
            _begin_forward_hook(weakref.ref(self)), with_kwargs=True
        )

    def close(self) -> None:
        """Free every row still held and remove the cache's forward hook from the model."""
        self._hook.remove()
        super().close()

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.step is None:
            raise kvpool.InvalidArgumentError(
                "HybridKvpoolCache was handed K/V outside a forward it planned: pass it as "
                "past_key_values= to the model (or generate) it was made for"
            )
        if self.layer_kinds[layer_idx] == "mla_latent":
            # DeepSeek-V3 hands the cache its latent [B, 1, T, rank] and rope key [B, 1, T,
            # rope] before kv_b_proj expands them: the packed tokens' latents go into the
            # pages now; the model's expansion of what is returned is not read.
            b, _, t, _ = key_states.shape
            latent = torch.cat([key_states[:, 0], value_states[:, 0]], dim=-1)
            assert self._gather is not None
            self.step.write_latent(int(layer_idx), latent.reshape(b * t, -1)[self._gather])
        set_active(self, layer_idx)
        return key_states, value_states

    # -- the step of one forward (planned by the decoder's pre-hook, used by every layer) -----

    def begin_step(self, batch_size: int, width: int, position_ids: torch.Tensor | None) -> None:
        impl = attn_implementation(self.model)
        if impl != NAME:  # another attention would take the new states as the whole cache
            raise kvpool.InvalidArgumentError(
                f"HybridKvpoolCache needs the model to attend with {NAME!r}, but its "
                f"attn_implementation is {impl!r}: call kvpool.integrations.hybrid_models."
                f"register() and model.set_attn_implementation({NAME!r}) before generate"
            )
        if self.num_rows == 0:
            if batch_size > self.max_rows:
                raise kvpool.InvalidArgumentError(
                    f"batch of {batch_size} rows; the cache holds {self.max_rows}"
                )
            if position_ids is None:
                new = np.full(batch_size, width, np.int64)
            else:
                new = prompt_lens(position_ids.expand(batch_size, -1).cpu().numpy())
            cached = np.zeros(batch_size, np.int64)
        else:
            if batch_size != self.num_rows:
                raise kvpool.InvalidArgumentError(
                    f"the cache holds {self.num_rows} rows, this forward has {batch_size}"
                )
            cached = self.row_lens()
            new = np.array(
                [0 if b in self.finished else width for b in range(batch_size)], np.int64
            )
        plan = plan_padded_step(cached, new, width)
        rows = np.concatenate([plan.decode_rows, plan.prefill_rows]).tolist()
        grown: list[int] = []
        try:
            for b in rows:
                if cached[b] == 0:
                    self.tables.add(b, int(new[b]))
                else:
                    self.tables.append_tokens(b, int(new[b]))
                grown.append(b)
        except kvpool.KvError:
            if self.num_rows == 0:  # a first forward that failed leaves no row behind
                for b in grown:
                    self.tables.free(b)
            raise
        self.num_rows = batch_size
        dec = [(b, 0, int(cached[b])) for b in plan.decode_rows.tolist()]
        pre = [(b, [0] * int(new[b]), int(cached[b])) for b in plan.prefill_rows.tolist()]
        batch = build_hybrid_step(self.tables, dec, pre, [0.0] * len(dec), [0] * len(dec))
        self.step = HybridStep(self.views, batch, self.device)
        self._gather = torch.from_numpy(plan.gather).to(self.device)
        self.plan = plan
        self._fresh = not bool(cached.any())
        self._loaded = set()
        self.seen_width += width

    def attend_hybrid(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        how: Attention,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of a padded forward: query [B, q_heads, T, D], key/value [B, kv_heads,
        T, D]; returns [B, T, q_heads, D]."""
        b, hq, t, d = query.shape
        assert self.step is not None and self._gather is not None  # set by begin_step
        g = self._gather
        q = query.transpose(1, 2).reshape(b * t, hq, d)[g]
        k = key.transpose(1, 2).reshape(b * t, key.shape[1], d)[g]
        v = value.transpose(1, 2).reshape(b * t, value.shape[1], d)[g]
        out = torch.zeros((b * t, hq, d), dtype=query.dtype, device=query.device)
        out[g] = attend_packed(self.step, layer, q, k, v, how)
        return out.view(b, t, hq, d)

    def attend_mla(
        self, module: Any, layer: int, query: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Absorbed MLA of a padded forward over the latents `update` wrote: query [B, heads,
        T, nope + rope]; returns [B, T, heads, v_head_dim]."""
        b, h, t, d = query.shape
        assert self.step is not None and self._gather is not None  # set by begin_step
        g = self._gather
        q = query.transpose(1, 2).reshape(b * t, h, d)[g]
        packed = self.step.attend_mla(module, layer, q, scale)
        out = torch.zeros((b * t, h, packed.shape[-1]), dtype=query.dtype, device=query.device)
        out[g] = packed
        return out.view(b, t, h, -1)

    # -- Gated DeltaNet states: kvpool's slots, loaded before and stored after each layer ----

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None):
        if layer_idx is not None and self.layer_kinds[layer_idx] == "recurrent_state":
            self._load_states(int(layer_idx))
        return super().has_previous_state(layer_idx, state_idx)

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        out = super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)
        self._store_states(int(layer_idx))
        return out

    def _slot(self, row: int, layer: int) -> np.ndarray:
        return self.tables.state_slot(row, self.spec.group_of_layer(layer)[0])

    def _live_rows(self) -> list[int]:
        assert self.plan is not None
        return [b for b in range(self.num_rows) if self.plan.new_lens[b] > 0]

    def _load_states(self, layer: int) -> None:
        """Before a state layer runs: its working states [rows, ...] from the rows' slots (a
        first forward starts from none, as the model's own cache does; a finished row reads
        zeros)."""
        if self.step is None or layer in self._loaded:
            return
        self._loaded.add(layer)
        cache_layer = self.layers[layer]
        assert isinstance(cache_layer, _StateLayer) and self.state is not None
        if self._fresh:
            cache_layer.has_previous_state[0] = False
            return
        lay = self.state
        conv = torch.zeros(
            (self.num_rows, *lay.conv_shape), dtype=lay.conv_dtype, device=self.device
        )
        rec = torch.zeros(
            (self.num_rows, *lay.recurrent_shape), dtype=torch.float32, device=self.device
        )
        for b in self._live_rows():
            raw = self.views.read_state(layer, self._slot(b, layer), lay.nbytes)
            conv[b] = raw[: lay.conv_bytes].view(lay.conv_dtype).view(lay.conv_shape)
            rec[b] = raw[lay.conv_bytes :].view(torch.float32).view(lay.recurrent_shape)
        if not cache_layer.is_conv_states_initialized[0]:
            cache_layer.lazy_initialization(
                conv_states=conv, recurrent_states=rec, conv_kernel_size=lay.conv_shape[1]
            )
        cache_layer.conv_states[0].copy_(conv)
        cache_layer.recurrent_states[0].copy_(rec)
        cache_layer.has_previous_state[0] = True

    def _store_states(self, layer: int) -> None:
        """After a state layer ran: each live row's conv and recurrent state into its slot."""
        if self.step is None:
            return
        cache_layer = self.layers[layer]
        assert isinstance(cache_layer, _StateLayer) and self.state is not None
        lay = self.state
        conv_all, rec_all = cache_layer.conv_states[0], cache_layer.recurrent_states[0]
        if (
            tuple(conv_all.shape[1:]) != lay.conv_shape
            or tuple(rec_all.shape[1:]) != lay.recurrent_shape
        ):
            raise kvpool.LayoutError(
                f"layer {layer}: the model's state is conv {tuple(conv_all.shape[1:])}, "
                f"recurrent {tuple(rec_all.shape[1:])}; a slot holds {lay.conv_shape}, "
                f"{lay.recurrent_shape}"
            )
        for b in self._live_rows():
            conv = conv_all[b].to(lay.conv_dtype).contiguous()
            rec = rec_all[b].to(torch.float32).contiguous()
            data = torch.cat([conv.view(-1).view(torch.uint8), rec.view(-1).view(torch.uint8)])
            self.views.write_state(layer, self._slot(b, layer), data)


__all__ = ["HybridKvpoolCache"]
