"""Hybrid transformers models (gpt-oss: sliding-window and full layers with attention sinks;
Gemma 3: 5 local layers per global one, head_dim 256) generating through kvpool's hybrid KV
memory on a host pool (kvpool.integrations.hybrid_models), against the models' own default
cache (DynamicCache with its sliding-window layers) and attention (eager for gpt-oss, SDPA
for Gemma 3). Tiny random-weight configs of the real architectures; windows of 8 and 12
tokens that sequences of 40-70 tokens slide far past, on pages of 4 tokens, so window pages
are released as they leave the window. Skipped where torch or transformers is missing."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvpool  # noqa: E402
from kvpool.generation import GenerationRequest, generate, gumbel_noise  # noqa: E402
from kvpool.generation.hybrid_batch import build_hybrid_step  # noqa: E402
from kvpool.integrations import hybrid_models as hm  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface,
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)

VOCAB = 97
PAGE_TOKENS = 4  # tokens per page of every group (page_bytes chosen for it)
# Per logit row, |kvpool - the model's own| <= BOUND x max |logit of the row| (about 250
# float32 ulps of the row's largest logit; the models run in float32, kvpool attends in
# float64 from float32 pages). Measured over three seeds: at most 6.8e-6 (Gemma 3, logits
# up to 29) and 3.0e-6 (gpt-oss, up to 18); the mutations below give 1.2 to 2.3.
BOUND = 3e-5


def _spread_lm_head(model, spread=1.0):
    """Scale each lm_head row by exp(spread * N(0, 1)): greedy decisions get margins (equal
    row norms leave the top two of a vocabulary within a few ulps)."""
    w = model.lm_head.weight
    with torch.no_grad():
        w.mul_(torch.exp(spread * torch.randn(w.shape[0], 1)))


def gpt_oss(seed=0):
    torch.manual_seed(seed)
    cfg = GptOssConfig(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,  # sharper attention than 0.02: a wrong key shows in the logits
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # learned sinks are O(1); the init's 0.02 is not
            layer.self_attn.sinks.normal_(0.0, 1.0)
    _spread_lm_head(model)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def gemma3(seed=0):
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        num_hidden_layers=6,  # layer_types from sliding_window_pattern 6: 5 local, 1 global
        sliding_window=12,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        head_dim=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        query_pre_attn_scalar=64,  # scaling 1/8, not head_dim ** -0.5
        final_logit_softcapping=30.0,
        initializer_range=0.1,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )
    model = Gemma3ForCausalLM(cfg).eval()
    _spread_lm_head(model)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


MODELS = {"gpt-oss": gpt_oss, "gemma3": gemma3}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: with torch's intra-op threads on a loaded 2-core box each of
    their many small ops waits on the other thread (10x slower, measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def spec_of(model, widen=0):
    """The model's spec on pages of 4 tokens of its largest group (8 where 4 tokens are not
    a multiple of 256 bytes, as for the MLA model); `widen` widens the window group (a
    mutation)."""
    base = hm.spec_for_model(model)
    token_bytes = max(g.token_bytes for g in base.groups if g.token_bytes is not None)
    tokens = next(n for n in range(PAGE_TOKENS, 257) if n * token_bytes % 256 == 0)
    groups = [
        kvpool.KvGroup.sliding_window(
            g.layers, g.window + widen, g.num_kv_heads, g.head_dim, g.dtype
        )
        if g.kind == "sliding_window"
        else g
        for g in base.groups
    ]
    return kvpool.ModelKvSpec(groups, tokens * token_bytes)


def window_group(spec):
    return next((i for i, g in enumerate(spec.groups) if g.kind == "sliding_window"), None)


# --- the reference: the model's own cache and attention -----------------------------------


def reference_logits(model, tokens, chunks):
    """The model's default attention and DynamicCache over `tokens`, fed as `chunks` (token
    counts: the prompt's prefill chunks, then ones). float32 [len(tokens), vocab]."""
    cache = DynamicCache(config=model.config)
    out, at = [], 0
    with torch.inference_mode():
        for n in chunks:
            ids = torch.tensor([tokens[at : at + n]])
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            out.append(logits[0].float())
            at += n
    return torch.cat(out)


