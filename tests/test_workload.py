"""Workload generators, trace files, presets and memory sizes."""

from __future__ import annotations

import numpy as np
import pytest
from kvpool.sim import (
    TraceError,
    generate,
    get_preset,
    load_trace,
    num_blocks_for,
    parse_bytes,
)
from kvpool.sim.workload import arrival_times


def test_generate_is_seeded():
    assert generate("sharegpt", 200, seed=3, rate=5.0) == generate(
        "sharegpt", 200, seed=3, rate=5.0
    )
    assert generate("sharegpt", 200, seed=3) != generate("sharegpt", 200, seed=4)


@pytest.mark.parametrize(("kind", "prompt", "output"), [("sharegpt", 161, 338), ("alpaca", 19, 58)])
def test_length_means_match_published_statistics(kind, prompt, output):
    reqs = generate(kind, 20_000, seed=0, max_model_len=4096)
    p = np.mean([r.prompt_tokens for r in reqs])
    o = np.mean([r.output_tokens for r in reqs])
    assert abs(p - prompt) / prompt < 0.05
    assert abs(o - output) / output < 0.05
    # a realistic spread: the longest prompts are many times the mean
    assert max(r.prompt_tokens for r in reqs) > 5 * prompt


def test_lengths_fit_max_model_len():
    reqs = generate("sharegpt", 5000, seed=1, max_model_len=512)
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in reqs)
    assert all(r.prompt_tokens + r.output_tokens <= 512 for r in reqs)


def test_shared_prefixes():
    reqs = generate("alpaca", 100, seed=0, num_prefixes=3, prefix_tokens=50)
    assert {r.prefix_id for r in reqs} <= {0, 1, 2}
    assert all(r.prefix_tokens == 50 and r.prompt_tokens > 50 for r in reqs)


def test_arrivals():
    rng = np.random.default_rng(0)
    assert not arrival_times(rng, 10, None).any()
    poisson = arrival_times(rng, 20_000, 50.0, "poisson")
    assert np.all(np.diff(poisson) >= 0)
    assert abs(len(poisson) / poisson[-1] - 50.0) < 2.0
    burst = arrival_times(rng, 10, 4.0, "burst", burst_size=5)
    assert burst.tolist() == [0.0] * 5 + [1.25] * 5
    with pytest.raises(ValueError):
        arrival_times(rng, 10, -1.0)


def test_load_jsonl_and_csv(tmp_path):
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(
        '{"arrival_s": 1.5, "prompt_tokens": 10, "output_tokens": 5}\n\n'
        '{"arrival_time": 0.5, "input_len": 7, "output_len": 3, "priority": 2}\n'
    )
    reqs = load_trace(jsonl)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.priority) for r in reqs] == [
        (0.5, 7, 3, 2),
        (1.5, 10, 5, 0),
    ]
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("arrival_s,prompt_tokens,output_tokens\n0,4,4\n2,8,1\n")
    assert [r.prompt_tokens for r in load_trace(csv_path)] == [4, 8]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "bad.jsonl",
            '{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}\n{oops\n',
            ":2: not valid JSON",
        ),
        (
            "neg.jsonl",
            '{"arrival_s": 0, "prompt_tokens": -3, "output_tokens": 1}\n',
            ":1: prompt_tokens must be",
        ),
        (
            "miss.jsonl",
            '\n{"arrival_s": 0, "prompt_tokens": 3}\n',
            ":2: missing field 'output_tokens'",
        ),
        (
            "frac.csv",
            "arrival_s,prompt_tokens,output_tokens\n0,1,1\n0,2.5,1\n",
            ":3: prompt_tokens must be an integer",
        ),
        (
            "word.csv",
            "arrival_s,prompt_tokens,output_tokens\nsoon,1,1\n",
            ":2: arrival_s must be a number",
        ),
        (
            "long.csv",
            "arrival_s,prompt_tokens,output_tokens\n0,60,10\n",
            ":2: prompt_tokens + output_tokens = 70",
        ),
        ("empty.jsonl", "\n", "no requests"),
        (
            "huge.jsonl",
            '{"arrival_s": 0, "prompt_tokens": 1%s, "output_tokens": 1}\n' % ("0" * 400),
            ":1: prompt_tokens is out of range",
        ),
        (
            "bool.jsonl",
            (
                '{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}\n'
                '{"arrival_s": 0, "prompt_tokens": true, "output_tokens": 1}\n'
            ),
            ":2: prompt_tokens must be a number",
        ),
        (
            "boolarr.jsonl",
            '{"arrival_s": false, "prompt_tokens": 1, "output_tokens": 1}\n',
            ":1: arrival_s must be a number",
        ),
    ],
)
def test_bad_trace_names_the_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError, match=message.replace("+", r"\+").replace("(", r"\(")):
        load_trace(path, max_model_len=64)


def test_presets_and_memory():
    p = get_preset("Llama-3-8B")
    assert (p.num_layers, p.num_kv_heads, p.head_dim) == (32, 8, 128)
    assert (get_preset("llama-3-70b").num_layers, get_preset("qwen2.5-7b").num_kv_heads) == (80, 4)
    assert p.token_bytes() == 128 * 1024
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("2e9") == 2_000_000_000
    assert num_blocks_for(parse_bytes("16GiB"), p.layout(16)) == 8192
    assert (
        parse_bytes("16G") == 16 * 10**9 and parse_bytes("16gib") == 16 * 2**30
    )  # decimal vs binary
    assert parse_bytes(4096) == 4096
    for bad in ("", "12 parsecs", "-1GiB", "0", "0GiB", 0, -5, True):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("gpt-5")


@pytest.mark.parametrize("burst_size", [0, -3])
def test_burst_size_must_be_positive(burst_size):
    with pytest.raises(ValueError, match="burst_size must be an integer >= 1"):
        arrival_times(np.random.default_rng(0), 10, 4.0, "burst", burst_size=burst_size)
    with pytest.raises(ValueError, match="burst_size must be an integer >= 1"):
        generate("sharegpt", 10, rate=4.0, arrival="burst", burst_size=burst_size)
