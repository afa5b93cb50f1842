"""`KvpoolCache`: a transformers `Cache` that keeps every layer's K/V in one kvpool pool, for
plain `model.generate(...)`:

    register()  # attn_implementation "kvpool"
    model.set_attn_implementation("kvpool")
    cache = KvpoolCache(model, pool, max_batch_size=8, max_cache_len=4096)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64,
                         stopping_criteria=StoppingCriteriaList([cache.release_at_eos(eos)]))
    cache.close()  # every block back to the pool

The cache holds no tensors. Each row of generate's batch is a request of a BlockTables; its
`update` only marks the cache as the one the next attention call of that layer works for (a Llama-family
layer calls `past_key_values.update` and then its attention function), and the attention
function "kvpool" does the rest: at layer 0 of every forward it turns the padded batch into a
packed step (kvpool.integrations.padded_batch: left padding is read from generate's position
ids, which count real tokens only), grows the tables and uploads the step's metadata once;
every layer then writes its K/V with append_kv and attends with the paged decode (one new
token on a cached prefix) and prefill (prompt chunks) kernels. Rows that `release_at_eos`
saw finish give their blocks back at once; generate keeps feeding them padding, which the
cache skips (zero outputs: generate never reads those logits).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import StoppingCriteria
from transformers.cache_utils import Cache, CacheLayerMixin

import kvpool
from kvpool.generation.batch import build_step
from kvpool.integrations.attention import (
    NAME,
    PREFILL,
    KvpoolStep,
    attend_packed,
    attn_implementation,
    check_layout,
    check_model,
    pool_device,
    set_active,
    step_arrays,
)
from kvpool.integrations.packed_upload import PinnedStaging, upload
from kvpool.integrations.padded_batch import PaddedStep, plan_padded_step, prompt_lens


class _KvpoolLayer(CacheLayerMixin):
    """One layer's view of the cache (transformers asks layers for lengths)."""

    is_sliding = False
    is_croppable = False

    def __init__(self, cache: KvpoolCache) -> None:
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
        return (
            -1
        )  # as a dynamic cache: generate's length limits apply, the tables' width is checked

    def reset(self) -> None:
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("KvpoolCache does not support beam search")


class RowLifetime:
    """The batch rows of a generate() cache over kvpool tables (KvpoolCache and
    HybridKvpoolCache): `tables` holds row b as request b, `num_rows` rows exist once the
    first forward ran, and `finished` rows were freed (later forwards skip them)."""

    tables: Any
    num_rows: int
    finished: set[int]

    # -- lifetime of rows -------------------------------------------------------------------

    def release(self, rows) -> None:
        """Free the blocks (pages) of batch rows `rows` (finished: later forwards skip them)."""
        for b in rows:
            b = int(b)
            if b not in self.finished and b < self.num_rows:
                self.tables.free(b)
                self.finished.add(b)

    def release_at_eos(self, eos_token_ids) -> StoppingCriteria:
        """A stopping criterion for generate() that releases each row when it emits one of
        `eos_token_ids` (it never stops generation itself: generate's own EOS criterion does)."""
        return _ReleaseAtEos(self, eos_token_ids)

    def close(self) -> None:
        """Free every row still held."""
        self.release(range(self.num_rows))

    def row_lens(self) -> np.ndarray:
        """Tokens held per row (0 for a released row)."""
        return np.array(
            [0 if b in self.finished else self.tables.num_tokens(b) for b in range(self.num_rows)],
            np.int64,
        )


