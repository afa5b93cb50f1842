"""Generation throughput on a GPU: kvpool's continuous-batching loop against transformers'
own options on a Llama-3.2-1B-shaped model (bf16, random weights), at one KV memory budget.

Rows (same process, same model, same requests):
- workload: ShareGPT-like requests (prompt and output lengths from kvpool.sim.workload,
  clipped), random token ids; output tokens/s counts only the tokens each request asked for;
  peak concurrent sequences at the budget of `--budget-seqs` x (max prompt + max output)
  tokens of KV:
  * kvpool: kvpool.generation.generate (TransformersRunner; all requests submitted at t=0),
    eager and with CUDA graphs of the decode-only steps (`cuda_graphs=True`; graphs are
    captured in the warm-up, which replays the workload's batch sizes)
  * transformers dynamic cache + SDPA: `generate` in batches of `--budget-seqs`, left padded,
    max_new_tokens = the batch's longest request (what a user of `generate` does)
  * transformers static cache: the same on the first two batches (its first call compiles)
  * transformers continuous batching (`init_continuous_batching`, paged cache), if present
- fixed shapes: batch 1 and batch 32 of 512-token prompts, 128 new tokens (time per output
  token at batch 1, ms per step at batch 32; ratios against dynamic-cache `generate`).
- shared system prompt (`--only prefix` runs these rows alone): `--prefix-requests` requests
  whose prompts are one `--system-prompt`-token system prompt + 16..128 tokens of their own,
  `--prefix-output` new tokens each, all submitted at t=0, through kvpool's loop on a pool
  with prefix caching off and on (same blocks, a cold cache at the start of each run):
  output tokens/s, per-request TTFT and latency (submission to first / last token,
  wall clock; p50, p90, mean, max), prefill tokens computed and tokens found cached.
Writes JSON (provenance + rows + ratios) to --out. Takes a few minutes on the H200.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import kvpool
import numpy as np
import torch
from kvpool.generation import GenerationRequest, generate
from kvpool.integrations.transformers import TransformersRunner, layout_for
from kvpool.sim import workload
from provenance import provenance
from timing import synced_wall

LLAMA_1B = dict(
    num_hidden_layers=16,
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=8192,
    vocab_size=128256,
)


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**LLAMA_1B, max_position_embeddings=4096, tie_word_embeddings=True)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # random weights: lengths are the workload's
    model.generation_config.pad_token_id = 0
    return model


def sharegpt(n, max_prompt, max_output, seed=0):
    rng = np.random.default_rng(seed)
    reqs = workload.generate("sharegpt", n, seed=seed, max_model_len=max_prompt + max_output)
    out = []
    for r in reqs:
        p = int(np.clip(r.prompt_tokens, 4, max_prompt))
        o = int(np.clip(r.output_tokens, 4, max_output))
        out.append(GenerationRequest(r.request_id, rng.integers(5, 32000, p).tolist(), o))
    return out


def run_kvpool(model, reqs, budget_tokens, max_running=256, cuda_graphs=False):
    layout = layout_for(model, 16)
    pool = kvpool.Pool(layout, budget_tokens // 16, device="cuda")
    runner = TransformersRunner(model, pool, cuda_graphs=cuda_graphs)
    longest = max(len(r.prompt) + r.max_new_tokens for r in reqs)  # fixes the table width
    run = lambda rs: generate(
        runner,
        pool,
        rs,
        max_running_seqs=max_running,
        max_tokens_per_step=4096,
        max_model_len=longest,
    )
    # warm-up: kernel compiles, allocator; with graphs, the buckets of a short run of every
    # request (a bucket first met in the timed run is captured there, and counted)
    run([GenerationRequest(r.request_id, r.prompt, 8) for r in reqs] if cuda_graphs else reqs[:2])
    dt, res = synced_wall(lambda: run(reqs), torch.cuda.synchronize)
    tokens = res.num_output_tokens
    row = {
        "output_tokens": tokens,
        "seconds": dt,
        "tokens_per_s": tokens / dt,
        "peak_concurrent": res.peak_running,
        "steps": res.num_steps,
        "preemptions": res.num_preemptions,
        "pool_blocks": pool.num_blocks,
    }
    if cuda_graphs:
        row["graph_buckets"] = [b for b, _ in runner.graphs.captured]
    return row


def shared_prefix(n, system_len, output, seed=2):
    """n requests: one system prompt of system_len tokens + 16..128 tokens of their own."""
    rng = np.random.default_rng(seed)
    system = rng.integers(5, 32000, system_len).tolist()
    return [
        GenerationRequest(
            i, system + rng.integers(5, 32000, int(rng.integers(16, 129))).tolist(), output
        )
        for i in range(n)
    ]


def _quantiles_ms(values) -> dict:
    v = 1e3 * np.asarray(sorted(values), np.float64)
    return {
        "p50": float(np.percentile(v, 50)),
        "p90": float(np.percentile(v, 90)),
        "mean": float(v.mean()),
        "max": float(v.max()),
    }


def run_prefix(model, reqs, budget_tokens, caching, max_running=256):
    """kvpool's loop over `reqs` on a pool with prefix caching on or off: throughput, TTFT."""
    layout = layout_for(model, 16)
    pool = kvpool.Pool(layout, budget_tokens // 16, device="cuda", enable_prefix_caching=caching)
    runner = TransformersRunner(model, pool)
    longest = max(len(r.prompt) + r.max_new_tokens for r in reqs)
    run = lambda rs: generate(
        runner,
        pool,
        rs,
        max_running_seqs=max_running,
        max_tokens_per_step=4096,
        max_model_len=longest,
    )
    # warm-up on other tokens (kernel compiles); the run's end resets the prefix cache, so the
    # timed run starts cold and its first requests compute the system prompt
    run([GenerationRequest(10_000 + i, [7 + i] * 64, 4) for i in range(2)])
    dt, res = synced_wall(lambda: run(reqs), torch.cuda.synchronize)
    tokens = res.num_output_tokens
    return {
        "prefix_caching": caching,
        "output_tokens": tokens,
        "seconds": dt,
        "tokens_per_s": tokens / dt,
        "ttft_ms": _quantiles_ms(res.ttft_s.values()),
        "latency_ms": _quantiles_ms(res.latency_s.values()),
        "prefill_tokens": res.num_prefill_tokens,
        "cached_tokens": res.num_cached_tokens,
        "queried_tokens": res.num_queried_tokens,
        "peak_concurrent": res.peak_running,
        "steps": res.num_steps,
        "preemptions": res.num_preemptions,
        "pool_blocks": pool.num_blocks,
    }


def hf_batches(model, reqs, batch, cache_implementation=None, max_batches=None):
    model.set_attn_implementation("sdpa")
    useful, total_t, done = 0, 0.0, 0
    for start in range(0, len(reqs), batch):
        if max_batches is not None and done >= max_batches:
            break
        chunk = reqs[start : start + batch]
        width = max(len(r.prompt) for r in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(chunk):
            ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt) :] = 1
        new = max(r.max_new_tokens for r in chunk)
        kw = {"cache_implementation": cache_implementation} if cache_implementation else {}
        with torch.inference_mode():
            dt, _ = synced_wall(
                lambda: model.generate(
                    input_ids=ids.cuda(),
                    attention_mask=mask.cuda(),
                    max_new_tokens=new,
                    do_sample=False,
                    **kw,
                ),
                torch.cuda.synchronize,
            )
        useful += sum(r.max_new_tokens for r in chunk)
        total_t += dt
        done += 1
    return {
        "output_tokens": useful,
        "seconds": total_t,
        "tokens_per_s": useful / total_t,
        "peak_concurrent": batch,
        "requests_run": min(len(reqs), done * batch),
    }