def ragged_sequences(seed):
    rng = np.random.default_rng(seed)
    prompts = [int(n) for n in (37, 9, 50)]
    totals = [int(n) for n in (64, 45, 70)]
    return [rng.integers(0, VOCAB, t).tolist() for t in totals], prompts


def kvpool_teacher_forced(model, seqs, prompts, spec, chunk=16, watch=None):
    """Every sequence through one HybridTables in packed ragged steps: prompts prefilled in
    chunks of `chunk` tokens while the others decode, then one decode per token. Returns per
    sequence (float32 logits [len(tokens), vocab], the chunks it was fed in), and checks
    after every step that each window table holds only its live pages."""
    pool = kvpool.Pool.for_spec(spec, 64, device="host")
    runner = hm.HybridTransformersRunner(model, pool, spec)
    tables = kvpool.HybridTables(pool, spec)
    done = [0] * len(seqs)
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    fed: list[list[int]] = [[] for _ in seqs]
    wg = window_group(spec)
    while any(d < len(s) for d, s in zip(done, seqs)):
        decode, prefill, order = [], [], []
        for i, s in enumerate(seqs):
            at = done[i]
            if at >= len(s):
                continue
            n = min(chunk, prompts[i] - at) if at < prompts[i] else 1
            if at == 0:
                tables.add(i, n)
            else:
                tables.append_tokens(i, n)
            if n == 1 and at >= prompts[i]:
                decode.append((i, s[at], at))
            else:
                prefill.append((i, s[at : at + n], at))
            fed[i].append(n)
        order = [d[0] for d in decode] + [p[0] for p in prefill]
        nd = len(decode)
        batch = build_hybrid_step(tables, decode, prefill, [0.0] * nd, [0] * nd)
        logits = runner.logits(batch)
        for k, i in enumerate(order):
            lo, hi = batch.seq_indptr[k], batch.seq_indptr[k + 1]
            rows[i].append(logits[lo:hi])
            done[i] += int(hi - lo)
            if wg is None:
                continue
            bs, window = spec.block_size(wg), spec.groups[wg].window
            first_page, pages, num_tokens = tables.table(i, wg)
            # Only the pages a query of this step or later reads are held: from the key the
            # step's first query (at num_tokens - fed) sees first.
            first_live = max(0, num_tokens - fed[i][-1] - window + 1)
            assert first_page == first_live // bs, (i, num_tokens, first_page)
            assert first_page + len(pages) == -(-num_tokens // bs)
        if watch is not None:
            watch(tables)
    for i in range(len(seqs)):
        tables.free(i)
    tables.check_invariants()
    assert pool.num_free == pool.num_blocks
    return [torch.cat(r) for r in rows], fed


def row_errors(got, ref):
    """Per row, max |got - ref| over max |ref| (the relative error BOUND is stated in)."""
    return (got - ref).abs().max(dim=1).values / ref.abs().max(dim=1).values


def max_error(model, spec, seed=0):
    """The largest relative logit error of kvpool's teacher-forced run (every prefill and
    decode row of three ragged sequences) against the model's own cache and attention."""
    seqs, prompts = ragged_sequences(seed)
    ours, fed = kvpool_teacher_forced(model, seqs, prompts, spec)
    errs = []
    for s, got, chunks in zip(seqs, ours, fed):
        ref = reference_logits(model, s, chunks)
        assert got.shape == ref.shape == (len(s), VOCAB)
        assert torch.isfinite(got).all()
        errs.append(float(row_errors(got, ref).max()))
    return max(errs)


def test_teacher_forced_logits_match_the_models_own_cache(model):
    err = max_error(model, spec_of(model))
    print(f"{model.config.model_type}: max relative logit error {err:.3g} (bound {BOUND})")
    assert err < BOUND


class _mutated:
    """Within the context, "kvpool_hybrid" is kvpool's attention with its arguments changed
    by `change` (a mutation of what reaches kvpool)."""

    def __init__(self, monkeypatch, change):
        self.monkeypatch, self.change = monkeypatch, change

    def __enter__(self):
        def attention(module, q, k, v, mask, **kw):
            return hm.hybrid_attention(module, q, k, v, mask, **self.change(kw))

        hm.register()
        mapping = AttentionInterface._global_mapping
        self.monkeypatch.setitem(mapping, hm.NAME, attention)
        # the runner registers the real function when made: keep the mutation in place
        self.monkeypatch.setattr(hm, "register", lambda: None)

    def __exit__(self, *exc):
        self.monkeypatch.undo()


def _widen(kw):
    w = kw.get("sliding_window")
    return {**kw, "sliding_window": None if w is None else w + 1}


def test_a_window_one_token_too_wide_fails_the_bound(model, monkeypatch):
    # The tables keep one more key (a spec one wider) and the attention reads it.
    with _mutated(monkeypatch, _widen):
        err = max_error(model, spec_of(model, widen=1))
    print(f"{model.config.model_type}: window + 1: max relative logit error {err:.3g}")
    assert err > 10 * BOUND


def test_a_window_wider_than_its_pages_is_refused(model, monkeypatch):
    # The spec's window as the model's: the page holding key p - w is released by the time
    # a query at p would read it, and the attention refuses rather than read a page it
    # does not hold.
    with (
        _mutated(monkeypatch, _widen),
        pytest.raises(kvpool.InvalidArgumentError, match="holds keys from"),
    ):
        max_error(model, spec_of(model))


def test_gpt_oss_sinks_dropped_fail_the_bound(monkeypatch):
    model = gpt_oss()
    with _mutated(monkeypatch, lambda kw: {**kw, "s_aux": None}):
        err = max_error(model, spec_of(model))
    print(f"gpt-oss without sinks: max relative logit error {err:.3g}")
    assert err > 10 * BOUND


# --- generation -----------------------------------------------------------------------------


def test_greedy_generation_matches_model_generate(model):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 23, 14)]
    new = 30
    spec = spec_of(model)
    pool = kvpool.Pool.for_spec(spec, 96, device="host")
    runner = hm.HybridTransformersRunner(model, pool, spec)
    reqs = [GenerationRequest(i, p, new) for i, p in enumerate(prompts)]
    res = generate(runner, pool, reqs, max_running_seqs=3, max_tokens_per_step=16, spec=spec)
    assert pool.num_free == pool.num_blocks
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            ref = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=new,
                do_sample=False,
            )
        assert res.outputs[i] == ref[0, len(p) :].tolist(), i


