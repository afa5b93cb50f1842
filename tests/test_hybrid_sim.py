"""The hybrid simulator: presets against their cited config.json numbers and hybrid.md's page
table, config.json reading, the two baselines' accounting, HybridKv through the scheduler
(every request served once, no page leaked, shortfalls exact) and the CLI."""

import json
from dataclasses import replace
from pathlib import Path

import kvpool
import numpy as np
import pytest
from kvpool.scheduler import Request, Scheduler, SchedulerConfig, Seq
from kvpool.scheduler.hybrid import HybridKv
from kvpool.sim.hybrid_config import (
    ConfigError,
    estimate_params,
    layer_types,
    load_config,
    model_from_config,
    model_from_file,
)
from kvpool.sim.hybrid_presets import (
    FULL,
    HYBRID_PRESETS,
    QWEN3_NEXT_STATE_BYTES,
    RECURRENT_STATE,
    SLIDING_WINDOW,
    HybridModel,
    LayerGroup,
)
from kvpool.sim.hybrid_runner import SCHEMES, HybridSimulationSpec, run_scheme, simulate_hybrid
from kvpool.sim.hybrid_schemes import (
    all_full_scheme,
    hybrid_spec,
    page_pool,
    proxy_spec,
    same_geometry,
    scheme_groups,
    uniform_page_plan,
    uniform_page_spec,
)
from kvpool.sim.presets import PRESETS, ModelPreset
from kvpool.sim.workload import generate

CONFIGS = Path(__file__).parent / "hybrid_configs"

# rust/core/src/hybrid/hybrid.md, "Waste per model": page bytes, and per group its tokens
# per page (a token group) or pages per slot (a state group).
NOTE_TABLE = {
    "gpt-oss-20b": (393_216, [16, 16]),
    "gpt-oss-120b": (589_824, [16, 16]),
    "gemma-3-27b": (6_815_744, [16, 83]),
    "llama-4-scout": (2_359_296, [16, 48]),
    "qwen3-next-80b-a3b": (393_216, [36 * 3, 16]),
    "deepseek-v3": (4_497_408, [64]),
}


@pytest.mark.parametrize("name", sorted(NOTE_TABLE))
def test_each_preset_gives_the_page_table_of_the_design_note(name):
    spec = hybrid_spec(HYBRID_PRESETS[name])
    page_bytes, per_group = NOTE_TABLE[name]
    assert spec.page_bytes == page_bytes
    assert [spec.block_size(g) or spec.pages_per_slot(g) for g in range(spec.num_groups)] == (
        per_group
    )


def test_presets_carry_the_config_fields_they_cite():
    oss = HYBRID_PRESETS["gpt-oss-20b"]
    window, full = oss.groups
    # layer_types: "sliding_attention" on even layers, "full_attention" on odd ones.
    assert window.kind == SLIDING_WINDOW and window.layers == tuple(range(0, 24, 2))
    assert window.window == 128 and (window.num_kv_heads, window.head_dim) == (8, 64)
    assert full.kind == FULL and full.layers == tuple(range(1, 24, 2))
    assert HYBRID_PRESETS["gpt-oss-120b"].num_layers == 36
    gemma = HYBRID_PRESETS["gemma-3-27b"]
    assert gemma.groups[1].layers == tuple(i for i in range(62) if (i + 1) % 6 == 0)
    assert (gemma.groups[0].window, gemma.groups[0].num_kv_heads, gemma.num_q_heads) == (
        1024,
        16,
        32,
    )
    scout = HYBRID_PRESETS["llama-4-scout"]
    assert scout.groups[0].window == 8192 and len(scout.groups[1].layers) == 12
    qwen = HYBRID_PRESETS["qwen3-next-80b-a3b"]
    assert QWEN3_NEXT_STATE_BYTES == 1_097_728  # hybrid.md's figure
    assert qwen.groups[0].kind == RECURRENT_STATE and len(qwen.groups[0].layers) == 36
    assert qwen.state_bytes() == 36 * 1_097_728
    ds = HYBRID_PRESETS["deepseek-v3"].groups[0]
    assert (ds.latent_dim, ds.rope_dim, ds.num_layers) == (512, 64, 61)