def hf_continuous(model, reqs, budget_tokens):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gc = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=512)
    cbc = ContinuousBatchingConfig(block_size=256, num_blocks=max(1, budget_tokens // 256))
    model.set_attn_implementation("paged|sdpa")
    mgr = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    mgr.start()
    try:

        def go():
            for r in reqs:
                mgr.add_request(
                    r.prompt, request_id=str(r.request_id), max_new_tokens=r.max_new_tokens
                )
            got, tokens = 0, 0
            while got < len(reqs):
                out = mgr.get_result(timeout=120)
                if out is None:
                    raise RuntimeError(f"continuous batching stopped after {got} results")
                if out.is_finished():
                    got += 1
                    tokens += len(out.generated_tokens)
            return tokens

        dt, tokens = synced_wall(go, torch.cuda.synchronize)
    finally:
        mgr.stop(block=True)
        model.set_attn_implementation("sdpa")
    return {
        "output_tokens": tokens,
        "seconds": dt,
        "tokens_per_s": tokens / dt,
        "kv_blocks": cbc.num_blocks,
        "block_size": 256,
    }


def guarded(name, fn, rows):
    t0 = time.perf_counter()
    try:
        rows[name] = fn()
    except Exception as e:  # a baseline missing in this transformers version is a row, not a crash
        rows[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    print(f"{name}: {json.dumps(rows[name])[:300]} ({time.perf_counter() - t0:.1f} s)", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--budget-seqs", type=int, default=32)
    ap.add_argument("--only", choices=("all", "prefix"), default="all")
    ap.add_argument("--system-prompt", type=int, default=1024)
    ap.add_argument("--prefix-requests", type=int, default=64)
    ap.add_argument("--prefix-output", type=int, default=64)
    args = ap.parse_args(argv)
    import transformers

    model = build_model()
    reqs = sharegpt(args.num_requests, args.max_prompt, args.max_output)
    budget = args.budget_seqs * (args.max_prompt + args.max_output)
    rows: dict[str, object] = {}
    report = {
        "benchmark": "generate_bench",
        "provenance": provenance("bench/routines/generate.py"),
        "transformers": transformers.__version__,
        "model": {**LLAMA_1B, "dtype": "bfloat16", "weights": "random, seed 0"},
        "workload": {
            "kind": "sharegpt",
            "num_requests": len(reqs),
            "max_prompt": args.max_prompt,
            "max_output": args.max_output,
            "mean_prompt": float(np.mean([len(r.prompt) for r in reqs])),
            "mean_output": float(np.mean([r.max_new_tokens for r in reqs])),
        },
        "kv_budget_tokens": budget,
        "rows": rows,
        "ratios": {},
    }

    def save():  # after every row, so a run cut short still leaves its figures
        report["ratios"] = ratios(rows)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    rng = np.random.default_rng(1)
    fixed = [GenerationRequest(i, rng.integers(5, 32000, 512).tolist(), 128) for i in range(32)]
    steps = [
        ("kvpool_loop", lambda: run_kvpool(model, reqs, budget)),
        ("kvpool_loop_graphs", lambda: run_kvpool(model, reqs, budget, cuda_graphs=True)),
        ("hf_dynamic_sdpa", lambda: hf_batches(model, reqs, args.budget_seqs)),
        ("fixed_b1_kvpool", lambda: run_kvpool(model, fixed[:1], 1280)),
        ("fixed_b1_kvpool_graphs", lambda: run_kvpool(model, fixed[:1], 1280, cuda_graphs=True)),
        ("fixed_b1_hf_dynamic", lambda: hf_batches(model, fixed[:1], 1)),
        ("fixed_b32_kvpool", lambda: run_kvpool(model, fixed, 32 * 640 + 640)),
        (
            "fixed_b32_kvpool_graphs",
            lambda: run_kvpool(model, fixed, 32 * 640 + 640, cuda_graphs=True),
        ),
        ("fixed_b32_hf_dynamic", lambda: hf_batches(model, fixed, 32)),
        ("hf_continuous_batching", lambda: hf_continuous(model, reqs, budget)),
        (
            "hf_static_first_2_batches",
            lambda: hf_batches(model, reqs, args.budget_seqs, "static", max_batches=2),
        ),
    ]
    shared = shared_prefix(args.prefix_requests, args.system_prompt, args.prefix_output)
    prefix_budget = 16 * (args.system_prompt + 128 + args.prefix_output)  # KV of 16 requests
    report["shared_prefix_workload"] = {
        "num_requests": len(shared),
        "system_prompt_tokens": args.system_prompt,
        "own_prompt_tokens": "16..128",
        "output_tokens": args.prefix_output,
        "kv_budget_tokens": prefix_budget,
    }
    prefix_steps = [
        ("prefix_off", lambda: run_prefix(model, shared, prefix_budget, caching=False)),
        ("prefix_on", lambda: run_prefix(model, shared, prefix_budget, caching=True)),
    ]
    steps = prefix_steps if args.only == "prefix" else steps + prefix_steps
    for name, fn in steps:
        guarded(name, fn, rows)
        save()
    print(json.dumps(report["ratios"], indent=1))


def ratios(rows: dict) -> dict:
    out: dict[str, object] = {}
    tps = {k: v["tokens_per_s"] for k, v in rows.items() if "tokens_per_s" in v}
    for ours in ("kvpool_loop", "kvpool_loop_graphs"):
        for name in ("hf_dynamic_sdpa", "hf_static_first_2_batches", "hf_continuous_batching"):
            if ours in tps and name in tps:
                out[f"{ours}_over_{name}_tokens_per_s"] = tps[ours] / tps[name]
    for bsz in (1, 32):
        h = tps.get(f"fixed_b{bsz}_hf_dynamic")
        ms = {}
        for ours in ("kvpool", "kvpool_graphs", "hf_dynamic"):
            k = tps.get(f"fixed_b{bsz}_{ours}")
            if k:
                ms[ours] = 1e3 * bsz / k  # a step gives each of the bsz sequences a token
                if h and ours != "hf_dynamic":
                    out[f"fixed_b{bsz}_{ours}_over_hf_dynamic"] = k / h
        if ms:  # at batch 1: ms per output token
            out[f"fixed_b{bsz}_ms_per_step"] = ms
    on, off = rows.get("prefix_on", {}), rows.get("prefix_off", {})
    if "tokens_per_s" in on and "tokens_per_s" in off:
        out["prefix_on_over_off_tokens_per_s"] = on["tokens_per_s"] / off["tokens_per_s"]
        out["prefix_off_over_on_ttft_p50"] = off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"]
        out["prefix_off_over_on_prefill_tokens"] = off["prefill_tokens"] / max(
            on["prefill_tokens"], 1
        )
    return out
