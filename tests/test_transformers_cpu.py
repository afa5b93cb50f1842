"""A transformers Llama generating through a host kvpool pool (the NumPy float64 reference
kernels) against transformers' own cache; skipped where torch or transformers is missing."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvpool  # noqa: E402
from hf_common import decision_margins, kvpool_logits, llama, reference_logits, ulp  # noqa: E402
from kvpool.generation import GenerationRequest, generate, gumbel_noise  # noqa: E402
from kvpool.integrations.transformers import (  # noqa: E402
    TransformersRunner,
    layout_for,
    pool_layer,
    sample,
)

# transformers' own deprecation notices are not ours to fail on
pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)


@pytest.mark.parametrize("prefill", ["kernel", "sdpa"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_teacher_forced_logits_match_dynamic_cache(kv_heads, prefill):
    model = llama(torch.float32, "cpu", kv_heads=kv_heads)
    rng = np.random.default_rng(kv_heads)
    prompts = [rng.integers(0, 101, n).tolist() for n in (1, 7, 16, 23)]
    forced = [rng.integers(0, 101, n).tolist() for n in (5, 9, 3, 12)]
    ours = kvpool_logits(model, prompts, forced, block_size=4, prefill=prefill)
    for p, f, got in zip(prompts, forced, ours):
        ref = reference_logits(model, p, f)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_teacher_forced_check_fails_on_a_wrong_token():
    model = llama(torch.float32, "cpu")
    prompts, forced = [[3, 4, 5, 6, 7]], [[8, 9, 10]]
    ours = kvpool_logits(model, prompts, forced, block_size=4)[0]
    ref = reference_logits(model, [3, 4, 5, 6, 7], [8, 9, 11])
    assert not torch.allclose(ours[-1], ref[-1], atol=1e-4)


def test_greedy_generation_matches_transformers_generate():
    model = llama(torch.float32, "cpu", seed=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 101, n).tolist() for n in (3, 11, 6, 20, 1)]
    pool = kvpool.Pool(layout_for(model, 4), 24, device="host")
    reqs = [GenerationRequest(i, p, 12) for i, p in enumerate(prompts)]
    res = generate(TransformersRunner(model, pool), pool, reqs, max_running_seqs=4)
    model.set_attn_implementation("sdpa")
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])  # an explicit mask: token 0 in a prompt is not padding
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )
        assert res.outputs[i] == ref[0, len(p) :].tolist()
    assert pool.num_free == pool.num_blocks


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_generated_tokens_are_the_samplers_decisions_on_the_reference_logits(temperature):
    """What the GPU loop test checks on bf16: every generated token, rescored on transformers'
    logits of prompt + output in one forward, is the sampler's decision (here float32, so to
    within a few float32 ulps); and the check fails on a replaced token."""
    model = llama(torch.float32, "cpu", seed=2, lm_head_spread=1.0)
    rng = np.random.default_rng(5)
    reqs = [
        GenerationRequest(
            i, rng.integers(0, 101, n).tolist(), 10, temperature=temperature, seed=40 + i
        )
        for i, n in enumerate((2, 9, 17))
    ]
    pool = kvpool.Pool(layout_for(model, 4), 7, device="host")  # too small for all three
    res = generate(TransformersRunner(model, pool), pool, reqs, max_running_seqs=3)
    assert res.num_preemptions > 0
    for r in reqs:
        out = res.outputs[r.request_id]
        logits = reference_logits(model, list(r.prompt) + out[:-1], [])
        margins, scales = decision_margins(logits, len(r.prompt), out, temperature, r.seed)
        assert (margins <= 8 * ulp(torch.float32, scales.max()) / (temperature or 1.0)).all()
        wrong = out[:-1] + [int(logits[-1].argmin())]
        assert decision_margins(logits, len(r.prompt), wrong, temperature, r.seed)[0][-1] > 0.1


def test_torch_sampling_matches_numpy():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((6, 50))
    temps = np.array([0.0, 0.5, 1.0, 2.0, 1.0, 0.0], np.float32)
    seeds, pos = np.arange(6, dtype=np.int64) * 7, np.arange(6, dtype=np.int64) + 3
    from kvpool.generation import sample as np_sample

    got = sample(torch.from_numpy(logits), temps, seeds, pos).numpy()
    assert got.tolist() == np_sample(logits, temps, seeds, pos).tolist()
    assert np.isfinite(gumbel_noise(seeds, pos, 50)).all()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_pool_layer_shares_memory_with_the_host_pool(dtype):
    pool = kvpool.Pool(kvpool.KvLayout(2, 2, 8, 4, dtype), 3, device="host")
    t = pool_layer(pool, 1, "v")
    assert t.shape == (3, 4, 2, 8)
    t[2, 1, 0, 3] = 5.0
    assert np.asarray(pool.v_view(1))[2, 1, 0, 3] == 5.0
    assert np.asarray(pool.k_view(1))[2, 1, 0, 3] == 0.0


def test_packed_layout_round_trips_int32_and_int64_arrays():
    """One int32 buffer holding a step's arrays at 16-byte offsets, so that the torch slices
    of int64 arrays view as int64 (what the GPU upload relies on); empty arrays included."""
    from kvpool.integrations.packed_upload import PackedLayout

    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(-(2**40), 2**40, 5),
        rng.integers(-9, 9, (3, 7)).astype(np.int32),
        rng.integers(0, 2**40, 3),
        np.zeros((0, 4), np.int32),
        np.zeros(0, np.int64),
        rng.integers(-9, 9, 1).astype(np.int32),
    ]
    layout = PackedLayout.of([a.shape for a in arrays], [a.dtype for a in arrays])
    assert all(off % 4 == 0 for off in layout.offsets)
    buf = np.zeros(layout.total, np.int32)
    for view, a in zip(layout.views(buf), arrays):
        view[...] = a
    for got, a in zip(layout.views(torch.from_numpy(buf)), arrays):
        assert got.dtype == {np.int64: torch.int64, np.int32: torch.int32}[a.dtype.type]
        assert got.numpy().tolist() == a.tolist() and got.shape == a.shape


def test_cuda_graphs_are_refused_on_a_host_pool():
    model = llama(torch.float32, "cpu")
    pool = kvpool.Pool(layout_for(model, 4), 4, device="host")
    with pytest.raises(ValueError, match="CUDA pool"):
        TransformersRunner(model, pool, cuda_graphs=True)


def test_kvpool_cache_generate_matches_dynamic_cache_greedy_with_eos():
    """model.generate with a KvpoolCache on a host pool (float64 reference kernels, float32
    model): a left-padded batch of 4 ragged prompts; the same tokens as the default cache, an
    EOS that ends two rows early releases their blocks, and the pool is whole afterwards."""
    from hf_common import cache_generate, dynamic_generate

    model = llama(torch.float32, "cpu", seed=2)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 101, n).tolist() for n in (5, 1, 12, 8)]
    ref, _ = dynamic_generate(model, prompts, 10)
    eos = ref[0][3]  # a token the first row emits at step 3: it finishes there
    pad = (eos + 1) % 101
    ref, _ = dynamic_generate(model, prompts, 10, eos=eos, pad_token_id=pad)
    pool = kvpool.Pool(layout_for(model, 4), 40, device="host")
    ours, _, released = cache_generate(model, pool, prompts, 10, eos=eos, pad_token_id=pad)
    assert ours == ref
    assert len(ours[0]) == 4 and released == {i for i, r in enumerate(ours) if r[-1] == eos}


def test_kvpool_cache_teacher_forced_logits_match_dynamic_cache():
    """The logits generate() saw at every step (prefill of a padded batch, then decodes) from
    the kvpool cache against the default cache's, float32: within 1e-4."""
    from hf_common import cache_generate, dynamic_generate

    model = llama(torch.float32, "cpu", kv_heads=1, seed=3)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 101, n).tolist() for n in (9, 2, 17)]
    ref, ref_logits = dynamic_generate(model, prompts, 6)
    pool = kvpool.Pool(layout_for(model, 4), 40, device="host")
    ours, logits, _ = cache_generate(model, pool, prompts, 6)
    assert ours == ref
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_kvpool_cache_sampling_equals_dynamic_cache_with_the_same_seed():
    from hf_common import cache_generate, dynamic_generate

    model = llama(torch.float32, "cpu", seed=4)
    prompts = [[5, 6, 7], [9], [1, 2, 3, 4, 5, 6]]
    torch.manual_seed(0)
    ref, _ = dynamic_generate(model, prompts, 8, do_sample=True, temperature=1.0, top_k=0)
    torch.manual_seed(0)
    pool = kvpool.Pool(layout_for(model, 4), 30, device="host")
    ours, _, _ = cache_generate(model, pool, prompts, 8, do_sample=True, temperature=1.0, top_k=0)
    assert ours == ref


