"""Helpers shared by the transformers tests (CPU host pool and GPU): random-weight Llama-shaped
models built from a config, the teacher-forced comparison against transformers' own cache."""

from __future__ import annotations

import kvpool
import numpy as np
import torch
from kvpool.generation import build_step
from kvpool.integrations.transformers import TransformersRunner, layout_for
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM


def llama(
    dtype,
    device,
    *,
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    inter=128,
    vocab=101,
    seed=0,
    lm_head_spread=0.0,
):
    """A random-weight Llama. lm_head_spread > 0 scales each lm_head row by
    exp(spread * N(0, 1)): a few tokens then dominate and greedy decisions have margins
    (with equal row norms the top two of a large vocabulary are often within a few ulps)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.device(device):  # initialise on the device: a 1B model is slow to fill on a CPU
        model = LlamaForCausalLM(cfg).to(dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: run every requested token
    model.generation_config.pad_token_id = 0
    if lm_head_spread:
        w = model.lm_head.weight
        with torch.no_grad():
            scale = torch.exp(lm_head_spread * torch.randn(w.shape[0], 1, device=w.device))
            w.mul_(scale.to(w.dtype))
    return model


def ulp(dtype, magnitude: float) -> float:
    """The spacing of `dtype` at `magnitude` (the resolution of a logit that large)."""
    return torch.finfo(dtype).eps * 2.0 ** np.floor(np.log2(max(magnitude, 1e-30)))


def decision_margins(logits, prompt_len, chosen, temperatures=0.0, seed=0):
    """How far each chosen token is from the decision a sampler makes on `logits` (float32
    [prompt_len + len(chosen) - 1 or more, vocab] of prompt + chosen, one forward): row
    prompt_len - 1 + k decided chosen[k]. Greedy: max(logit) - logit[chosen]; temperature t:
    the same on logit / t + the request's Gumbel noise (kvpool.generation.gumbel_noise).
    Returns (margins, scales): float64 [len(chosen)] each, scale = max|logit| of the row."""
    from kvpool.generation import gumbel_noise

    rows = logits[prompt_len - 1 : prompt_len - 1 + len(chosen)].double().cpu().numpy()
    scales = np.abs(rows).max(axis=1)
    if temperatures:
        pos = np.arange(prompt_len - 1, prompt_len - 1 + len(chosen), dtype=np.int64)
        seeds = np.full(len(chosen), seed, np.int64)
        rows = rows / temperatures + gumbel_noise(seeds, pos, rows.shape[1])
    picked = rows[np.arange(len(chosen)), np.asarray(chosen)]
    return rows.max(axis=1) - picked, scales


def reference_logits(model, prompt, forced):
    """transformers' default path: SDPA + DynamicCache; prefill the prompt, then one decode
    step per forced token. float32 logits [len(prompt) + len(forced), vocab]."""
    model.set_attn_implementation("sdpa")
    dev = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    out = []
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=dev)
        out.append(model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0].float())
        for t in forced:
            ids = torch.tensor([[t]], device=dev)
            out.append(
                model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0].float()
            )
    return torch.cat(out)


def kvpool_logits(model, prompts, forced, *, block_size=16, num_blocks=None, prefill="kernel"):
    """The same tokens through kvpool: every prompt prefilled in one packed step (ragged), then
    one packed decode step per forced token for all sequences. Returns per sequence float32
    logits [len(prompt) + len(forced[i]), vocab]."""
    dev = next(model.parameters()).device
    layout = layout_for(model, block_size)
    need = sum(-(-(len(p) + len(f)) // block_size) for p, f in zip(prompts, forced))
    pool = kvpool.Pool(
        layout, num_blocks or need + 4, device="host" if dev.type == "cpu" else str(dev)
    )
    runner = TransformersRunner(model, pool, prefill=prefill)
    width = max(-(-(len(p) + len(f)) // block_size) for p, f in zip(prompts, forced))
    tables = kvpool.BlockTables(pool, len(prompts), width)
    for i, p in enumerate(prompts):
        tables.add(i, len(p))
    batch = build_step(tables, [], [(i, list(p), 0) for i, p in enumerate(prompts)], [], [])
    logits = runner.logits(batch)
    ptr = batch.prefill_qo_indptr
    per_seq = [[logits[ptr[i] : ptr[i + 1]]] for i in range(len(prompts))]
    for step in range(max(len(f) for f in forced)):
        live = [i for i in range(len(prompts)) if step < len(forced[i])]
        tables.append_tokens_many(np.array(live, np.int64), 1)
        dec = [(i, forced[i][step], len(prompts[i]) + step) for i in live]
        batch = build_step(tables, dec, [], [0.0] * len(live), [0] * len(live))
        logits = runner.logits(batch)
        for row, i in enumerate(live):
            per_seq[i].append(logits[row : row + 1])
    for i in range(len(prompts)):
        tables.free(i)
    assert pool.num_free == pool.num_blocks
    return [torch.cat(x) for x in per_seq]


def left_padded(prompts, device, pad=0):
    """generate's input for ragged prompts: ids and attention mask [batch, longest], padding on
    the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def cache_generate(model, pool, prompts, n, *, eos=None, prefill="kernel", **kw):
    """model.generate with a KvpoolCache over `pool` (attn_implementation "kvpool") on a
    left-padded batch. Returns (new tokens per row, trimmed after EOS, the per-step logits
    [steps, batch, vocab] when output_logits is asked for, the cache, closed)."""
    from kvpool.integrations.transformers import KvpoolCache, register
    from transformers import StoppingCriteriaList

    register()
    model.set_attn_implementation("kvpool")
    dev = next(model.parameters()).device
    ids, mask = left_padded(prompts, dev)
    cache = KvpoolCache(
        model,
        pool,
        max_batch_size=len(prompts),
        max_cache_len=max(len(p) for p in prompts) + n,
        prefill=prefill,
    )
    stop = StoppingCriteriaList([cache.release_at_eos(eos)] if eos is not None else [])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=n,
            eos_token_id=eos,
            stopping_criteria=stop,
            return_dict_in_generate=True,
            output_logits=True,
            **kw,
        )
    released = set(cache.finished)
    cache.close()
    assert pool.num_free == pool.num_blocks
    return _trim(out.sequences[:, ids.shape[1] :], eos), out.logits, released


def dynamic_generate(model, prompts, n, *, eos=None, **kw):
    """The same batch through transformers' default cache with SDPA."""
    model.set_attn_implementation("sdpa")
    dev = next(model.parameters()).device
    ids, mask = left_padded(prompts, dev)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            eos_token_id=eos,
            return_dict_in_generate=True,
            output_logits=True,
            **kw,
        )
    return _trim(out.sequences[:, ids.shape[1] :], eos), out.logits


def _trim(tokens, eos):
    rows = []
    for row in tokens.tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        rows.append(row)
    return rows
