"""The buffers of the hybrid runner's CUDA-graph decode step (kvpool.integrations.hybrid_graphs)
checked without a GPU: on a host pool with HybridStep.plans_on_host the decode plans run their
float64 references, so a GraphStep (fixed buffers loaded per step, tables padded to a
power-of-two width with -1, one step object reused for every step of its shape) must give the
eager runner's logits on every decode step of a tiny gpt-oss (window 8 and full layers, sinks)
as its windows slide and its tables cross pages. What capture and replay add is checked on
the GPU (tests/test_hybrid_models_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvpool  # noqa: E402
from kvpool.generation.hybrid_batch import build_hybrid_step  # noqa: E402
from kvpool.integrations import hybrid_graphs as hg  # noqa: E402
from kvpool.integrations import hybrid_models as hm  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)

BOUND = 1e-9  # both runs are the plans' float64 references over the same pages


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def plans_on_host(monkeypatch):
    """Decode rows through the decode plans on a host pool (float32 allowed: the host
    reference reads it), as tests/test_hybrid_models_plans.py runs them."""
    from kvpool.integrations import hybrid_gpu

    monkeypatch.setattr(hm.HybridStep, "plans_on_host", True)
    monkeypatch.setattr(hybrid_gpu, "KERNEL_DTYPES", ("float16", "bfloat16", "float32"))


def _decode_steps():
    """Three sequences prefilled, then 24 decode steps. Per step the largest relative logit
    difference of the GraphStep against the eager runner, and the shapes the steps had."""
    from test_hybrid_models_cpu import VOCAB, spec_of
    from test_hybrid_models_plans import gpt_oss_hd64

    model = gpt_oss_hd64()
    spec = spec_of(model)
    pool = kvpool.Pool.for_spec(spec, 96, device="host")
    runner = hm.HybridTransformersRunner(model, pool, spec)
    tables = kvpool.HybridTables(pool, spec)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 11, 6)]
    for i, p in enumerate(prompts):
        tables.add(i, len(p))
    runner.logits(build_hybrid_step(tables, [], [(i, p, 0) for i, p in enumerate(prompts)], [], []))
    lens = [len(p) for p in prompts]
    steps: dict[tuple, hg.GraphStep] = {}
    errs, shapes = [], []
    for _ in range(24):
        dec = []
        for i in range(3):
            tables.append_tokens(i, 1)
            dec.append((i, int(rng.integers(0, VOCAB)), lens[i]))
            lens[i] += 1
        batch = build_hybrid_step(tables, dec, [], [0.0] * 3, [0] * 3)
        ref = runner.logits(batch)
        shape = hg.graph_shape(batch)
        step = steps.get(shape)
        if step is None:
            step = steps[shape] = hg.GraphStep(runner, batch)
        step.check(batch)
        step.load(batch)
        with torch.inference_mode():
            got = step.forward()
        errs.append(
            float(((got - ref).abs().max(dim=1).values / ref.abs().max(dim=1).values).max())
        )
        shapes.append(shape)
    for i in range(3):
        tables.free(i)
    assert pool.num_free == pool.num_blocks
    return errs, shapes


def test_a_graph_step_reused_per_shape_gives_the_eager_logits(plans_on_host):
    errs, shapes = _decode_steps()
    print(f"graph step vs eager: max relative logit difference {max(errs):.3g}")
    assert max(errs) <= BOUND
    # the tables grew within a width bucket and into the next: one step object served both
    assert len(set(shapes)) < len(shapes) and len(set(shapes)) > 1
    assert shapes[0][0] == 3 and all(len(s[1]) == 2 for s in shapes)


def test_a_graph_step_whose_tables_drop_one_key_fails_the_bound(plans_on_host, monkeypatch):
    """The mutation: the full group's seq_lens loaded one short (each row misses its newest
    key; on the window group the host plan's page check refuses that before a run)."""
    real = hg.GraphStep.load

    def short(self, batch):
        real(self, batch)
        for k, g in enumerate(self.group_ids):
            if self.runner.spec.groups[g].kind == "full":
                lens = self.layout.views(self.device_buf)[5 + 5 * k]
                lens -= 1

    monkeypatch.setattr(hg.GraphStep, "load", short)
    errs, _ = _decode_steps()
    print(f"graph step with seq_lens one short: max relative logit difference {max(errs):.3g}")
    assert min(errs) > 1e3 * BOUND


def test_covers_only_decode_steps_of_kernel_groups():
    from test_hybrid_models_cpu import gpt_oss, spec_of

    model = gpt_oss()
    spec = spec_of(model)
    pool = kvpool.Pool.for_spec(spec, 32, device="host")
    runner = hm.HybridTransformersRunner(model, pool, spec)
    tables = kvpool.HybridTables(pool, spec)
    tables.add(0, 4)
    prefill = build_hybrid_step(tables, [], [(0, [1, 2, 3, 4], 0)], [], [])
    assert not hg.covers(runner, prefill, 8)
    tables.append_tokens(0, 1)
    decode = build_hybrid_step(tables, [(0, 5, 4)], [], [0.0], [0])
    assert not hg.covers(runner, decode, 8)  # float32 groups: the decode kernel takes 16-bit
    tables.free(0)
    with pytest.raises(kvpool.InvalidArgumentError, match="CUDA"):
        hg.HybridGraphsRunner(model, pool, spec)
