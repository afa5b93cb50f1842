"""`kvpool simulate --disaggregated`: the modelled comparison of one prefill + one decode GPU
(KV transfer at a given or measured bandwidth) with two colocated replicas."""

from __future__ import annotations

import json

import pytest
from kvpool.sim.cli import main


def _run(tmp_path, *extra):
    return main(
        [
            "simulate",
            "--disaggregated",
            "--num-requests",
            "120",
            "--no-progress",
            "--no-plot",
            "--out",
            str(tmp_path),
            *extra,
        ]
    )


def test_disaggregated_serves_every_request_and_reports_both_setups(tmp_path, capsys):
    assert _run(tmp_path, "--transfer-gbps", "100", "--transfer-latency-us", "50") == 0
    report = json.loads((tmp_path / "disaggregated.json").read_text())
    assert report["transfer"] == {
        "gb_per_s": 100.0,
        "latency_s": pytest.approx(5e-5),
        "token_bytes": 131072,
        "source": "defaults",
    }
    for side in ("disaggregated", "colocated_two_replicas"):
        assert report[side]["output_tokens_per_s"] > 0 and report[side]["ttft_mean_s"] > 0
    assert report["disaggregated"]["transfer_wait_mean_s"] > 0
    assert "colocated x2" in capsys.readouterr().out


def test_a_slower_link_delays_the_decode_side(tmp_path):
    waits = []
    for gbps in ("1000", "1"):
        assert _run(tmp_path, "--transfer-gbps", gbps) == 0
        report = json.loads((tmp_path / "disaggregated.json").read_text())
        waits.append(report["disaggregated"]["transfer_wait_mean_s"])
    assert waits[1] > 100 * waits[0]


def test_the_measured_figures_are_read_from_a_benchmark_json(tmp_path):
    bench = tmp_path / "t.json"
    bench.write_text(
        json.dumps(
            {
                "summary": [
                    {"num_blocks": 1, "best_us": 80.0, "best_gb_per_s": 20.0},
                    {"num_blocks": 4096, "best_us": 30000.0, "best_gb_per_s": 300.0},
                ]
            }
        )
    )
    assert _run(tmp_path, "--transfer-json", str(bench)) == 0
    report = json.loads((tmp_path / "disaggregated.json").read_text())
    assert report["transfer"]["gb_per_s"] == 300.0
    assert report["transfer"]["latency_s"] == pytest.approx(80e-6)
    bench.write_text("{}")
    assert _run(tmp_path, "--transfer-json", str(bench)) == 2


@pytest.mark.parametrize(
    "args,message",
    [
        (["--transfer-gbps", "10"], "need --disaggregated"),
        (["--disaggregated", "--device", "cuda"], "--device host"),
        (["--disaggregated", "--transfer-gbps", "0"], "finite number >= 0.001"),
    ],
)
def test_bad_options_are_refused(tmp_path, capsys, args, message):
    assert main(["simulate", "--no-progress", "--no-plot", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err
