"""Hugging Face transformers on a kvpool pool (optional extra `kvpool[transformers]`).

`register()` adds the attention function "kvpool" to transformers' public AttentionInterface.
A model switched to it (`model.set_attn_implementation("kvpool")`) runs a packed step: every
token of the step in one row ([1, num_tokens]) with explicit position ids, and the step's paged
metadata passed down the forward as the keyword `kvpool_step` (transformers hands unknown
keywords on to the attention function, as its own paged attention does with `cache`). In each
layer the attention function writes the step's K/V into the pool with `kvpool.append_kv`,
attends decode tokens with a `kvpool.decode_plan` over the block tables and prefill
chunks causally over their cached prefix with a `kvpool.prefill_plan` (or, with
`prefill="sdpa"`, torch SDPA over K/V gathered back from the pool: the cross-check).

`KvpoolCache` (kvpool.integrations.hf_cache) is the same attention under plain
`model.generate(..., past_key_values=KvpoolCache(model, pool, ...))`: a padded batch with left
padding, greedy or sampled, rows released at EOS.

`TransformersRunner` is the model runner of `kvpool.generation.generate`. A CUDA pool takes
torch CUDA tensors of the pool's dtype (bfloat16 included); a host pool runs the NumPy float64
reference kernels, so a small float32 model generates through kvpool on the CPU.

The attention itself lives in attention.py, which hf_cache.py and decode_graphs.py import as
this module does; this module adds the runner and re-exports what users name.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import kvpool
from kvpool.generation.batch import StepBatch
from kvpool.generation.sampling import M1, M2, MASK
from kvpool.integrations.attention import (
    PREFILL,
    SUPPORTED_MODELS,
    TORCH_DTYPES,
    KvpoolStep,
    attention_switched,
    check_layout,
    check_model,
    kvpool_attention,
    layout_for,
    pool_device,
    pool_layer,
    register,
    step_arrays,
)
from kvpool.integrations.decode_graphs import DecodeGraphs
from kvpool.integrations.hf_cache import KvpoolCache
from kvpool.integrations.packed_upload import PinnedStaging, upload


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 31)
    x = (x * (M1 & MASK)) & MASK
    x = x ^ (x >> 29)
    x = (x * (M2 & MASK)) & MASK
    return x ^ (x >> 32)


def sample(
    logits: torch.Tensor, temperatures: np.ndarray, seeds: np.ndarray, positions: np.ndarray
) -> torch.Tensor:
    """The torch twin of kvpool.generation.sample (same Gumbel noise), on the logits' device."""
    out = logits.argmax(dim=1)
    hot = np.flatnonzero(temperatures > 0)
    if len(hot):
        dev = logits.device
        s = torch.from_numpy(seeds[hot]).to(dev) & MASK
        key = _mix(s * 1_000_003 + torch.from_numpy(positions[hot]).to(dev))
        x = _mix(key[:, None] ^ torch.arange(logits.shape[1], device=dev)[None, :])
        u = ((x >> 11).double() + 0.5) / float(1 << 52)
        t = torch.from_numpy(temperatures[hot]).to(dev, torch.float64)[:, None]
        noisy = logits[torch.from_numpy(hot).to(dev)].double() / t - torch.log(-torch.log(u))
        out[torch.from_numpy(hot).to(dev)] = noisy.argmax(dim=1)
    return out


