"""Trace readers (Azure LLM inference, BurstGPT, Mooncake, ShareGPT, ours with prefix groups
and conversations) on the fixtures in tests/traces/, their missing-column errors, and the
prefix-caching options of `kvpool simulate`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kvpool.sim import TraceError
from kvpool.sim.cli import main
from kvpool.sim.sharing import shares_prefixes
from kvpool.sim.traces import detect_format, estimate_tokens, read_trace

TRACES = Path(__file__).parent / "traces"
BASE = [
    "simulate",
    "--kv-memory",
    "512MiB",
    "--max-model-len",
    "2048",
    "--max-running-seqs",
    "16",
    "--max-tokens-per-step",
    "512",
    "--no-progress",
    "--no-plot",
]


def rows(requests):
    return [
        (r.request_id, round(r.arrival_s, 4), r.prompt_tokens, r.output_tokens) for r in requests
    ]


def test_azure():
    requests, info = read_trace(TRACES / "azure_conv.csv", max_model_len=4096)
    assert info.format == "azure" and info.skipped_too_long == 1  # the 9000-token row
    assert rows(requests) == [
        (0, 0.0, 374, 44),
        (1, 4.3146, 396, 109),
        (2, 4.8189, 879, 34),
        (3, 4.8471, 91, 7),
    ]
    assert not shares_prefixes(requests)


def test_burstgpt_skips_failed_requests():
    requests, info = read_trace(TRACES / "burstgpt.csv")
    assert info.format == "burstgpt" and info.skipped_failed == 1
    assert rows(requests) == [(0, 0.0, 472, 18), (1, 113.0, 417, 30), (2, 117.0, 1360, 193)]


def test_mooncake_hash_ids_become_shared_blocks():
    requests, info = read_trace(TRACES / "mooncake.jsonl")
    assert info.format == "mooncake"
    assert rows(requests) == [
        (0, 0.0, 1100, 20),
        (1, 0.0, 1500, 30),
        (2, 2.5, 600, 10),
        (3, 4.0, 1100, 5),
    ]
    ids = [r.tokens.ids(r.prompt_tokens) for r in requests]
    assert np.array_equal(ids[0][:1024], ids[1][:1024])  # hash ids 0, 1
    assert (ids[0][1024:1100] != ids[1][1024:1100]).mean() > 0.9  # 2 vs 3
    assert (
        np.array_equal(ids[0][:512], ids[2][:512])
        and (ids[0][512:600] != ids[2][512:600]).mean() > 0.9
    )
    assert np.array_equal(ids[0], ids[3])  # the same hash ids: the same prompt
    assert shares_prefixes(requests)


def test_sharegpt_turns_and_estimated_tokens():
    requests, info = read_trace(TRACES / "sharegpt.json")
    assert info.format == "sharegpt"
    data = json.loads((TRACES / "sharegpt.json").read_text())
    est = [[estimate_tokens(m["value"]) for m in c["conversations"]] for c in data]
    a, b = est
    # conversation 0: two turns; conversation 1: a greeting, then one turn
    assert rows(requests) == [
        (0, 0.0, a[0], a[1]),
        (1, 0.0, b[0] + b[1], b[2]),
        (2, 10.0, a[0] + a[1] + a[2], a[3]),
    ]
    first, second = requests[0], requests[2]
    assert np.array_equal(
        second.tokens.ids(second.prompt_tokens)[: a[0] + a[1]], first.tokens.ids(a[0] + a[1])
    )
    assert (
        estimate_tokens("abcd") == 1 and estimate_tokens("abcde") == 2 and estimate_tokens("") == 1
    )
    spaced, _ = read_trace(TRACES / "sharegpt.json", think_time_s=3.0)
    assert [r.arrival_s for r in spaced] == [0.0, 0.0, 3.0]


def test_our_format_with_prefix_groups_and_conversations():
    requests, info = read_trace(TRACES / "kvpool_groups.csv")
    assert info.format == "kvpool" and shares_prefixes(requests)
    g0, g1, c0, c1 = (r.tokens.ids(r.prompt_tokens) for r in requests)
    assert np.array_equal(g0[:64], g1[:64]) and (g0[64:100] != g1[64:100]).mean() > 0.9
    assert np.array_equal(c1[:70], requests[2].tokens.ids(70))  # turn 1 holds turn 0 + its answer


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "a.csv",
            "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,10\n",
            "(azure): missing column 'GeneratedTokens'",
        ),
        (
            "b.csv",
            "Timestamp,Model,Request tokens,Total tokens\n1,ChatGPT,5,9\n",
            "(burstgpt): missing column 'Response tokens'",
        ),
        (
            "m.jsonl",
            '{"timestamp": 0, "output_length": 3, "hash_ids": [1]}\n',
            "(mooncake): missing field 'input_length'",
        ),
        (
            "m2.jsonl",
            '{"timestamp": 0, "input_length": 3, "output_length": 3, "hash_ids": [1]}\n{oops\n',
            "m2.jsonl:2: not valid JSON",
        ),
        ("s.json", '[{"id": "x", "turns": []}]', "(sharegpt): missing field 'conversations'"),
        (
            "s2.json",
            '[{"id": "x", "conversations": [{"from": "human"}]}]',
            "(sharegpt): missing field 'value'",
        ),
        ("k.jsonl", '{"arrival_s": 0, "prompt_tokens": 5}\n', "missing field 'output_tokens'"),
        (
            "c.csv",
            "arrival_s,prompt_tokens,output_tokens,conversation_id\n0,50,20,1\n1,60,5,1\n",
            "does not hold the 70 tokens of the earlier turns",
        ),
        (
            "g.csv",
            "arrival_s,prompt_tokens,output_tokens,prefix_group\n0,50,20,1\n",
            "prefix_group and prefix_tokens go together",
        ),
        (
            "t.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n",
            "TIMESTAMP must be a date and time",
        ),
    ],
)
def test_bad_traces_name_what_is_missing(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError, match="^--trace ") as e:
        read_trace(path, max_model_len=4096)
    assert message in str(e.value)
    assert main([*BASE, "--trace", str(path), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("kvpool simulate: error: --trace ")
        and message in err[0]
    )
    assert not (tmp_path / "r").exists()


def test_detect_and_force_the_format(tmp_path):
    assert (
        detect_format(TRACES / "mooncake.jsonl", (TRACES / "mooncake.jsonl").read_text())
        == "mooncake"
    )
    assert (
        detect_format(TRACES / "azure_conv.csv", (TRACES / "azure_conv.csv").read_text()) == "azure"
    )
    assert (
        detect_format(TRACES / "kvpool_groups.csv", (TRACES / "kvpool_groups.csv").read_text())
        == "kvpool"
    )
    with pytest.raises(TraceError, match=r"\(burstgpt\): missing column 'Timestamp'"):
        read_trace(TRACES / "azure_conv.csv", "burstgpt")


@pytest.mark.parametrize(
    "trace", ["mooncake.jsonl", "sharegpt.json", "azure_conv.csv", "burstgpt.csv"]
)
def test_simulate_reads_each_format(tmp_path, trace):
    out = tmp_path / "r"
    assert main([*BASE, "--trace", str(TRACES / trace), "--out", str(out)]) == 0
    report = json.loads((out / "simulate.json").read_text())
    shared = trace in ("mooncake.jsonl", "sharegpt.json")
    assert report["workload"]["prefix_sharing"] is shared
    assert ("paged_prefix_caching" in report["results"]) is shared
    if trace == "mooncake.jsonl":  # hash ids 0, 1 of request 1 and all of request 3 are cached
        assert report["prefix_caching"]["cached_tokens"] >= 1024 + 1088


def test_prefix_caching_options(tmp_path):
    common = [*BASE, "--num-requests", "30", "--num-prefixes", "2", "--prefix-tokens", "256"]
    out = {}
    for flag in ("", "--prefix-caching", "--no-prefix-caching"):
        out[flag] = tmp_path / (flag or "auto")
        assert main([*common, *([flag] if flag else []), "--out", str(out[flag])]) == 0
    auto = json.loads((out[""] / "simulate.json").read_text())
    assert auto["workload"]["prefix_caching"].startswith("on (the workload shares")
    assert auto["prefix_caching"]["hit_rate_tokens"] > 0.3
    off = json.loads((out["--no-prefix-caching"] / "simulate.json").read_text())
    assert "paged_prefix_caching" not in off["results"] and "prefix_caching" not in off
    plain = tmp_path / "plain"
    assert main([*BASE, "--num-requests", "5", "--prefix-caching", "--out", str(plain)]) == 0
    assert json.loads((plain / "simulate.json").read_text())["prefix_caching"]["cached_tokens"] == 0


def test_multiturn_workload_and_plot(tmp_path):
    out = tmp_path / "mt"
    args = [a for a in BASE if a != "--no-plot"]
    assert (
        main(
            [
                *args,
                "--workload",
                "multiturn",
                "--num-requests",
                "24",
                "--turns",
                "3",
                "--think-time",
                "2",
                "--rate",
                "5",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads((out / "simulate.json").read_text())
    assert report["workload"]["turns"] == 3 and report["workload"]["conversations"] >= 8
    assert report["prefix_caching"]["hit_rate_tokens"] > 0.2
    assert (out / "simulate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--turns", "3"], "--turns needs --workload multiturn"),
        (["--think-time", "3"], "--think-time needs --workload multiturn"),
        (
            ["--workload", "multiturn", "--turns", "0"],
            "argument --turns: must be in [1, 1000], got 0",
        ),
        (
            ["--workload", "multiturn", "--think-time", "-1"],
            "argument --think-time: must be a number of seconds in [0, 86400]",
        ),
        (["--trace-format", "azure"], "--trace-format needs --trace"),
        (
            ["--trace", str(TRACES / "azure_conv.csv"), "--think-time", "2"],
            "--think-time applies to ShareGPT traces",
        ),
        (
            ["--trace", str(TRACES / "azure_conv.csv"), "--turns", "2"],
            "--turns cannot be used with --trace",
        ),
        (
            ["--disaggregated", "--prefix-caching"],
            "--prefix-caching is not modelled with --disaggregated",
        ),
        (
            ["--cpu-kv-memory", "8GiB", "--prefix-caching"],
            "--prefix-caching is not modelled with --cpu-kv-memory",
        ),
        (["--trace-format", "csv", "--trace", "x.csv"], "argument --trace-format: invalid choice"),
    ],
)
def test_bad_prefix_options(tmp_path, capsys, args, message):
    assert main([*BASE, *args, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "r").exists()
