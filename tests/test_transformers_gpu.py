"""transformers Llama-shaped models generating through a CUDA kvpool pool (marker `gpu`):
greedy agreement with transformers' generate up to near-ties, the continuous-batching loop on
a pool too small for its workload (every token checked against the sampler's decision on
transformers' logits), CUDA-graph replays of decode steps against the same step run eagerly,
teacher-forced logits against transformers' own cache, and zero-copy torch views of the pool.

Numbers are written to $KVPOOL_TRANSFORMERS_REPORT (JSON) when it is set."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu,
              # transformers' own deprecation notices are not ours to fail on
              pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                         "ignore::UserWarning")]

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from hf_common import (  # noqa: E402
    decision_margins,
    kvpool_logits,
    llama,
    reference_logits,
    ulp,
)

import kvpool  # noqa: E402
from kvpool.generation import GenerationRequest, generate  # noqa: E402
from kvpool.integrations.transformers import (  # noqa: E402
    TORCH_DTYPES,
    TransformersRunner,
    layout_for,
    pool_layer,
)

REPORT: dict[str, object] = {}
LLAMA_1B = dict(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, inter=8192,
                vocab=128256)  # Llama-3.2-1B's shape
MQA_128 = dict(layers=4, hidden=1024, heads=8, kv_heads=1, head_dim=128, inter=2048, vocab=32000)
SMALL = dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, inter=512, vocab=1000)
DT = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(autouse=True)
def _report():  # after every test, so a run cut short keeps what it measured
    yield
    path = os.environ.get("KVPOOL_TRANSFORMERS_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(REPORT, f, indent=1)


def _prompts(rng, vocab, lens):
    return [rng.integers(0, vocab, n).tolist() for n in lens]


NEAR_TIE_ULPS = 4  # bf16 ulps of max|logit|: the logits' own rounding plus the hidden
# states' bf16 noise at other GEMM shapes (the divergences of the first H200 run: 1 ulp)


def test_greedy_64_tokens_agree_or_diverge_at_a_near_tie():
    """Greedy continuations of 16 prompts: the fraction identical over 64 tokens. The model's
    lm_head rows have spread norms, so greedy decisions usually have margins (with flat random
    logits the top two of 128k tokens are often within one bf16 ulp, and bf16 GEMMs that
    depend on the batch shape flip them). At a divergence (kvpool picked a, transformers b)
    both are rescored on the common prefix: the reference's recomputed gap r[b] - r[a] can
    only exceed the kvpool path's error on those logits (single-sequence recompute against the
    reference) by the batch-shape noise, which the reference shows itself (its generate's own
    gap against its recompute) and which is bounded by a few bf16 ulps of max|logit|."""
    model = llama(torch.bfloat16, "cuda", **LLAMA_1B, lm_head_spread=2.0)
    rng = np.random.default_rng(11)
    prompts = _prompts(rng, LLAMA_1B["vocab"], rng.integers(4, 200, 16))
    pool = kvpool.Pool(layout_for(model), 2048, device="cuda")
    reqs = [GenerationRequest(i, p, 64) for i, p in enumerate(prompts)]
    ours = generate(TransformersRunner(model, pool), pool, reqs).outputs
    assert pool.num_free == pool.num_blocks
    same, cases = 0, []
    for i, p in enumerate(prompts):
        ref, ref_logits = model_generate(model, p, 64)
        if ref == ours[i]:
            same += 1
            continue
        j = next(k for k in range(64) if ref[k] != ours[i][k])
        a, b = ours[i][j], ref[j]
        r = reference_logits(model, p + ref[:j], [])[-1]
        o = kvpool_logits(model, [p + ref[:j]], [[]])[0][-1]
        gap = (r[b] - r[a]).item()
        gen_gap = (ref_logits[j][b] - ref_logits[j][a]).item()
        case = {"request": i, "step": j, "ref_gap": gap, "ref_generate_gap": gen_gap,
                "ref_inconsistency": abs(gen_gap - gap),
                "path_error": (o[a] - r[a]).abs().item() + (o[b] - r[b]).abs().item(),
                "ulp": ulp(torch.bfloat16, r.abs().max().item())}
        case["bound"] = (case["path_error"] + case["ref_inconsistency"]
                         + NEAR_TIE_ULPS * case["ulp"])
        cases.append(case)
    REPORT["greedy_64"] = {"identical_fraction": same / len(prompts), "divergences": cases}
    assert all(c["ref_gap"] <= c["bound"] for c in cases), cases


def model_generate(model, prompt, n):
    """transformers' greedy generate (SDPA, DynamicCache): the tokens and each step's logits."""
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        ids = torch.tensor([prompt], device="cuda")  # explicit mask: token 0 is not padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [x[0].float() for x in out.logits]


CHOICE_ULPS = 8  # bf16 ulps of max|logit|: twice the near-tie bound, as the decode rows of a
# 64-sequence batch are compared with a one-sequence prefill of the whole text


def _choice_errors(model, req, out):
    """Margins (in bf16 ulps of each row's max|logit|) by which `out` misses the sampler's
    decision on the reference's logits of prompt + out (one forward, transformers' SDPA)."""
    logits = reference_logits(model, list(req.prompt) + out[:-1], [])
    margins, scales = decision_margins(logits, len(req.prompt), out, req.temperature, req.seed)
    unit = np.array([ulp(torch.bfloat16, s) for s in scales]) / (req.temperature or 1.0)
    return margins / unit


def test_200_requests_through_a_small_pool_complete_without_leaks():
    """200 requests (half greedy, half sampled) through a pool of a fraction of their KV, with
    preemptions. Every generated token of 15 of them is checked against the sampler's
    decision on transformers' own logits of the whole text (prompt + output, one forward):
    a token lost or misplaced in the pool, a wrong slot after a preemption, a wrong seed or
    position in the noise each move the decision by far more than the bound. Requests re-run
    alone must give the same tokens, or differ first at a near-tie of the reference."""
    model = llama(torch.bfloat16, "cuda", **SMALL, lm_head_spread=2.0)
    rng = np.random.default_rng(3)
    reqs = [GenerationRequest(i, rng.integers(0, 1000, int(rng.integers(1, 300))).tolist(),
                              int(rng.integers(1, 200)), temperature=float(i % 2), seed=i)
            for i in range(200)]
    pool = kvpool.Pool(layout_for(model), 256, device="cuda")  # 4096 token slots
    runner = TransformersRunner(model, pool)
    res = generate(runner, pool, reqs, max_running_seqs=64)
    assert all(len(res.outputs[r.request_id]) == r.max_new_tokens for r in reqs)
    assert res.num_preemptions > 0
    assert pool.num_free == pool.num_blocks
    pool.check_invariants()
    checked = list(range(0, 200, 20)) + list(range(1, 200, 40))
    worst, off_argmax = 0.0, 0
    for i in checked:
        err = _choice_errors(model, reqs[i], res.outputs[i])
        worst, off_argmax = max(worst, float(err.max())), off_argmax + int((err > 0).sum())
        assert err.max() <= CHOICE_ULPS, (i, int(err.argmax()), float(err.max()))
    wrong = list(res.outputs[0])  # the check can fail: one token replaced by the worst one
    logits = reference_logits(model, list(reqs[0].prompt) + wrong[:-1], [])
    wrong[-1] = int(logits[len(reqs[0].prompt) - 2 + len(wrong)].argmin())
    assert _choice_errors(model, reqs[0], wrong)[-1] > CHOICE_ULPS
    alone_same, flips = 0, []
    for i in range(0, 200, 20):
        alone = generate(runner, pool, [reqs[i]]).outputs[i]
        if alone == res.outputs[i]:
            alone_same += 1
            continue
        j = next(k for k in range(len(alone)) if alone[k] != res.outputs[i][k])
        r = reference_logits(model, list(reqs[i].prompt) + alone[:j], [])[-1]
        a, b = alone[j], res.outputs[i][j]
        flips.append({"request": i, "step": j, "gap_ulps": abs((r[a] - r[b]).item())
                      / ulp(torch.bfloat16, r.abs().max().item())})
    REPORT["loop_200"] = {"steps": res.num_steps, "peak_running": res.peak_running,
                          "preemptions": res.num_preemptions,
                          "tokens_checked": sum(len(res.outputs[i]) for i in checked),
                          "worst_choice_error_ulps": worst, "off_argmax_choices": off_argmax,
                          "alone_identical": f"{alone_same}/10", "alone_flips": flips}
    assert pool.num_free == pool.num_blocks
    assert all(f["gap_ulps"] <= CHOICE_ULPS for f in flips), flips


def test_cuda_graph_replay_equals_the_same_step_run_eagerly_bit_for_bit():
    """Decode steps of 5 sequences (bucket 8: 3 padding rows) replayed from a captured graph
    against the same padded step with the same decode plan run eagerly: equal bit for bit,
    over 4 steps whose KV each step appends (so a replay reading stale buffers would differ).
    The unpadded eager step is reported beside it (other GEMM shapes: last bits only)."""
    from kvpool.generation import build_step

    model = llama(torch.bfloat16, "cuda", **MQA_128)
    pool = kvpool.Pool(layout_for(model), 512, device="cuda")
    runner = TransformersRunner(model, pool, cuda_graphs=True)
    rng = np.random.default_rng(5)
    prompts = _prompts(rng, MQA_128["vocab"], (1, 17, 300, 64, 1000))
    tables = kvpool.BlockTables(pool, 8, 80)
    for i, p in enumerate(prompts):
        tables.add(i, len(p))
    first = runner.logits(build_step(tables, [], [(i, p, 0) for i, p in enumerate(prompts)],
                                     [], []))
    ends = np.cumsum([len(p) for p in prompts]) - 1
    tokens = first[torch.from_numpy(ends).cuda()].argmax(1).tolist()
    ids = np.arange(len(prompts), dtype=np.int64)
    worst_unpadded = 0.0
    for step in range(4):
        tables.append_tokens_many(ids, 1)
        dec = [(i, tokens[i], len(p) + step) for i, p in enumerate(prompts)]
        batch = build_step(tables, dec, [], [0.0] * 5, [0] * 5)
        eager = runner.graphs.logits(batch, replay=False).clone()
        graph = runner.graphs.logits(batch).clone()
        assert torch.isfinite(graph).all()
        assert torch.equal(graph, eager), (step, (graph - eager).abs().max().item())
        plain = runner.logits(batch)
        worst_unpadded = max(worst_unpadded, (plain - graph).abs().max().item())
        tokens = graph.argmax(1).tolist()
    changed = [(i, (tokens[i] + 1) % MQA_128["vocab"], len(p) + 3) for i, p in enumerate(prompts)]
    other = runner.graphs.logits(build_step(tables, changed, [], [0.0] * 5, [0] * 5)).clone()
    assert not torch.equal(other, graph)  # the comparison sees the inputs
    REPORT["cuda_graph_bitwise"] = {"steps": 4, "bucket": 8, "rows": 5,
                                    "graph_vs_unpadded_eager_max_abs": worst_unpadded}
    for i in range(len(prompts)):
        tables.free(i)
    assert pool.num_free == pool.num_blocks


def test_generate_with_cuda_graphs_makes_the_samplers_decisions():
    """The loop with graph replays for its decode-only steps (mixed steps stay eager), on a
    pool that forces preemptions: every token of 12 requests is the sampler's decision on
    transformers' logits (as in the loop test), and the outputs are compared with the eager
    runner's (the identical fraction is reported)."""
    model = llama(torch.bfloat16, "cuda", **SMALL, lm_head_spread=2.0)
    rng = np.random.default_rng(9)
    reqs = [GenerationRequest(i, rng.integers(0, 1000, int(rng.integers(1, 200))).tolist(),
                              int(rng.integers(1, 120)), temperature=float(i % 2), seed=i)
            for i in range(60)]
    pool = kvpool.Pool(layout_for(model), 160, device="cuda")
    graphed = TransformersRunner(model, pool, cuda_graphs=True)
    res = generate(graphed, pool, reqs, max_running_seqs=48)
    assert res.num_preemptions > 0 and len(graphed.graphs.captured) >= 2
    assert pool.num_free == pool.num_blocks
    for i in range(0, 60, 5):
        err = _choice_errors(model, reqs[i], res.outputs[i])
        assert err.max() <= CHOICE_ULPS, (i, int(err.argmax()), float(err.max()))
    eager = generate(TransformersRunner(model, pool), pool, reqs, max_running_seqs=48).outputs
    REPORT["generate_cuda_graphs"] = {
        "buckets": sorted(graphed.graphs.captured), "preemptions": res.num_preemptions,
        "identical_to_eager": sum(eager[r.request_id] == res.outputs[r.request_id]
                                  for r in reqs) / len(reqs)}