def test_continuous_batching_in_a_pool_too_small_for_all(model):
    """24 ragged requests in a pool holding a few of them at a time, every third one sampled
    (temperature 0.8): every request runs to its length, nothing leaks, and every token is
    the model's own choice on the request's tokens (one full forward of each; the greedy
    argmax, or the argmax of logits / t + the request's Gumbel noise: no other token more than
    BOUND ahead)."""
    rng = np.random.default_rng(2)
    n = 24
    prompts = [rng.integers(0, VOCAB, int(rng.integers(3, 41))).tolist() for _ in range(n)]
    news = [int(rng.integers(2, 25)) for _ in range(n)]
    spec = spec_of(model)
    alone = sum(spec.pages_to_add(len(p) + m) for p, m in zip(prompts, news))
    num_pages = 40
    assert alone > 4 * num_pages  # all at once would need more than four such pools
    pool = kvpool.Pool.for_spec(spec, num_pages, device="host")
    runner = hm.HybridTransformersRunner(model, pool, spec)
    temps = [0.8 if i % 3 == 1 else 0.0 for i in range(n)]
    reqs = [
        GenerationRequest(i, p, m, temperature=temps[i], seed=100 + i)
        for i, (p, m) in enumerate(zip(prompts, news))
    ]
    res = generate(runner, pool, reqs, max_running_seqs=8, max_tokens_per_step=48, spec=spec)
    # generate checked the drain: no request left in the tables, every page free, invariants.
    assert pool.num_free == pool.num_blocks
    pool.check_invariants()
    assert res.peak_running < n and res.num_preemptions > 0
    for i in range(n):
        assert res.finish_reasons[i] == "length"
        assert len(res.outputs[i]) == news[i]
        tokens = prompts[i] + res.outputs[i]
        with torch.inference_mode():
            ref = model(torch.tensor([tokens[:-1]])).logits[0].float()
        rows = ref[len(prompts[i]) - 1 :].double().numpy()
        scale = np.abs(rows).max(axis=1)
        if temps[i]:
            pos = np.arange(len(prompts[i]) - 1, len(tokens) - 1, dtype=np.int64)
            seeds = np.full(news[i], 100 + i, np.int64)
            rows = rows / temps[i] + gumbel_noise(seeds, pos, VOCAB)
            scale = scale / temps[i]
        chosen = rows[np.arange(news[i]), res.outputs[i]]
        assert ((rows.max(axis=1) - chosen) / scale).max() <= BOUND, i