def test_attention_without_a_cache_or_step_raises():
    from kvpool.integrations.transformers import register

    model = llama(torch.float32, "cpu")
    register()
    model.set_attn_implementation("kvpool")
    with pytest.raises(ValueError, match="KvpoolCache"), torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), use_cache=False)


def test_the_cache_logits_check_sees_a_misplaced_token(monkeypatch):
    """Mutation: the packed step's last token gathered from its neighbour's column; the
    per-step logits then miss the default cache's by far more than the tolerance."""
    import kvpool.integrations.hf_cache as hf_cache
    from hf_common import cache_generate, dynamic_generate

    real = hf_cache.plan_padded_step

    def misplaced(cached, new, width):
        plan = real(cached, new, width)
        gather = plan.gather.copy()
        gather[-1] = gather[-2]
        return hf_cache.PaddedStep(plan.decode_rows, plan.prefill_rows, plan.new_lens, gather)

    model = llama(torch.float32, "cpu", seed=3)
    prompts = [[4, 8, 15, 16], [23, 42, 7]]
    _, ref_logits = dynamic_generate(model, prompts, 2)
    monkeypatch.setattr(hf_cache, "plan_padded_step", misplaced)
    pool = kvpool.Pool(layout_for(model, 4), 12, device="host")
    _, logits, _ = cache_generate(model, pool, prompts, 2)
    assert not torch.allclose(logits[0], ref_logits[0], atol=1e-4, rtol=1e-4)