class KvpoolCache(RowLifetime, Cache):
    """A generate() cache over `pool` (its layout must fit the model: see
    kvpool.integrations.transformers.layout_for) for up to max_batch_size rows of up to
    max_cache_len tokens each (padding not counted). The model must attend with "kvpool"
    (`model.set_attn_implementation("kvpool")`): a forward with any other attention is refused
    with InvalidArgumentError before it writes anything. One generate() per cache; close() frees
    what is left. prefill="sdpa" runs prompt attention with torch SDPA over K/V gathered from
    the pool (the cross-check path)."""

    def __init__(
        self,
        model: Any,
        pool: kvpool.Pool,
        *,
        max_batch_size: int,
        max_cache_len: int,
        prefill: str = "kernel",
    ) -> None:
        if prefill not in PREFILL:
            raise ValueError(f"prefill must be one of {sorted(PREFILL)}, got {prefill!r}")
        check_model(model)
        check_layout(model, pool)
        self.model, self.pool, self.prefill = model, pool, prefill
        self.device = pool_device(pool)
        self.max_rows = max_batch_size
        bs = pool.layout.block_size
        self.tables = kvpool.BlockTables(pool, max_batch_size, -(-max_cache_len // bs))
        self.num_rows = 0
        self.seen_width = 0  # padded tokens per row so far: what generate slices its input by
        self.finished: set[int] = set()
        self.step: Any = None
        self.plan: PaddedStep | None = None
        self._gather: torch.Tensor | None = None
        self._staging = PinnedStaging() if self.device.type == "cuda" else None
        super().__init__(layers=[_KvpoolLayer(self) for _ in range(pool.layout.num_layers)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            self._check_attention()
        set_active(self, layer_idx)
        return key_states, value_states

    def _check_attention(self) -> None:
        """Refuse a forward whose attention is not "kvpool": transformers' own attention
        would take the states `update` hands back as the whole cache, attend to the new
        tokens only and give wrong tokens while the pool stays empty. Checked at layer 0,
        before anything is written."""
        impl = attn_implementation(self.model)
        if impl != NAME:
            raise kvpool.InvalidArgumentError(
                f"KvpoolCache needs the model to attend with 'kvpool', but its "
                f"attn_implementation is {impl!r}: call kvpool.integrations.transformers."
                f"register() and model.set_attn_implementation('kvpool') before generate"
            )

    # -- the step of one forward (built at layer 0, used by every layer) ----------------------

    def begin_step(self, batch_size: int, width: int, position_ids: torch.Tensor | None) -> None:
        if self.num_rows == 0:
            if batch_size > self.max_rows:
                raise ValueError(f"batch of {batch_size} rows; the cache holds {self.max_rows}")
            if position_ids is None:
                new = np.full(batch_size, width, np.int64)
            else:
                pos = position_ids.expand(batch_size, -1).cpu().numpy()
                new = prompt_lens(pos)
            self.num_rows = batch_size
            cached = np.zeros(batch_size, np.int64)
        else:
            if batch_size != self.num_rows:
                raise ValueError(
                    f"the cache holds {self.num_rows} rows, this forward has {batch_size}"
                )
            cached = self.row_lens()
            new = np.array(
                [0 if b in self.finished else width for b in range(batch_size)], np.int64
            )
        plan = plan_padded_step(cached, new, width)
        for b in np.concatenate([plan.decode_rows, plan.prefill_rows]).tolist():
            if cached[b] == 0:
                self.tables.add(b, int(new[b]))
            else:
                self.tables.append_tokens(b, int(new[b]))
        dec = [(b, 0, int(cached[b])) for b in plan.decode_rows.tolist()]
        pre = [(b, [0] * int(new[b]), int(cached[b])) for b in plan.prefill_rows.tolist()]
        batch = build_step(self.tables, dec, pre, [0.0] * len(dec), [0] * len(dec))
        if self._staging is None:
            self.step = KvpoolStep(self.pool, batch, self.device, self.prefill)
            self._gather = torch.from_numpy(plan.gather)
        else:
            _ids, _pos, *meta = upload(self._staging, step_arrays(batch), self.device)
            self.step = KvpoolStep(self.pool, batch, self.device, self.prefill, meta)
            self._gather = torch.from_numpy(plan.gather).to(self.device, non_blocking=True)
        self.plan = plan
        self.seen_width += width

    def attend(
        self,
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of a padded forward: query [B, q_heads, T, D], key/value [B, kv_heads,
        T, D]; returns [B, T, q_heads, D]."""
        b, hq, t, d = query.shape
        if module.layer_idx == 0:
            self.begin_step(b, t, position_ids)
        g = self._gather
        q = query.transpose(1, 2).reshape(b * t, hq, d)[g]
        k = key.transpose(1, 2).reshape(b * t, key.shape[1], d)[g]
        v = value.transpose(1, 2).reshape(b * t, value.shape[1], d)[g]
        out = torch.zeros((b * t, hq, d), dtype=query.dtype, device=query.device)
        out[g] = attend_packed(self.step, module.layer_idx, q, k, v, scale)
        return out.view(b, t, hq, d)


class _ReleaseAtEos(StoppingCriteria):
    def __init__(self, cache: RowLifetime, eos_token_ids) -> None:
        ids = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
        self.cache, self.eos = cache, torch.tensor(ids, dtype=torch.long)

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs
    ) -> torch.Tensor:
        last = input_ids[:, -1]
        done = torch.isin(last, self.eos.to(last.device)).cpu().numpy()
        self.cache.release(np.flatnonzero(done))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