@pytest.mark.parametrize(("shape", "dtype", "prefill"), [
    ("llama_1b", "bfloat16", "kernel"), ("llama_1b", "float16", "kernel"),
    ("mqa_128", "bfloat16", "kernel"), ("mqa_128", "float16", "kernel"),
    ("llama_1b", "bfloat16", "sdpa"), ("mqa_128", "float16", "sdpa"),  # the cross-check path
])
def test_teacher_forced_logits_match_dynamic_cache(shape, dtype, prefill):
    """Per-token logits of the kvpool path against SDPA + DynamicCache on the same tokens.
    Bound: twice the dtype's own noise (the same reference in float32 against the reference
    in `dtype`) plus 1e-3."""
    kw = LLAMA_1B if shape == "llama_1b" else MQA_128
    model = llama(DT[dtype], "cuda", **kw)
    rng = np.random.default_rng(7)
    prompts = _prompts(rng, kw["vocab"], (1, 13, 64, 100, 37))
    forced = _prompts(rng, kw["vocab"], (20, 8, 17, 1, 33))
    ours = kvpool_logits(model, prompts, forced, prefill=prefill)
    refs = [reference_logits(model, p, f) for p, f in zip(prompts, forced)]
    model32 = model.float()
    refs32 = [reference_logits(model32, p, f) for p, f in zip(prompts, forced)]
    err = max((o - r).abs().max().item() for o, r in zip(ours, refs))
    noise = max((r - r32).abs().max().item() for r, r32 in zip(refs, refs32))
    bound = 2 * noise + 1e-3
    REPORT[f"teacher_forced_{shape}_{dtype}_{prefill}"] = {"max_abs_err": err, "dtype_noise": noise,
                                                 "bound": bound}
    assert err <= bound, (err, noise)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn"])
def test_torch_from_dlpack_shares_memory_with_the_pool(dtype):
    import cupy as cp

    pool = kvpool.Pool(kvpool.KvLayout(2, 2, 64, 16, dtype), 8, device="cuda")
    for layer in range(2):
        for part in ("k", "v"):
            view = pool.k_view(layer) if part == "k" else pool.v_view(layer)
            t = torch.from_dlpack(view)
            assert t.dtype == TORCH_DTYPES[dtype] and t.is_cuda
            assert pool_layer(pool, layer, part).data_ptr() == t.data_ptr()
            assert t.shape == (8, 16, 2, 64)
            assert t.data_ptr() == view.__cuda_array_interface__["data"][0]
            assert t.stride() == tuple(s // t.element_size()
                                       for s in view.__cuda_array_interface__["strides"])
            bits = {1: (torch.uint8, cp.uint8), 2: (torch.int16, cp.uint16),
                    4: (torch.int32, cp.uint32)}[t.element_size()]
            t.view(bits[0])[3, 5, 1, 7] = 0x38  # through torch ...
            torch.cuda.synchronize()
            assert int(cp.asarray(view).view(bits[1])[3, 5, 1, 7]) == 0x38  # ... seen by the pool
            t.view(bits[0]).zero_()