def test_a_llama_is_one_full_group_and_generates_as_model_generate():
    """A model without layer_types (Llama) is one full group through the same path."""
    from hf_common import llama

    model = llama(torch.float32, "cpu", seed=1, lm_head_spread=1.0)
    spec = hm.spec_for_model(model)
    assert [g.kind for g in spec.groups] == ["full"] and spec.groups[0].layers == (0, 1)
    pool = kvpool.Pool.for_spec(spec, 16, device="host")
    prompts = [[5, 6, 7, 8, 9], list(range(20, 41))]
    reqs = [GenerationRequest(i, p, 10) for i, p in enumerate(prompts)]
    res = generate(hm.HybridTransformersRunner(model, pool), pool, reqs, spec=spec)
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.inference_mode():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10)
        assert res.outputs[i] == ref[0, len(p) :].tolist()


def test_a_mistral_window_on_every_layer_is_one_window_group():
    """No layer_types, a sliding_window: every layer slides (Mistral passes the window to
    each); teacher-forced logits within BOUND of its own cache, windows sliding past 8."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(
        num_hidden_layers=2,
        sliding_window=8,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.1,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )
    model = MistralForCausalLM(cfg).eval()
    spec = spec_of(model)
    assert [(g.kind, g.window, g.layers) for g in spec.groups] == [("sliding_window", 8, (0, 1))]
    err = max_error(model, spec)
    print(f"mistral: max relative logit error {err:.3g} (bound {BOUND})")
    assert err < BOUND


# --- DeepSeek-V3: MLA latents in kvpool's pages ----------------------------------------------


def deepseek_v3(seed=0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        num_hidden_layers=3,  # one dense layer, then MoE layers
        first_k_dense_replace=1,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,  # the latent (512 in DeepSeek-V3)
        qk_rope_head_dim=8,  # its rope part (64)
        qk_nope_head_dim=16,
        v_head_dim=16,
        initializer_range=0.1,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )
    model = DeepseekV3ForCausalLM(cfg).eval()
    _spread_lm_head(model)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def mla_model():
    return deepseek_v3()


def test_deepseek_v3_is_one_mla_group(mla_model):
    spec = hm.spec_for_model(mla_model)
    (g,) = spec.groups
    assert (g.kind, g.layers, g.latent_dim, g.rope_dim, g.dtype) == (
        "mla_latent",
        (0, 1, 2),
        32,
        8,
        "float32",
    )


def test_deepseek_v3_teacher_forced_logits_match_its_own_cache(mla_model):
    """One latent per token and layer in kvpool's pages, attended with the projections
    absorbed (the query taken into the latent space), against the model's own SDPA over
    DynamicCache's latents expanded per head."""
    err = max_error(mla_model, spec_of(mla_model))
    print(f"deepseek_v3: max relative logit error {err:.3g} (bound {BOUND})")
    assert err < BOUND