@pytest.mark.parametrize("name", sorted(HYBRID_PRESETS))
def test_a_config_file_reads_as_its_preset(name):
    model = model_from_file(CONFIGS / f"{name}.json")
    preset = HYBRID_PRESETS[name]
    assert isinstance(model, HybridModel)
    assert model.name == name
    assert model.groups == preset.groups
    assert model.num_q_heads == preset.num_q_heads
    assert model.block_size == preset.block_size
    assert hybrid_spec(model).page_bytes == hybrid_spec(preset).page_bytes


def test_a_llama_config_is_a_uniform_preset_with_its_parameters_estimated():
    model = model_from_file(CONFIGS / "llama-3-8b.json")
    assert isinstance(model, ModelPreset)
    preset = PRESETS["llama-3-8b"]
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.num_q_heads) == (
        preset.num_layers,
        preset.num_kv_heads,
        preset.head_dim,
        preset.num_q_heads,
    )
    assert model.num_params == pytest.approx(preset.num_params, rel=0.01)


def test_moe_parameters_count_every_expert_and_activate_a_few():
    config = load_config(CONFIGS / "gpt-oss-20b.json")
    total, active = estimate_params(config)
    # 32 experts, 4 a token: the model card says 20.9B and 3.6B (biases and norms left out).
    assert total == pytest.approx(20.9e9, rel=0.05)
    assert active == pytest.approx(3.6e9, rel=0.15)


def test_layer_types_follow_the_rules_transformers_derives_them_by():
    assert (
        layer_types({"num_hidden_layers": 4, "full_attention_interval": 2})
        == [
            "linear_attention",
            "full_attention",
        ]
        * 2
    )
    assert layer_types(
        {"num_hidden_layers": 3, "sliding_window": 8, "sliding_window_pattern": 3}
    ) == ["sliding_attention", "sliding_attention", "full_attention"]
    assert layer_types(
        {"num_hidden_layers": 2, "attention_chunk_size": 8, "no_rope_layers": [1, 0]}
    ) == ["chunked_attention", "full_attention"]
    # A window the config switches off (Qwen2) is no window; one that is on covers all layers.
    assert set(layer_types({"num_hidden_layers": 2, "sliding_window": 4096})) == {
        "sliding_attention"
    }
    off = {"num_hidden_layers": 2, "sliding_window": 4096, "use_sliding_window": False}
    assert set(layer_types(off)) == {"full_attention"}


def _tiny(**extra):
    return {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_size": 256,
        "intermediate_size": 512,
        "vocab_size": 1000,
        **extra,
    }