class TransformersRunner:
    """A kvpool.generation ModelRunner over a transformers causal LM (Llama, Mistral, Qwen2,
    Qwen3: a `model.model` decoder and a `model.lm_head`; anything else is a TypeError). The
    pool's layout must match the model: num_layers, num_key_value_heads, head_dim and dtype
    (see `layout_for`; LayoutError otherwise).

    The model attends with "kvpool" only inside the runner's own forwards: each one switches
    the model's config (which every model sharing that config object reads) and switches it
    back, so the model is left as it was between steps, after the runner, and when its
    constructor refuses.

    cuda_graphs=True (CUDA pool) replays a captured CUDA graph for every decode-only step of
    at most max_graph_batch sequences (kvpool.integrations.decode_graphs): the step is padded
    to a power-of-two bucket and its decode plan fixed per bucket, so its logits can differ
    from the eager step's in the last bits (other GEMM shapes, other split of the KV)."""

    def __init__(
        self,
        model: Any,
        pool: kvpool.Pool,
        *,
        prefill: str = "kernel",
        cuda_graphs: bool = False,
        max_graph_batch: int = 256,
    ) -> None:
        if prefill not in PREFILL:
            raise ValueError(f"prefill must be one of {sorted(PREFILL)}, got {prefill!r}")
        check_model(model)
        check_layout(model, pool)
        device = next(model.parameters()).device
        if device != pool_device(pool):
            raise ValueError(f"model on {device} but pool on {pool.device}")
        register()
        self.prefill = prefill
        self.model, self.pool, self.device = model, pool, device
        self.graphs = None
        if cuda_graphs:
            if self.device.type != "cuda":
                raise ValueError("cuda_graphs=True needs a CUDA pool and model")
            self.graphs = DecodeGraphs(self, max_graph_batch)
        self._staging = PinnedStaging() if self.device.type == "cuda" else None

    def attention(self) -> attention_switched:
        """The scope of one of the runner's forwards: the model attends with "kvpool"."""
        return attention_switched(self.model)

    def forward_hidden(
        self, ids: torch.Tensor, pos: torch.Tensor, step: KvpoolStep
    ) -> torch.Tensor:
        """Last hidden states [num_tokens, hidden] of ids / pos ([1, num_tokens] int64)."""
        out = self.model.model(input_ids=ids, position_ids=pos, use_cache=False, kvpool_step=step)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def hidden(self, batch: StepBatch) -> torch.Tensor:
        """Last hidden states [num_tokens, hidden] of one packed step (writes the step's KV)."""
        if self._staging is None:
            step = KvpoolStep(self.pool, batch, self.device, self.prefill)
            ids, pos = torch.from_numpy(batch.input_ids), torch.from_numpy(batch.positions)
        else:
            ids, pos, *meta = upload(self._staging, step_arrays(batch), self.device)
            step = KvpoolStep(self.pool, batch, self.device, self.prefill, meta)
        with self.attention():
            return self.forward_hidden(ids[None], pos[None], step)

    @torch.inference_mode()
    def logits(self, batch: StepBatch) -> torch.Tensor:
        """float32 logits [num_tokens, vocab] of every token of the step."""
        return self.model.lm_head(self.hidden(batch)).float()

    @torch.inference_mode()
    def decode_logits(self, batch: StepBatch) -> torch.Tensor:
        """float32 logits [num_decode, vocab] of the decode rows (a graph replay where one
        covers the step)."""
        if self.graphs is not None and self.graphs.covers(batch):
            with self.attention():
                return self.graphs.logits(batch)
        return self.model.lm_head(self.hidden(batch)[: batch.num_decode]).float()

    @torch.inference_mode()
    def sampled_logits(self, batch: StepBatch) -> torch.Tensor:
        """float32 logits [num_sampled, vocab] of the sampled rows (batch.sample_rows: the
        decode rows, then the last row of each prefill chunk that completes a prompt)."""
        if batch.num_prefill == 0:
            return self.decode_logits(batch)
        rows = torch.from_numpy(batch.sample_rows).to(self.device, non_blocking=True)
        return self.model.lm_head(self.hidden(batch)[rows]).float()

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> np.ndarray:
        logits = self.sampled_logits(batch)
        pos = batch.sample_positions
        return sample(logits, batch.temperatures, batch.seeds, pos).cpu().numpy()


__all__ = [
    "SUPPORTED_MODELS",
    "TORCH_DTYPES",
    "KvpoolCache",
    "KvpoolStep",
    "TransformersRunner",
    "check_layout",
    "check_model",
    "kvpool_attention",
    "layout_for",
    "pool_device",
    "pool_layer",
    "register",
    "sample",
]