def test_deepseek_v3_latents_without_their_rope_part_fail_the_bound(mla_model, monkeypatch):
    real = hm._LatentWriter.update

    def no_rope(self, kv_nope, k_rope, layer_idx, *args, **kwargs):
        real(self, kv_nope, torch.zeros_like(k_rope), layer_idx)
        return kv_nope, k_rope

    monkeypatch.setattr(hm._LatentWriter, "update", no_rope)
    err = max_error(mla_model, spec_of(mla_model))
    print(f"deepseek_v3 without the latents' rope part: max relative logit error {err:.3g}")
    assert err > 10 * BOUND


def test_deepseek_v3_generates_as_model_generate_in_a_small_pool(mla_model):
    """Greedy generate(spec=) equal to model.generate, in a pool that holds a few of the
    requests at a time (preemptions), nothing leaked."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(3, 30, 8)]
    spec = spec_of(mla_model)
    pool = kvpool.Pool.for_spec(spec, 12, device="host")  # 8 tokens a page
    reqs = [GenerationRequest(i, p, 16) for i, p in enumerate(prompts)]
    runner = hm.HybridTransformersRunner(mla_model, pool, spec)
    res = generate(runner, pool, reqs, max_running_seqs=4, max_tokens_per_step=32, spec=spec)
    assert res.num_preemptions > 0 and pool.num_free == pool.num_blocks
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.inference_mode():
            ref = mla_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
            )
        assert res.outputs[i] == ref[0, len(p) :].tolist(), i


# --- Qwen3-Next: Gated DeltaNet states in kvpool's state slots ------------------------------


def qwen3_next(seed=0):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        num_hidden_layers=4,  # linear, full, linear, full
        full_attention_interval=2,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        initializer_range=0.1,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )
    model = Qwen3NextForCausalLM(cfg).eval()
    _spread_lm_head(model)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def state_model():
    return qwen3_next()


def test_qwen3_next_is_a_state_group_and_a_full_group(state_model):
    spec = spec_of(state_model)
    kinds = {g.kind: g for g in spec.groups}
    # conv [2 * 2 * 16 + 4 * 16, 4] float32 + recurrent [4, 16, 16] float32 per layer
    assert kinds["recurrent_state"].layers == (0, 2)
    assert kinds["recurrent_state"].bytes_per_layer == 128 * 4 * 4 + 4 * 16 * 16 * 4
    assert kinds["full"].layers == (1, 3)
    # 6,144 state bytes per layer over 2,048-byte pages: each layer's state spans 3 pages
    state = next(i for i, g in enumerate(spec.groups) if g.kind == "recurrent_state")
    assert spec.page_bytes == 2048 and spec.pages_per_slot(state) == 6


def test_qwen3_next_teacher_forced_logits_match_its_own_cache(state_model):
    """States carried in kvpool's slots from one prefill chunk and decode to the next,
    against the model's own DynamicCache (LinearAttentionLayers) fed the same chunks."""
    err = max_error(state_model, spec_of(state_model))
    print(f"qwen3_next: max relative logit error {err:.3g} (bound {BOUND})")
    assert err < BOUND


def test_qwen3_next_with_a_state_not_carried_fails_the_bound(state_model, monkeypatch):
    real = hm.PageViews.read_state

    def fresh(self, layer, slot, nbytes):  # as if each step started the recurrence anew
        return torch.zeros_like(real(self, layer, slot, nbytes))

    monkeypatch.setattr(hm.PageViews, "read_state", fresh)
    err = max_error(state_model, spec_of(state_model))
    print(f"qwen3_next with its states dropped: max relative logit error {err:.3g}")
    assert err > 10 * BOUND


