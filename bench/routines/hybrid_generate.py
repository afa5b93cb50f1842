"""Generation throughput of a gpt-oss-shaped model (sliding-window 128 and full layers
alternating, attention sinks, top-4 MoE; bf16, random weights) on a GPU: kvpool's
continuous-batching loop over a CUDA hybrid pool (kvpool.integrations.hybrid_models:
decode rows through the tensor-core decode with window and sinks, prefill chunks through
the prefill kernel) against transformers' own options, same requests, same KV memory.

Rows (same process, same model, same requests; output tokens/s counts the tokens each request
asked for):
- kvpool_hybrid_loop: kvpool.generation.generate with HybridTransformersRunner, all requests
  submitted at t=0, on a pool of the KV bytes transformers' static cache takes for
  `--batch` rows of (max prompt + max output) tokens (its window layers holding the window).
- hf_dynamic_<attn>: `generate` in batches of `--batch`, left padded, max_new_tokens = the
  batch's longest request, default cache (its sliding layers keep the window); gpt-oss has
  no SDPA path in transformers 5.17 (sinks), so attention is "eager" and, where it runs,
  "flex_attention".
- hf_static_eager: the same with cache_implementation="static" on the first two batches.
- hf_continuous_batching: transformers' continuous batching ("paged|eager") over as many KV
  tokens as the budget, if it runs this model. The rows run in this order, flex attention
  (torch.compile) last.
Writes JSON (provenance + rows + ratios) to --out.
"""

from __future__ import annotations

import argparse
import json

import kvpool
import numpy as np
import torch
from kvpool.generation import GenerationRequest, generate
from kvpool.integrations import hybrid_models as hm
from provenance import provenance
from timing import synced_wall

from routines.generate import guarded, hf_batches, hf_continuous

GPT_OSS_SMALL = dict(
    num_hidden_layers=8,
    layer_types=["sliding_attention", "full_attention"] * 4,
    sliding_window=128,  # gpt-oss's
    hidden_size=1024,
    intermediate_size=1024,
    head_dim=64,  # gpt-oss's
    num_attention_heads=16,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=4,  # gpt-oss's top-4
    vocab_size=32000,
)


def build_model():
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(**GPT_OSS_SMALL, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    with torch.device("cuda"):
        model = GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
        for layer in model.model.layers:
            with torch.no_grad():
                layer.self_attn.sinks.normal_(0.0, 1.0)
    model.generation_config.eos_token_id = None  # random weights: lengths are the workload's
    model.generation_config.pad_token_id = 0
    return model


def requests(n, max_prompt, max_output, seed=0):
    rng = np.random.default_rng(seed)
    return [
        GenerationRequest(
            i,
            rng.integers(5, 32000, int(rng.integers(max_prompt // 4, max_prompt + 1))).tolist(),
            int(rng.integers(max_output // 2, max_output + 1)),
        )
        for i in range(n)
    ]


def static_cache_bytes(spec, batch, max_len):
    """What transformers' static cache holds for `batch` rows of `max_len` tokens: every full
    layer max_len tokens, every window layer its window (per row)."""
    total = 0
    for g in spec.groups:
        tokens = max_len if g.kind == "full" else min(g.window, max_len)
        total += batch * tokens * g.token_bytes
    return total


def run_kvpool(model, reqs, kv_bytes, max_running=256):
    spec = hm.spec_for_model(model)
    pool = kvpool.Pool.for_spec(spec, kv_bytes // spec.page_bytes, device="cuda")
    runner = hm.HybridTransformersRunner(model, pool, spec)
    run = lambda rs: generate(
        runner, pool, rs, max_running_seqs=max_running, max_tokens_per_step=4096, spec=spec
    )
    run(reqs[:2])  # warm-up: kernel compiles, allocator
    dt, res = synced_wall(lambda: run(reqs), torch.cuda.synchronize)
    return {
        "output_tokens": res.num_output_tokens,
        "seconds": dt,
        "tokens_per_s": res.num_output_tokens / dt,
        "peak_concurrent": res.peak_running,
        "steps": res.num_steps,
        "preemptions": res.num_preemptions,
        "pool_pages": pool.num_blocks,
        "page_bytes": spec.page_bytes,
    }


def hf_rows(model, reqs, batch, attn, cache=None, max_batches=None):
    """hf_batches with the attention `attn` (it sets "sdpa", which gpt-oss refuses)."""
    real = model.set_attn_implementation
    model.set_attn_implementation = lambda name: real(attn if name == "sdpa" else name)
    try:
        return hf_batches(model, reqs, batch, cache, max_batches)
    finally:
        model.set_attn_implementation = real
        real("eager")


def ratios(rows):
    ours = rows.get("kvpool_hybrid_loop", {}).get("tokens_per_s")
    out = {}
    for name, row in rows.items():
        if (
            name != "kvpool_hybrid_loop"
            and ours
            and isinstance(row, dict)
            and "tokens_per_s" in row
        ):
            out[f"kvpool_over_{name}"] = ours / row["tokens_per_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--only", default="", help="comma-separated row names (default: all)")
    args = ap.parse_args(argv)
    import transformers

    model = build_model()
    reqs = requests(args.num_requests, args.max_prompt, args.max_output)
    spec = hm.spec_for_model(model)
    kv_bytes = static_cache_bytes(spec, args.batch, args.max_prompt + args.max_output)
    rows: dict[str, object] = {}
    report = {
        "benchmark": "hybrid_generate_bench",
        "provenance": provenance("bench/routines/hybrid_generate.py"),
        "transformers": transformers.__version__,
        "model": {**GPT_OSS_SMALL, "dtype": "bfloat16", "weights": "random, seed 0, sinks N(0,1)"},
        "workload": {
            "num_requests": len(reqs),
            "prompt_tokens": f"uniform {args.max_prompt // 4}..{args.max_prompt}",
            "output_tokens": f"uniform {args.max_output // 2}..{args.max_output}",
            "mean_prompt": float(np.mean([len(r.prompt) for r in reqs])),
            "mean_output": float(np.mean([r.max_new_tokens for r in reqs])),
        },
        "kv_bytes": kv_bytes,
        "kv_budget": f"transformers' static cache for {args.batch} rows of "
        f"{args.max_prompt + args.max_output} tokens",
        "rows": rows,
        "ratios": {},
    }

    def save():
        report["ratios"] = ratios(rows)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    # transformers' continuous batching over the same KV tokens of its full layers
    budget_tokens = args.batch * (args.max_prompt + args.max_output)
    steps = [
        ("kvpool_hybrid_loop", lambda: run_kvpool(model, reqs, kv_bytes)),
        ("hf_dynamic_eager", lambda: hf_rows(model, reqs, args.batch, "eager")),
        ("hf_static_eager", lambda: hf_rows(model, reqs, args.batch, "eager", "static", 2)),
        ("hf_continuous_batching", lambda: hf_cb(model, reqs, budget_tokens)),
        ("hf_dynamic_flex", lambda: hf_rows(model, reqs, args.batch, "flex_attention")),
    ]
    only = {s for s in args.only.split(",") if s}
    for name, fn in steps:
        if only and name not in only:
            continue
        guarded(name, fn, rows)
        save()


def hf_cb(model, reqs, budget_tokens):
    """hf_continuous with paged eager attention (gpt-oss has no SDPA)."""
    real = model.set_attn_implementation

    def swap(name):
        real({"paged|sdpa": "paged|eager", "sdpa": "eager"}.get(name, name))

    model.set_attn_implementation = swap
    try:
        return hf_continuous(model, reqs, budget_tokens)
    finally:
        model.set_attn_implementation = real
        real("eager")