# The traps of the transformers path: each one is refused with a clear error or works.


def test_a_kvpool_cache_under_sdpa_attention_is_refused_before_anything_is_written():
    """Without "kvpool" attention, transformers' SDPA took the states the cache hands back as
    the whole cache: generate ran, attended to the new tokens only and gave wrong tokens with
    nothing in the pool."""
    from kvpool.integrations.transformers import KvpoolCache

    model = llama(torch.float32, "cpu")
    model.set_attn_implementation("sdpa")
    pool = kvpool.Pool(layout_for(model, 4), 16, device="host")
    cache = KvpoolCache(model, pool, max_batch_size=1, max_cache_len=20)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(kvpool.InvalidArgumentError, match="attend with 'kvpool'"):
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache)
    assert pool.num_used == 0 and len(cache.tables) == 0


def test_the_runner_leaves_the_model_and_its_config_sharers_as_they_were():
    from transformers import LlamaForCausalLM

    model = llama(torch.float32, "cpu", seed=1)
    model.set_attn_implementation("sdpa")
    sibling = LlamaForCausalLM(model.config).eval()  # shares the config object
    assert sibling.config is model.config
    wrong = kvpool.Pool(kvpool.KvLayout(3, 2, 16, 4, "float32"), 8, device="host")
    with pytest.raises(kvpool.LayoutError):
        TransformersRunner(model, wrong)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    before = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    pool = kvpool.Pool(layout_for(model, 4), 16, device="host")
    runner = TransformersRunner(model, pool)
    assert model.config._attn_implementation == "sdpa"  # not switched by the constructor
    res = generate(runner, pool, [GenerationRequest(0, [5, 6, 7, 8], 6)])
    assert model.config._attn_implementation == "sdpa"  # nor after its steps
    assert res.outputs[0] == before[0, 4:].tolist()
    after = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(before, after)
    sibling(ids)  # the sibling still runs its own attention, no kvpool cache needed


def test_a_bfloat16_model_runs_on_a_host_pool():
    """bf16 weights and a bf16 host pool (the float64 reference kernels, results rounded to
    bf16): teacher-forced logits within a few bf16 ulps of transformers' own, and greedy
    generation equal to transformers' generate."""
    model = llama(torch.bfloat16, "cpu", seed=1, lm_head_spread=1.0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 101, n).tolist() for n in (3, 11, 6)]
    forced = [rng.integers(0, 101, n).tolist() for n in (4, 5, 3)]
    ours = kvpool_logits(model, prompts, forced, block_size=4)
    for p, f, got in zip(prompts, forced, ours):
        ref = reference_logits(model, p, f)
        tol = 4 * ulp(torch.bfloat16, float(ref.abs().max()))
        torch.testing.assert_close(got, ref, atol=tol, rtol=0)
    pool = kvpool.Pool(layout_for(model, 4), 24, device="host")
    assert pool.layout.dtype == "bfloat16"
    reqs = [GenerationRequest(i, p, 6) for i, p in enumerate(prompts)]
    res = generate(TransformersRunner(model, pool), pool, reqs)
    model.set_attn_implementation("sdpa")
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6)
        assert res.outputs[i] == want[0, len(p) :].tolist()


def test_an_unsupported_model_is_refused_naming_what_is_supported():
    from kvpool.integrations.transformers import KvpoolCache
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, bos_token_id=0, eos_token_id=0)
    gpt2 = GPT2LMHeadModel(cfg).eval()
    pool = kvpool.Pool(kvpool.KvLayout(2, 2, 16, 4, "float32"), 8, device="host")
    for make in (
        lambda: TransformersRunner(gpt2, pool),
        lambda: KvpoolCache(gpt2, pool, max_batch_size=1, max_cache_len=8),
    ):
        with pytest.raises(TypeError, match="Llama, Mistral, Qwen2") as e:
            make()
        assert "GPT2LMHeadModel" in str(e.value)


def test_a_model_of_a_dtype_no_pool_holds_is_a_layout_error():
    model = llama(torch.float32, "cpu").to(torch.float64)
    with pytest.raises(kvpool.LayoutError, match="float64"):
        layout_for(model)