def test_qwen3_next_generates_as_model_generate_in_a_small_pool(state_model):
    """Greedy generate(spec=) equal to model.generate in a pool that holds a few requests at
    a time (preemptions): every state slot and page back at the end."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(3, 25, 6)]
    spec = spec_of(state_model)
    pool = kvpool.Pool.for_spec(spec, 40, device="host")  # a slot is 6 pages
    reqs = [GenerationRequest(i, p, 12) for i, p in enumerate(prompts)]
    runner = hm.HybridTransformersRunner(state_model, pool, spec)
    res = generate(runner, pool, reqs, max_running_seqs=4, max_tokens_per_step=24, spec=spec)
    assert res.num_preemptions > 0 and pool.num_free == pool.num_blocks
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.inference_mode():
            ref = state_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
            )
        assert res.outputs[i] == ref[0, len(p) :].tolist(), i


# --- what is refused -----------------------------------------------------------------------


def test_generate_with_a_spec_refuses_a_swapper_and_prefix_caching():
    model = gpt_oss()
    spec = spec_of(model)
    pool = kvpool.Pool.for_spec(spec, 16, device="host")
    runner = hm.HybridTransformersRunner(model, pool, spec)
    req = [GenerationRequest(0, [1, 2, 3], 2)]
    with pytest.raises(ValueError, match="swapper"):
        generate(runner, pool, req, spec=spec, make_swapper=lambda backend: None)
    cached = kvpool.Pool(
        kvpool.KvLayout(1, 1, spec.page_bytes // 4, 1),
        16,
        device="host",
        enable_prefix_caching=True,
    )
    with pytest.raises(ValueError, match="prefix caching"):
        generate(runner, cached, req, spec=spec)
    assert pool.num_free == pool.num_blocks


def test_spec_for_model_groups():
    spec = hm.spec_for_model(gpt_oss())
    kinds = {g.kind: g for g in spec.groups}
    assert kinds["full"].layers == (1, 3) and kinds["sliding_window"].layers == (0, 2)
    assert kinds["sliding_window"].window == 8
    assert (kinds["full"].num_kv_heads, kinds["full"].head_dim, kinds["full"].dtype) == (
        2,
        16,
        "float32",
    )
    g3 = hm.spec_for_model(gemma3().config, dtype=torch.bfloat16)
    kinds = {g.kind: g for g in g3.groups}
    assert kinds["full"].layers == (5,) and kinds["sliding_window"].layers == (0, 1, 2, 3, 4)
    assert kinds["full"].head_dim == 256 and kinds["full"].dtype == "bfloat16"


def test_unsupported_configs_are_refused_naming_what():
    from transformers import DeepseekV2Config, Llama4TextConfig

    cases = [
        (DeepseekV2Config(num_hidden_layers=2), "MLA attention"),
        (Llama4TextConfig(num_hidden_layers=4), "chunked"),
        (Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True), "bidirect"),
    ]
    for cfg, what in cases:
        with pytest.raises(hm.UnsupportedModelError, match=what):
            hm.spec_for_model(cfg)
    assert issubclass(hm.UnsupportedModelError, kvpool.KvError)
    cfg = GptOssConfig(num_hidden_layers=2, layer_types=["sliding_attention"] * 2)
    cfg.sliding_window = None
    with pytest.raises(hm.UnsupportedModelError, match="sliding_window"):
        hm.spec_for_model(cfg)
    cfg = GptOssConfig(num_hidden_layers=2)
    cfg.layer_types = ["linear_attention", "full_attention"]  # not a model whose states run
    with pytest.raises(hm.UnsupportedModelError, match="linear_attention"):
        hm.spec_for_model(cfg)
    cfg.layer_types = ["full_attention"] * 3
    with pytest.raises(hm.UnsupportedModelError, match="layer_types"):
        hm.spec_for_model(cfg)
    with pytest.raises(hm.UnsupportedModelError, match="dtype"):
        hm.spec_for_model(GptOssConfig(num_hidden_layers=2), dtype=torch.float64)


def test_runner_refusals():
    model = gpt_oss()
    spec = spec_of(model)
    with pytest.raises(TypeError):
        hm.HybridTransformersRunner(object(), kvpool.Pool.for_spec(spec, 8, device="host"))
    narrow = kvpool.ModelKvSpec(
        [
            g
            if g.kind == "full"
            else kvpool.KvGroup.sliding_window(g.layers, 7, g.num_kv_heads, g.head_dim, g.dtype)
            for g in spec.groups
        ],
        spec.page_bytes,
    )
    with pytest.raises(kvpool.LayoutError, match="layer 0"):
        hm.check_spec(model, narrow)
    hm.check_spec(model, spec_of(model, widen=3))  # a wider window only holds more
    other = kvpool.ModelKvSpec(spec.groups, 2 * spec.page_bytes)
    with pytest.raises(kvpool.LayoutError, match="bytes"):
        hm.HybridTransformersRunner(model, kvpool.Pool.for_spec(other, 8, device="host"), spec)
    default = hm.spec_for_model(model)
    runner = hm.HybridTransformersRunner(model, kvpool.Pool.for_spec(default, 8, device="host"))
    assert runner.spec == default
    with pytest.raises(TypeError, match="HybridStepBatch"):
        runner.logits(object())
    # outside a runner's forward the attention has no step to write to
    model.set_attn_implementation(hm.NAME)
    try:
        with pytest.raises(kvpool.InvalidArgumentError, match="hybrid step"):
            model(torch.tensor([[1, 2, 3]]))
    finally:
        model.set_attn_implementation("eager")


# --- model.generate with the hybrid cache ----------------------------------------------------


def _cache_generate(model, pool, spec, ids, mask, new, **kw):
    from kvpool.integrations.hybrid_cache import HybridKvpoolCache
    from transformers import StoppingCriteriaList

    default = model.config._attn_implementation
    hm.register()
    model.set_attn_implementation(hm.NAME)
    cache = HybridKvpoolCache(model, pool, max_batch_size=ids.shape[0], spec=spec)
    eos = kw.get("eos_token_id")
    stop = StoppingCriteriaList([cache.release_at_eos(eos)] if eos is not None else [])
    try:
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                past_key_values=cache,
                max_new_tokens=new,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
                stopping_criteria=stop,
                **kw,
            )
    finally:
        model.set_attn_implementation(default)
    released = set(cache.finished)
    cache.close()
    assert len(cache.tables) == 0 and pool.num_free == pool.num_blocks
    cache.tables.check_invariants()
    return out, released


def generate_against_default(model, new=30):
    """model.generate on a left-padded batch of 3 ragged prompts, `new` tokens, with the
    model's own cache and attention and with HybridKvpoolCache, an EOS (row 0's token at
    step 20) ending rows early. Returns (the sequences equal, the largest relative logit
    error of a row still running, the rows released at EOS, the rows that emitted it)."""
    from hf_common import left_padded

    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (5, 23, 14)]
    ids, mask = left_padded(prompts, "cpu")
    with torch.inference_mode():
        ref = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
    width = ids.shape[1]
    eos = int(ref.sequences[0, width + 20])  # row 0 emits it by step 20
    with torch.inference_mode():
        ref = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=(eos + 1) % VOCAB,
            return_dict_in_generate=True,
            output_logits=True,
        )
    spec = spec_of(model)
    pool = kvpool.Pool.for_spec(spec, 96, device="host")
    out, released = _cache_generate(
        model, pool, spec, ids, mask, new, eos_token_id=eos, pad_token_id=(eos + 1) % VOCAB
    )
    done = {i for i in range(3) if eos in ref.sequences[i, width:].tolist()}
    worst = 0.0
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        for i in range(3):
            ended = eos in ref.sequences[i, width : width + step].tolist()
            if not ended:  # a finished row's logits are padding's, never read
                worst = max(worst, float((a[i] - b[i]).abs().max() / b[i].abs().max()))
    same = out.sequences.shape == ref.sequences.shape and torch.equal(out.sequences, ref.sequences)
    return same, worst, released, done


def _assert_generate_matches(model, name):
    same, worst, released, done = generate_against_default(model)
    print(f"{name}: model.generate with HybridKvpoolCache, max relative logit error {worst:.3g}")
    assert same
    assert worst <= BOUND
    assert 0 in done and released == done


def test_model_generate_with_the_hybrid_cache_matches_the_default_cache(model):
    """A left-padded batch of 3 ragged prompts, 30 new tokens (far past the window): the same
    tokens as the model's own cache and attention, every step's logits within BOUND, and an
    EOS that ends a row early releases its pages."""
    _assert_generate_matches(model, model.config.model_type)


def test_deepseek_v3_model_generate_with_the_hybrid_cache(mla_model):
    """DeepSeek-V3's latents written by the cache's update at the step's slots, attended
    absorbed over the pages: generate's tokens and logits as its own DynamicCache and SDPA."""
    _assert_generate_matches(mla_model, "deepseek_v3")


