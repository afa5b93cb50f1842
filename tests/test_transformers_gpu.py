"""transformers Llama-shaped models generating through a CUDA kvpool pool (marker `gpu`):
teacher-forced logits against transformers' own cache, greedy agreement, the continuous-
batching loop on a pool too small for its workload, and zero-copy torch views of the pool.

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

from hf_common import kvpool_logits, llama, reference_logits  # noqa: E402

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


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    path = os.environ.get("KVPOOL_TRANSFORMERS_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(REPORT, f, indent=1)


def _prompts(rng, vocab, lens):
    return [rng.integers(0, vocab, n).tolist() for n in lens]


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


def test_greedy_64_tokens_agree_or_diverge_at_a_near_tie():
    """Greedy continuations of 16 prompts: the fraction identical over 64 tokens. At a
    divergence (kvpool picked a, transformers b), both paths are scored on the common prefix:
    the ranking of a and b can only flip if the reference's gap is at most the two paths'
    error on those logits, so gap <= |err_a| + |err_b| (+ bf16 slack for the batched step)."""
    model = llama(torch.bfloat16, "cuda", **LLAMA_1B)
    rng = np.random.default_rng(11)
    prompts = _prompts(rng, LLAMA_1B["vocab"], rng.integers(4, 200, 16))
    pool = kvpool.Pool(layout_for(model), 2048, device="cuda")
    reqs = [GenerationRequest(i, p, 64) for i, p in enumerate(prompts)]
    ours = generate(TransformersRunner(model, pool), pool, reqs).outputs
    assert pool.num_free == pool.num_blocks
    same, cases = 0, []
    for i, p in enumerate(prompts):
        ref = model_generate(model, p, 64)
        if ref == ours[i]:
            same += 1
            continue
        j = next(k for k in range(64) if ref[k] != ours[i][k])
        a, b = ours[i][j], ref[j]
        r = reference_logits(model, p + ref[:j], [])[-1]
        o = kvpool_logits(model, [p + ref[:j]], [[]])[0][-1]
        gap = (r[b] - r[a]).item()
        err = (o[a] - r[a]).abs().item() + (o[b] - r[b]).abs().item()
        cases.append({"request": i, "step": j, "ref_gap": gap, "path_error": err})
    REPORT["greedy_64"] = {"identical_fraction": same / len(prompts), "divergences": cases}
    assert all(c["ref_gap"] <= c["path_error"] + 0.02 for c in cases), cases


def model_generate(model, prompt, n):
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        ids = torch.tensor([prompt], device="cuda")  # explicit mask: token 0 is not padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


def test_200_requests_through_a_small_pool_complete_without_leaks():
    model = llama(torch.bfloat16, "cuda", **SMALL)
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
    sample_ids = list(range(0, 200, 20))
    alone_same = sum(
        generate(runner, pool, [reqs[i]]).outputs[i] == res.outputs[i] for i in sample_ids)
    REPORT["loop_200"] = {"steps": res.num_steps, "peak_running": res.peak_running,
                          "preemptions": res.num_preemptions,
                          "alone_identical": f"{alone_same}/{len(sample_ids)}"}
    assert alone_same >= len(sample_ids) - 2  # bf16 GEMMs differ with batch size: rare flips


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
