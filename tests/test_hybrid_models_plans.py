"""The GPU wiring of the hybrid models path, checked without a GPU: `GroupPool` (one
attention group of a hybrid spec as the uniform pool kvpool's decode kernels take) against
the spec's own byte offsets, and a gpt-oss model's decode rows run through the same decode
plans the CUDA path makes (tables, seq_lens, first_page, window and sinks as it binds them),
on a host pool where each plan's run is the kernel's float64 reference
(`HybridStep.plans_on_host`). The kernels themselves are checked on the GPU
(tests/test_hybrid_models_gpu.py, tests/test_window_gpu.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvpool  # noqa: E402
from kvpool.integrations import hybrid_gpu as hg  # noqa: E402
from kvpool.integrations import hybrid_models as hm  # noqa: E402
from test_hybrid_models_cpu import BOUND, _spread_lm_head, max_error, spec_of  # noqa: E402
from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_group_pool_strides_are_the_specs_offsets():
    spec = kvpool.ModelKvSpec(
        [
            kvpool.KvGroup.sliding_window([0, 2, 3], 64, 2, 64, "bfloat16"),
            kvpool.KvGroup.full([1, 4], 1, 256, "bfloat16"),
            kvpool.KvGroup.recurrent_state([5], 3000),
        ],
        num_layers=6,
    )
    pool = kvpool.Pool.for_spec(spec, 8, device="host")
    for g in (0, 1):
        gp = hg.GroupPool(pool, spec, g)
        lay, st = gp.layout, gp.layout.strides()
        group = spec.groups[g]
        assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype) == (
            len(group.layers),
            group.num_kv_heads,
            group.head_dim,
            "bfloat16",
        )
        assert lay.block_size == spec.block_size(g) and st["block"] == spec.page_bytes
        for page in (0, 5):
            for layer in range(lay.num_layers):
                for part in ("k", "v"):
                    for token in (0, 1, lay.block_size - 1):
                        for head in range(lay.num_kv_heads):
                            for dim in (0, 7, lay.head_dim - 1):
                                want = spec.attention_offset_bytes(
                                    g, page, layer, part, token, head, dim
                                )
                                got = (
                                    gp.base_ptr
                                    - pool.base_ptr
                                    + page * st["block"]
                                    + layer * st["layer"]
                                    + (part == "v") * st["kv"]
                                    + token * st["token"]
                                    + head * st["head"]
                                    + dim * st["elem"]
                                )
                                assert got == want, (g, page, layer, part, token, head, dim)


def gpt_oss_hd64(seed=0):
    """The CPU tests' gpt-oss with head_dim 64 (gpt-oss's: the decode and prefill kernels
    both take it)."""
    torch.manual_seed(seed)
    cfg = GptOssConfig(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=64,
        head_dim=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    _spread_lm_head(model)
    return model


@pytest.fixture
def plans_on_host(monkeypatch):
    """Decode rows through the decode plans on a host pool (float32 allowed: the host
    reference reads it), every plan made recorded."""
    made: dict[str, list] = {"decode": [], "prefill": []}

    def recording(kind):
        real = getattr(kvpool, f"{kind}_plan")

        def plan(*args, **kwargs):
            made[kind].append((kwargs.get("window"), kwargs.get("use_sinks")))
            return real(*args, **kwargs)

        return plan

    monkeypatch.setattr(hm.HybridStep, "plans_on_host", True)
    monkeypatch.setattr(hg, "KERNEL_DTYPES", ("float16", "bfloat16", "float32"))
    for kind in made:
        monkeypatch.setattr(kvpool, f"{kind}_plan", recording(kind))
    return made


def test_gpt_oss_decode_rows_through_the_decode_plans(plans_on_host):
    model = gpt_oss_hd64()
    err = max_error(model, spec_of(model))
    print(f"gpt-oss decode rows through the plans: max relative logit error {err:.3g}")
    assert err < BOUND
    # window and full layers took both kinds of plan, the prefill ones with sinks
    assert {w for w, _ in plans_on_host["decode"]} == {8, None}
    assert set(plans_on_host["prefill"]) == {(8, True), (None, True)}


@pytest.mark.parametrize("kind", ["DecodePlan", "PrefillPlan"])
def test_sinks_left_out_of_a_plan_fail_the_bound(plans_on_host, monkeypatch, kind):
    plan_type = getattr(kvpool.kernels, kind)
    real = plan_type.run

    def without_sinks(self, q, layer, *, out=None, sinks=None):
        if sinks is not None and kind == "PrefillPlan":  # its run refuses None under use_sinks
            sinks = torch.full_like(sinks, -1e30)  # exp(-1e30) = 0: the sinks' share gone
        else:
            sinks = None
        return real(self, q, layer, out=out, sinks=sinks)

    monkeypatch.setattr(plan_type, "run", without_sinks)
    err = max_error(gpt_oss_hd64(), spec_of(gpt_oss_hd64()))
    print(f"sinks left out of the {kind}s: max relative logit error {err:.3g}")
    assert err > 10 * BOUND
