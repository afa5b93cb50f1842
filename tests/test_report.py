"""The terminal report of `kvpool simulate` (kvpool.sim.report): what each row and line means,
on small real runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from kvpool.sim.cli import build_parser, main
from kvpool.sim.report import (
    PER_REQUEST_LABEL,
    UTILIZATION_LABEL,
    prefix_caching_line,
    print_table,
    ratio_text,
    table_rows,
)
from rich.console import Console

TRACES = Path(__file__).parent / "traces"

SMALL = ["simulate", "--kv-memory", "1GiB", "--no-progress", "--no-plot"]
# Four 512-token prefixes over 120 requests: most prompt tokens hit the cache, and the blocks
# that hold them are shared by many requests at once.
SHARED_PREFIXES = [
    *SMALL,
    "--num-requests",
    "120",
    "--num-prefixes",
    "4",
    "--prefix-tokens",
    "512",
    "--prefix-caching",
]
# 128 MiB of Llama-3-8B KV is 64 blocks: 32 sequences with long outputs must preempt.
PREEMPTING = [
    "simulate",
    "--kv-memory",
    "128MiB",
    "--max-model-len",
    "1024",
    "--max-running-seqs",
    "32",
    "--max-tokens-per-step",
    "512",
    "--num-requests",
    "80",
    "--no-progress",
    "--no-plot",
]


def run(tmp_path: Path, args: list[str]) -> dict:
    assert main([*args, "--out", str(tmp_path)]) == 0
    return json.loads((tmp_path / "simulate.json").read_text())


def printed(report: dict) -> str:
    console = Console(record=True, width=200)
    print_table(report, console)
    return console.export_text()


@pytest.fixture(scope="module")
def cached_report(tmp_path_factory):
    return run(tmp_path_factory.mktemp("cached"), SHARED_PREFIXES)


def test_kv_utilization_stays_in_0_1_with_prefix_caching(cached_report):
    rows = {row[0]: row[1:] for row in table_rows(cached_report)}
    paged, contiguous, cached = rows[UTILIZATION_LABEL]
    assert 0 < float(paged) <= 1 and 0 < float(contiguous) <= 1
    assert cached == "-"
    # The caching run's own figure is on the row that says what it counts, and in this workload
    # it is above 1 (what made the old "KV utilization" row read 1.3 or 2.4).
    per_request = rows[PER_REQUEST_LABEL]
    result = cached_report["results"]["paged_prefix_caching"]
    assert float(per_request[2]) == pytest.approx(result["kv_utilization"], abs=5e-4)
    assert result["kv_utilization"] > 1
    # Without sharing the two rows agree.
    assert per_request[:2] == (paged, contiguous)


def test_without_prefix_caching_there_is_no_per_request_row(tmp_path):
    report = run(tmp_path, [*SMALL, "--num-requests", "30"])
    labels = [row[0] for row in table_rows(report)]
    assert UTILIZATION_LABEL in labels and PER_REQUEST_LABEL not in labels


def test_rows_skipped_from_a_trace_are_in_the_table(tmp_path):
    # burstgpt.csv has failed rows (0 response tokens); a max_model_len of 600 also drops long ones.
    report = run(
        tmp_path,
        [*SMALL, "--trace", str(TRACES / "burstgpt.csv"), "--max-model-len", "600"],
    )
    w = report["workload"]
    assert w["skipped_too_long"] > 0 and w["skipped_failed"] > 0
    text = printed(report)
    total = w["skipped_too_long"] + w["skipped_failed"]
    assert (
        f"trace rows skipped: {total} ({w['skipped_too_long']} longer than max_model_len 600, "
        f"{w['skipped_failed']} failed: no response tokens)"
    ) in " ".join(text.split())


def test_a_generated_workload_has_no_skipped_line(tmp_path):
    report = run(tmp_path, [*SMALL, "--num-requests", "30"])
    assert "skipped" not in printed(report)


def test_title_names_every_column(tmp_path, cached_report):
    tier = run(tmp_path, [*PREEMPTING, "--cpu-kv-memory", "64GiB"])
    assert list(tier["results"]) == ["paged", "paged_host_tier", "contiguous"]
    assert "kvpool simulate: paged vs paged + host tier vs contiguous (same KV memory)" in printed(
        tier
    )
    assert (
        "kvpool simulate: paged vs contiguous vs paged + prefix caching (same KV memory)"
        in printed(cached_report)
    )


@pytest.mark.parametrize(
    ("ratio", "text"),
    [
        (0.004, "0.004"),
        (0.00123456, "0.00123"),
        (0.652, "0.652"),
        (1.0, "1.00"),
        (3.4167, "3.42"),
        (1234.5, "1,234.50"),
        (0.0, "0.00"),
        (None, "-"),
        (float("inf"), "inf"),
    ],
)
def test_ratio_text_keeps_small_ratios_readable(ratio, text):
    assert ratio_text(ratio) == text


def test_a_small_ttft_ratio_is_not_shown_as_zero(cached_report):
    report = json.loads(json.dumps(cached_report))
    report["prefix_caching"]["ttft_mean_ratio"] = 0.0042
    assert "TTFT mean x0.0042," in prefix_caching_line(report)
    report["prefix_caching"]["ttft_mean_ratio"] = None  # inf in the run, null in the JSON
    assert "TTFT mean x-," in prefix_caching_line(report)


def _options(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif action.option_strings:
            yield action


def test_every_option_has_help_text():
    missing = [a.option_strings[-1] for a in _options(build_parser()) if not a.help]
    assert missing == []
    names = {a.option_strings[-1] for a in _options(build_parser())}
    assert {"--policy", "--max-running-seqs", "--version"} <= names
