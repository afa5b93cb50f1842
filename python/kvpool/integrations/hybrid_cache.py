"""`HybridKvpoolCache`: a transformers `Cache` keeping a hybrid model's K/V (window and full
layers, kvpool.integrations.hybrid_models) in kvpool's hybrid pages, for plain
`model.generate(...)`:

    register()  # attn_implementation "kvpool_hybrid"
    model.set_attn_implementation("kvpool_hybrid")
    cache = HybridKvpoolCache(model, pool, max_batch_size=8)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64,
                         stopping_criteria=StoppingCriteriaList([cache.release_at_eos(eos)]))
    cache.close()  # every page back to the pool

As hf_cache.KvpoolCache does for a uniform pool: the cache holds no tensors; each row of
generate's batch is a request of a HybridTables; a layer's `update` marks the cache as the
one its attention call works for, and at layer 0 of each forward the padded batch (left
padding, read from generate's position ids) becomes a packed step
(kvpool.integrations.padded_batch) whose rows are grown in the tables (a window table gives
back the pages its window left) and attended as the runner's steps are. Rows that
`release_at_eos` saw finish give their pages back at once; generate keeps feeding them
padding, which the cache skips (zero outputs: generate never reads those logits).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

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
    UnsupportedModelError,
    attend_packed,
    check_spec,
    spec_for_model,
)
from kvpool.integrations.padded_batch import PaddedStep, plan_padded_step, prompt_lens


class _HybridLayer(CacheLayerMixin):
    """One layer's view of the cache (transformers asks layers for lengths)."""

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


class HybridKvpoolCache(RowLifetime, Cache):
    """A generate() cache over a `pool` of `spec`'s pages (spec defaults to
    spec_for_model(model)) on the model's device (a host pool, or a CUDA pool for a model on
    the GPU) for up to max_batch_size rows. The model must attend with
    "kvpool_hybrid": a forward with any other attention is refused with
    InvalidArgumentError before anything is written. One generate() per cache; close()
    frees what is left."""

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
        kinds = {g.kind for g in spec.groups} & {"mla_latent", "recurrent_state"}
        if kinds:
            # DeepSeek-V3 hands the cache its latents (update) before its attention call,
            # and update gets no position ids: the padding of generate's first forward,
            # which the packed step needs, is not known there yet. State layers run their
            # recurrence over a padded row, padding included.
            raise UnsupportedModelError(
                f"HybridKvpoolCache does not take a model with {sorted(kinds)} groups yet "
                f"(MLA, Gated DeltaNet): run it through HybridTransformersRunner and "
                f"kvpool.generation.generate(..., spec=)"
            )
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
        super().__init__(layers=[_HybridLayer(self) for _ in range(spec.num_layers)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            impl = attn_implementation(self.model)
            if impl != NAME:  # another attention would take the new states as the whole cache
                raise kvpool.InvalidArgumentError(
                    f"HybridKvpoolCache needs the model to attend with {NAME!r}, but its "
                    f"attn_implementation is {impl!r}: call kvpool.integrations.hybrid_models."
                    f"register() and model.set_attn_implementation({NAME!r}) before generate"
                )
        set_active(self, layer_idx)
        return key_states, value_states

    # -- the step of one forward (built at layer 0, used by every layer) ----------------------

    def begin_step(self, batch_size: int, width: int, position_ids: torch.Tensor | None) -> None:
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
        if layer == 0:
            self.begin_step(b, t, position_ids)
        assert self.step is not None and self._gather is not None  # set at layer 0
        g = self._gather
        q = query.transpose(1, 2).reshape(b * t, hq, d)[g]
        k = key.transpose(1, 2).reshape(b * t, key.shape[1], d)[g]
        v = value.transpose(1, 2).reshape(b * t, value.shape[1], d)[g]
        out = torch.zeros((b * t, hq, d), dtype=query.dtype, device=query.device)
        out[g] = attend_packed(self.step, layer, q, k, v, how)
        return out.view(b, t, hq, d)


__all__ = ["HybridKvpoolCache"]