def test_qwen3_next_model_generate_with_the_hybrid_cache(state_model):
    """Qwen3-Next's Gated DeltaNet states in kvpool's slots between forwards (loaded before
    each state layer, stored after), its full layers paged: as its own DynamicCache."""
    _assert_generate_matches(state_model, "qwen3_next")


def _drop_key_one(monkeypatch):
    """A cache that drops one position: no query attends to the key at position 1."""
    real = hm._GroupGather.__init__

    def dropped(self, gs, batch, window, device):
        real(self, gs, batch, window, device)
        bs, seq = gs.block_size, batch.token_seq
        key = np.arange(gs.page_ids.shape[1] * bs)
        pos = gs.key_start[seq][:, None] + key[None, :]
        self.seen &= torch.from_numpy(pos != 1).to(device)

    monkeypatch.setattr(hm._GroupGather, "__init__", dropped)


@pytest.mark.parametrize("which", ["gpt-oss", "deepseek_v3", "qwen3_next"])
def test_model_generate_with_a_cache_that_drops_one_position_fails(
    which, mla_model, state_model, monkeypatch
):
    """The equality check of the tests above catches a one-token bug: the key at position 1
    left out of every attention row (gpt-oss, DeepSeek-V3, Qwen3-Next's full layers)."""
    model = {
        "gpt-oss": gpt_oss,
        "deepseek_v3": lambda: mla_model,
        "qwen3_next": lambda: state_model,
    }[which]()
    _drop_key_one(monkeypatch)
    same, worst, _, _ = generate_against_default(model)
    print(f"{which} without the key at position 1: tokens equal {same}, logit error {worst:.3g}")
    assert not same and worst > 10 * BOUND