def test_bad_configs_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="layer type 'mamba'"):
        model_from_config(_tiny(layer_types=["mamba", "full_attention"]), "x")
    with pytest.raises(ConfigError, match="layer_types has 1 entries"):
        model_from_config(_tiny(layer_types=["full_attention"]), "x")
    with pytest.raises(ConfigError, match="no sliding_window"):
        model_from_config(_tiny(layer_types=["sliding_attention", "full_attention"]), "x")
    with pytest.raises(ConfigError, match="num_hidden_layers must be a positive integer"):
        model_from_config(_tiny(num_hidden_layers="2"), "x")
    with pytest.raises(ConfigError, match="no linear_num_value_heads"):
        model_from_config(_tiny(full_attention_interval=2), "x")
    bad = tmp_path / "config.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        model_from_file(bad)
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="not a JSON file"):
        model_from_file(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        model_from_file(tmp_path / "missing.json")


def test_all_full_holds_every_attention_layer_and_reserves_states():
    oss = all_full_scheme(HYBRID_PRESETS["gpt-oss-20b"], "bfloat16", 256)
    assert oss.token_bytes == 24 * 2 * 8 * 64 * 2 and oss.block_bytes == 16 * oss.token_bytes
    assert oss.reserve_bytes == 0 and oss.num_blocks(2**30) == 2**30 // oss.block_bytes
    qwen = all_full_scheme(HYBRID_PRESETS["qwen3-next-80b-a3b"], "bfloat16", 64)
    assert qwen.token_bytes == 12 * 2 * 2 * 256 * 2  # the 12 full-attention layers only
    assert qwen.reserve_bytes == 64 * 36 * 1_097_728
    assert qwen.num_blocks(qwen.reserve_bytes + 5 * qwen.block_bytes + 1) == 5
    assert qwen.num_blocks(qwen.reserve_bytes - 1) == 0


def test_uniform_page_bytes_group_and_inflate_as_vllm_does():
    qwen = uniform_page_plan(HYBRID_PRESETS["qwen3-next-80b-a3b"])
    # One Gated DeltaNet layer (1,097,728 bytes) over 2,048 bytes a token: 536 -> 544 tokens.
    assert (qwen.block_size, qwen.group_size, len(qwen.groups)) == (544, 12, 4)
    assert qwen.page_bytes == 12 * 544 * 2048
    spec = uniform_page_spec(HYBRID_PRESETS["qwen3-next-80b-a3b"])
    assert [spec.block_size(g) or spec.pages_per_slot(g) for g in range(4)] == [1, 1, 1, 544]
    gemma = uniform_page_plan(HYBRID_PRESETS["gemma-3-27b"])
    # 52 sliding + 10 full layers: groups of 10, the sixth sliding group padded by 8 layers.
    assert (gemma.group_size, len(gemma.groups), gemma.num_padding_layers) == (10, 7, 8)
    assert uniform_page_spec(HYBRID_PRESETS["gemma-3-27b"]).num_layers == 70
    # gpt-oss's 12 + 12 layers: vLLM's pages are kvpool's.
    oss = HYBRID_PRESETS["gpt-oss-20b"]
    assert uniform_page_spec(oss).page_bytes == hybrid_spec(oss).page_bytes


@pytest.mark.parametrize("name", sorted(HYBRID_PRESETS))
def test_a_proxy_spec_keeps_the_geometry_of_the_real_one(name):
    model = HYBRID_PRESETS[name]
    for scheme, make in (("hybrid", hybrid_spec), ("uniform_page", uniform_page_spec)):
        spec = make(model)
        proxy, scale = proxy_spec(scheme_groups(model, scheme, "bfloat16"), spec, "bfloat16")
        assert scale > 1 and proxy.page_bytes * scale == spec.page_bytes
        assert same_geometry(proxy, spec)


def _mixed_model() -> HybridModel:
    """Small, with every kind that holds tokens or a state: shortfalls across kinds."""
    return HybridModel(
        "mixed",
        5,
        (
            LayerGroup(SLIDING_WINDOW, (0, 3), 2, 16, window=40),
            LayerGroup(FULL, (1,), 2, 16),
            LayerGroup("chunked_local", (2,), 2, 16, window=64),
            LayerGroup(RECURRENT_STATE, (4,), state_bytes_per_layer=3000),
        ),
        num_q_heads=4,
        num_params=1e8,
        active_params=1e8,
        block_size=4,
    )


def test_shortfalls_are_exactly_the_pages_an_append_takes():
    spec = hybrid_spec(_mixed_model(), "float16")
    rng = np.random.default_rng(0)
    for _ in range(40):
        backend = HybridKv(page_pool(spec, 400), spec)
        backend.max_chunk = 64
        seq = Seq(Request(1, 0.0, 300, 10))
        backend.tables.add(1, int(rng.integers(1, 50)))
        seq.kv_tokens = backend.tables.num_tokens(1)
        n = int(rng.integers(1, 70))
        need = backend._new_pages(seq, n)
        hold = backend.pool.alloc_many(backend.pool.num_free - need)
        if need:  # one page short
            one = backend.pool.alloc()
            assert backend.prefill_shortfall(seq, n) == 1
            with pytest.raises(kvpool.OutOfBlocksError):
                backend.extend(seq, n)
            backend.pool.free(one)
        assert backend.prefill_shortfall(seq, n) == 0
        backend.extend(seq, n)  # exactly enough
        seq.kv_tokens += n
        # Decoding one token: the same exactness for the batched call.
        need = sum(seq.kv_tokens % spec.block_size(g) == 0 for g in backend.token_groups)
        spare = backend.pool.num_free - need
        if spare < 0:  # the extend gave back fewer pages than a decode takes
            assert backend.decode_shortfall([seq]) == -spare
            with pytest.raises(kvpool.OutOfBlocksError):
                backend.decode([seq])
            backend.pool.free_many(hold[:-spare])
            hold = hold[-spare:]
        more = backend.pool.alloc_many(backend.pool.num_free - need)
        if need:
            one = backend.pool.alloc()
            assert backend.decode_shortfall([seq]) == 1
            with pytest.raises(kvpool.OutOfBlocksError):
                backend.decode([seq])
            backend.pool.free(one)
        assert backend.decode_shortfall([seq]) == 0
        backend.decode([seq])
        backend.pool.free_many(more)
        backend.pool.free_many(hold)
        backend.tables.free(1)
        backend.tables.check_invariants()


def _requests(n: int, max_len: int, seed: int = 0) -> list[Request]:
    return generate("sharegpt", n, seed=seed, max_model_len=max_len)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", ["gpt-oss-20b", "qwen3-next-80b-a3b", "gemma-3-27b"])
def test_every_request_is_served_once_and_no_page_leaks(name, scheme):
    # A small budget: requests preempt (recompute) and the pools run dry and refill.
    model = HYBRID_PRESETS[name]
    config = SchedulerConfig(max_model_len=2048, max_running_seqs=32, max_tokens_per_step=512)
    memory = 160 * 2**20 if name == "gpt-oss-20b" else 2 * 2**30
    spec = HybridSimulationSpec(model, memory, _requests(150, 2048), config)
    result = run_scheme(spec, scheme)  # _check_served and check_drained raise otherwise
    assert result["completed"] == 150
    assert 0 < result["kv_utilization"] <= 1.0
    if name == "gpt-oss-20b":
        assert result["preemptions"] > 0


def test_the_mixed_model_serves_through_the_scheduler():
    model = replace(_mixed_model(), name="mixed")
    spec = hybrid_spec(model, "float16")
    backend = HybridKv(page_pool(spec, 120), spec)
    config = SchedulerConfig(max_model_len=200, max_running_seqs=16, max_tokens_per_step=64)
    requests = [Request(i, 0.0, 20 + 7 * i % 150, 1 + 3 * i % 40) for i in range(60)]
    sched = Scheduler(backend, requests, config)
    sched.run()
    assert sched.num_finished == 60 and sched.num_preemptions > 0
    backend.check_drained()


def test_the_hybrid_report_compares_with_both_baselines():
    model = HYBRID_PRESETS["gpt-oss-20b"]
    config = SchedulerConfig(max_model_len=4096, max_running_seqs=64, max_tokens_per_step=4096)
    requests = [Request(i, 0.0, 3072, 256) for i in range(96)]
    report = simulate_hybrid(HybridSimulationSpec(model, 2**30, requests, config))
    full = report["comparison"]["hybrid_over_all_full"]
    # 12 full layers of 24 hold every token; the 12 window layers 128 + 16: about 2x.
    assert 1.6 < full["mean_running_ratio"] < 2.1
    assert report["comparison"]["hybrid_over_uniform_page"]["mean_running_ratio"] == 1.0
    util = report["results"]["all_full"]["kv_utilization"]
    assert util < 0.6 < report["results"]["hybrid"]["kv_utilization"]
    json.dumps(report)  # JSON-ready


def test_the_scheduler_does_not_import_the_simulator():
    import kvpool.scheduler.hybrid as hybrid

    source = Path(hybrid.__file__).read_text()
    assert "kvpool.sim" not in source


def test_the_cli_runs_a_hybrid_preset(tmp_path):
    from kvpool.sim.cli import main

    out = tmp_path / "report"
    argv = ["simulate", "--model", "GPT_OSS-20B", "--num-requests", "60", "--kv-memory", "1GiB"]
    assert main([*argv, "--out", str(out), "--no-plot", "--no-progress"]) == 0
    report = json.loads((out / "simulate.json").read_text())
    assert list(report["results"]) == list(SCHEMES)
    assert report["model"]["name"] == "gpt-oss-20b"
    assert all(r["completed"] == 60 for r in report["results"].values())


def test_the_cli_reads_a_model_config(tmp_path):
    from kvpool.sim.cli import main

    out = tmp_path / "report"
    argv = ["simulate", "--model-config", str(CONFIGS / "qwen3-next-80b-a3b.json")]
    argv += ["--num-requests", "30", "--kv-memory", "16GiB", "--max-running-seqs", "64"]
    assert main([*argv, "--out", str(out), "--no-plot", "--no-progress"]) == 0
    report = json.loads((out / "simulate.json").read_text())
    assert report["model"]["state_bytes_per_request"] == 36 * 1_097_728
    # A uniform config runs the paged-vs-contiguous simulation as a preset does.
    argv = ["simulate", "--model-config", str(CONFIGS / "llama-3-8b.json"), "--kv-memory", "1GiB"]
    assert main([*argv, "--num-requests", "20", "--out", str(out), "--no-plot"]) == 0
    assert "contiguous" in json.loads((out / "simulate.json").read_text())["results"]


def _cli_report(tmp_path, argv):
    from kvpool.sim.cli import main

    out = tmp_path / "report"
    assert main(["simulate", *argv, "--out", str(out), "--no-plot", "--no-progress"]) == 0
    return json.loads((out / "simulate.json").read_text())


def test_the_cli_serves_a_hybrid_model_with_prefix_caching(tmp_path):
    # 512-token system prompts: below one of the uniform page bytes' 544-token blocks.
    argv = ["--model", "qwen3-next-80b-a3b", "--num-requests", "80", "--kv-memory", "16GiB"]
    argv += ["--num-prefixes", "2", "--prefix-tokens", "512", "--max-running-seqs", "64"]
    report = _cli_report(tmp_path, [*argv, "--prefix-caching"])
    assert report["prefix_caching"] and list(report["results"]) == list(SCHEMES)
    res = report["results"]
    assert all(r["completed"] == 80 for r in res.values())
    assert res["hybrid"]["prefix_hit_rate"] > 0.5 and res["hybrid"]["checkpoints_stored"] == 2
    assert res["uniform_page"]["prefix_hit_rate"] == 0.0  # its states: whole blocks only
    assert res["all_full"]["prefix_hit_rate"] == 0.0  # its states: no checkpoints
    assert res["all_full"]["scheme"]["prefix_caching"].startswith("off")
    assert res["hybrid"]["prefill_tokens"] < res["all_full"]["prefill_tokens"]
    hits = report["comparison"]["hybrid_over_uniform_page"]["prefix_hit_rate"]
    assert hits == {"hybrid": res["hybrid"]["prefix_hit_rate"], "other": 0.0}
    # On by default when the requests share prompt tokens, off when asked.
    assert _cli_report(tmp_path, argv)["prefix_caching"]
    off = _cli_report(tmp_path, [*argv, "--no-prefix-caching"])
    assert not off["prefix_caching"] and off["results"]["hybrid"]["prefix_hit_rate"] == 0.0


def test_prefix_caching_on_a_model_without_states_caches_in_every_scheme(tmp_path):
    argv = ["--model", "gpt-oss-20b", "--num-requests", "80", "--kv-memory", "1GiB"]
    report = _cli_report(tmp_path, [*argv, "--num-prefixes", "2", "--prefix-tokens", "512"])
    res = report["results"]
    assert res["all_full"]["scheme"]["prefix_caching"].startswith("on")
    assert all(r["prefix_hit_rate"] > 0.3 for r in res.values())


def test_the_cli_refuses_what_a_hybrid_run_does_not_model(tmp_path, capsys):
    from kvpool.sim.cli import main

    base = ["simulate", "--model", "gpt-oss-20b", "--out", str(tmp_path / "r")]
    assert main([*base, "--cpu-kv-memory", "1GiB"]) == 2
    assert "--cpu-kv-memory is not modelled with a hybrid model" in capsys.readouterr().err
    assert main([*base, "--kv-memory", "100MiB", "--max-model-len", "65536"]) == 2
    assert "fewer than the" in capsys.readouterr().err
    # 400 pages hold Qwen3-Next's 2k prefill (236 pages) but not, with caching, the prompt,
    # a checkpoint and a hit's copies at admission (453 pages).
    qwen = ["simulate", "--model", "qwen3-next-80b-a3b", "--out", str(tmp_path / "r")]
    qwen += ["--kv-memory", "150MiB", "--max-model-len", "2048", "--max-running-seqs", "1"]
    assert main([*qwen, "--prefix-caching"]) == 2
    assert "at admission with prefix caching" in capsys.readouterr().err
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(_tiny(layer_types=["mamba", "full_attention"])))
    assert main(["simulate", "--model-config", str(bad), "--out", str(tmp_path / "r")]) == 2
    assert "layer type 'mamba'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


