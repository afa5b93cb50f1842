"""Prefix caching in the hybrid simulation (kvpool.sim.hybrid_prefix): the backend stores a
state where prompts branch and later prompts resume from it, on the real HybridTables; the
comparison serves one shared-prompt workload with hybrid pages, uniform page bytes and a pure
full-attention model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kvpool
import numpy as np
import pytest
from kvpool.scheduler.core import Scheduler, SchedulerConfig
from kvpool.scheduler.request import Request
from kvpool.sim.hybrid_cost import HybridStepCost
from kvpool.sim.hybrid_prefix import (
    HybridPrefixCachedKv,
    chunk_hashes,
    compare,
    full_attention_model,
    main,
    readme_table,
)
from kvpool.sim.hybrid_presets import HYBRID_PRESETS
from kvpool.sim.hybrid_schemes import hybrid_spec, uniform_page_plan
from kvpool.sim.sharing import with_token_streams

QWEN = HYBRID_PRESETS["qwen3-next-80b-a3b"]


def test_chunk_hashes_name_whole_prefixes():
    a = np.arange(50)
    b = np.concatenate([np.arange(20), np.arange(100, 130)])
    ha, hb = chunk_hashes(a), chunk_hashes(b)
    assert len(ha) == 3 and ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]


def test_the_full_attention_model_has_qwen3_nexts_attention_shape():
    full = full_attention_model(QWEN)
    assert (full.num_layers, full.num_kv_heads, full.head_dim) == (48, 2, 256)


def served(
    prompts: list[tuple[int, int]], checkpoint_multiple: int = 16
) -> tuple[list[int], HybridPrefixCachedKv]:
    """Requests of (prefix id, prompt tokens), one a second, each with 4 output tokens and a
    64-token shared prefix per prefix id, on Qwen3-Next's hybrid spec; each request's hit."""
    spec = QWEN  # the real spec (no proxy): a small pool of real pages
    real = hybrid_spec(spec)
    pool = kvpool.Pool.for_spec(real, 2048, device="host", enable_prefix_caching=True)
    backend = HybridPrefixCachedKv(pool, real, checkpoint_multiple)
    requests = with_token_streams(
        [
            Request(i, float(i), n, 4, prefix_id=p, prefix_tokens=64)
            for i, (p, n) in enumerate(prompts)
        ]
    )
    hits: dict[int, int] = {}
    admit = backend.try_admit

    def recording(seq, first_chunk, watermark):
        admitted = admit(seq, first_chunk, watermark)
        if admitted:
            hits[seq.request_id] = seq.num_cached_tokens
        return admitted

    backend.try_admit = recording  # type: ignore[method-assign]
    config = SchedulerConfig(max_model_len=512, max_running_seqs=8)
    cost = HybridStepCost(spec)
    sched = Scheduler(backend, requests, config, step_cost=cost)
    cost.bind(sched)
    sched.run()
    backend.check_drained()
    return [hits[i] for i in range(len(prompts))], backend


def test_a_state_is_stored_where_prompts_branch_and_later_prompts_resume_there():
    hits, backend = served([(0, 100), (0, 90), (0, 120), (1, 100), (0, 70), (1, 80), (1, 99)])
    # Prefix 0: the first prompt stores nothing, the second stores the state at the branch
    # (64 tokens: the shared prefix), the third on hit there; the same for prefix 1.
    assert hits == [0, 0, 64, 0, 64, 0, 64]
    assert backend.checkpoints_stored == 2 and backend.checkpoints_lost == 0


def test_uniform_page_checkpoints_only_at_multiples_of_its_block():
    # A 64-token shared prefix is below a 544-token block: nothing is ever stored or hit.
    hits, backend = served([(0, 100), (0, 90), (0, 120)], checkpoint_multiple=544)
    assert hits == [0, 0, 0] and backend.checkpoints_stored == 0
    with pytest.raises(ValueError, match="multiple of 16"):
        HybridPrefixCachedKv(backend.pool, backend.spec, 24)
    plain = kvpool.Pool.for_spec(backend.spec, 2048, device="host")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        HybridPrefixCachedKv(plain, backend.spec)


def test_the_comparison_runs_the_three_schemes_on_one_workload():
    workload = {
        "num_requests": 60,
        "rate": 20.0,
        "num_prefixes": 2,
        "prefix_tokens": 1024,
        "max_model_len": 4096,
        "max_running_seqs": 64,
    }
    run = compare(QWEN, 16 << 30, workload)
    res = run["results"]
    queried = {s: r["queried_tokens"] for s, r in res.items()}
    assert len(set(queried.values())) == 1, queried  # the same prompts, no preemption
    assert all(r["completed"] == 60 and r["preemptions"] == 0 for r in res.values())
    # Nothing evicted in 16 GiB: the hybrid pages miss only the prompt that stores each
    # prefix's state (the second of its prefix) beyond what the full-attention model misses.
    assert res["hybrid"]["cache_at_end"]["pool"]["evictions"] == 0
    prefixes = res["hybrid"]["checkpoints_stored"]
    assert 1 <= prefixes <= 2
    assert res["full_attention"]["cached_tokens"] - res["hybrid"]["cached_tokens"] == (
        prefixes * 1024
    )
    # vLLM's scheme hits whole 544-token blocks only.
    block = uniform_page_plan(QWEN).block_size
    assert block == 544 and res["uniform_page"]["cached_tokens"] % block == 0
    assert run["hit_rates"]["uniform_page"] < run["hit_rates"]["hybrid"]


def test_main_writes_the_json_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "r.json"
    main(
        [
            "--num-requests",
            "30",
            "--kv-memory",
            "16GiB",
            "--workloads",
            "shared 512-token prompts",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert data["provenance"]["commit"] and data["runs"]["shared 512-token prompts"]
    assert "| shared 512-token prompts |" in capsys.readouterr().out


def test_the_readme_table_is_generated_from_the_cited_json():
    """README.md's hybrid prefix-caching table is `readme_table` of the prefix-caching runs
    of the hybrid_sim JSON it cites (bench/routines/hybrid_sim.py runs `compare`), and the
    cached-token difference it states is that JSON's."""
    repo = Path(__file__).resolve().parents[1]
    readme = (repo / "README.md").read_text()
    cited = set(re.findall(r"bench/results/([0-9a-z_-]+)/hybrid_sim\.json", readme))
    assert len(cited) == 1, cited
    result = json.loads((repo / "bench" / "results" / cited.pop() / "hybrid_sim.json").read_text())
    data = result["prefix_caching"]
    assert readme_table(data) in readme
    for name, tokens in [("shared 1024-token prompts", 1024), ("shared 512-token prompts", 512)]:
        res = data["runs"][name]["results"]
        assert res["full_attention"]["cached_tokens"] - res["hybrid"]["cached_tokens"] == 8 * tokens