def test_qwen3_next_model_generate_with_a_state_step_dropped_fails(state_model, monkeypatch):
    """One decode step's states not stored back to the slots (that token left out of the
    recurrence of every later step): the check fails, so the states are carried by kvpool's
    slots, not by transformers' layers between forwards."""
    from kvpool.integrations.hybrid_cache import HybridKvpoolCache

    real = HybridKvpoolCache._store_states
    forwards: list[int] = []  # seen_width is distinct per forward

    def skip_one(self, layer):
        if self.seen_width not in forwards:
            forwards.append(self.seen_width)
        if len(forwards) != 5:  # the 4th decode step's states are not stored
            real(self, layer)

    monkeypatch.setattr(HybridKvpoolCache, "_store_states", skip_one)
    same, worst, _, _ = generate_against_default(state_model)
    print(f"qwen3_next with one step's states dropped: tokens equal {same}, error {worst:.3g}")
    assert not same and worst > 10 * BOUND


def test_the_hybrid_cache_under_another_attention_is_refused_before_anything_is_written():
    from kvpool.integrations.hybrid_cache import HybridKvpoolCache

    model = gpt_oss()
    spec = spec_of(model)
    pool = kvpool.Pool.for_spec(spec, 16, device="host")
    cache = HybridKvpoolCache(model, pool, max_batch_size=1, spec=spec)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(kvpool.InvalidArgumentError, match="kvpool_hybrid"):
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache)
    assert pool.num_used == 0 and len(cache.tables) == 0