# hybrid.md's "all-full / ours" column: the uniform pool's bytes over the hybrid pages' for
# requests of 32,768 to 33,023 tokens in decode (Llama 4 Scout at a chunk's start).
ALL_FULL_OVER_OURS = {"gpt-oss-20b": 1.99, "gpt-oss-120b": 1.99, "gemma-3-27b": 5.31}


@pytest.mark.parametrize("name", sorted(ALL_FULL_OVER_OURS))
def test_the_presets_hold_the_note_s_all_full_ratio(name):
    model = HYBRID_PRESETS[name]
    spec = hybrid_spec(model)
    full_token_bytes = model.all_full_token_bytes()
    ours = uniform = 0
    for n in range(32_768, 33_024):
        pages = sum(len(range(*spec.live_pages(g, n, n - 1))) for g in range(spec.num_groups))
        ours += pages * spec.page_bytes
        uniform += -(-n // 16) * 16 * full_token_bytes
    assert uniform / ours == pytest.approx(ALL_FULL_OVER_OURS[name], abs=0.005)


def test_the_benchmark_routine_writes_its_json_targets_and_table(tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "hybrid_sim.json"
    args = ["--models", "gpt-oss-20b,gemma-3-27b", "--contexts", "4096", "--kv-memory", "16GiB"]
    args += ["--max-requests", "24", "--output-tokens", "64", "--plot-context", "0"]
    args += ["--prefix-requests", "40"]
    run = subprocess.run(
        [sys.executable, str(repo / "bench" / "kvbench.py"), "--routine", "hybrid_sim"]
        + args
        + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(out.read_text())
    assert data["provenance"]["script"] == "bench/routines/hybrid_sim.py"
    assert set(data["runs"]) == {"gpt-oss-20b", "gemma-3-27b"}
    report = data["runs"]["gpt-oss-20b"]["4096"]
    assert set(report["results"]) == set(SCHEMES)
    assert all(r["completed"] == 24 for r in report["results"].values())
    targets = data["targets"]
    assert not any("gpt-oss 8k-32k" in name for name in targets)  # 4k is outside 8k-32k
    prefix_target = targets["qwen3-next shared-prompt hit rate within 5 % of full attention"]
    assert prefix_target["met"] in (True, False)
    assert set(prefix_target["workloads"]) == {
        "shared 1024-token prompts",
        "shared 512-token prompts",
    }
    below_one_block = prefix_target["workloads"]["shared 512-token prompts"]["hit_rates"]
    assert below_one_block["uniform_page"] == 0.0 < below_one_block["hybrid"]
    schemes = data["prefix_caching"]["schemes"]["shared 1024-token prompts"]["results"]
    assert all(r["completed"] == 40 for r in schemes.values())
    assert schemes["all_full"]["prefix_hit_rate"] == 0.0  # states in a static reserve
    assert schemes["hybrid"]["prefix_hit_rate"] > schemes["uniform_page"]["prefix_hit_rate"] > 0
    assert "| gpt-oss-20b | 4k |" in run.stdout
    assert "| shared 512-token prompts |" in run.stdout
    assert "| prefix hit rate (tokens) |" in run.stdout
