"""`kvpool simulate --disaggregated`: the modelled comparison of one prefill + one decode GPU
(KV transfer at a given or measured bandwidth) with two colocated replicas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvpool.sim.cli import main
from kvpool.sim.disagg import link_from_benchmark


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


RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def _nixl_row(case, memory, block, blocks, median_us, gbps):
    block_bytes = {"64KiB": 64 << 10, "2MiB": 2 << 20}[block]
    return {
        "case": case,
        "memory": memory,
        "block": block,
        "blocks": blocks,
        "bytes": blocks * block_bytes,
        "median_us": median_us,
        "gbytes_per_s": gbps,
    }


def _nixl_result(rows, memories=("cuda", "host")):
    return {"routine": "transfer_nixl", "memories": list(memories), "rows": rows}


def test_a_transfer_nixl_result_gives_the_scattered_request_bandwidth_and_one_block_time():
    rows = [
        _nixl_row("contiguous", "cuda", "2MiB", 256, 900.0, 600.0),  # the baseline: not a request
        _nixl_row("request_fresh", "cuda", "2MiB", 256, 950.0, 550.0),
        _nixl_row("request_scattered", "cuda", "64KiB", 1, 40.0, 1.6),
        _nixl_row("request_scattered", "cuda", "2MiB", 1, 90.0, 23.0),
        _nixl_row("request_scattered", "cuda", "64KiB", 4096, 9000.0, 29.0),
        _nixl_row("request_scattered", "cuda", "2MiB", 256, 20000.0, 26.0),  # the most bytes
        _nixl_row("request_scattered", "host", "2MiB", 1024, 1.0, 999.0),  # cuda rows win
        _nixl_row("request_scattered", "host", "64KiB", 1, 1.0, 1.0),
    ]
    gbps, latency_us, source = link_from_benchmark(_nixl_result(rows), "x.json")
    assert (gbps, latency_us) == (26.0, 40.0)
    assert source == (
        "x.json (transfer_nixl, cuda, request_scattered: 26 GB/s at 2MiB x 256, 40 us for 64KiB x 1)"
    )
    host_only = [r for r in rows if r["memory"] == "host"]
    assert link_from_benchmark(_nixl_result(host_only, ["host"]), "h")[:2] == (999.0, 1.0)
    # A result from before --memory (no "memories", rows unnamed) was host to host.
    unnamed = [{k: v for k, v in r.items() if k != "memory"} for r in host_only]
    assert link_from_benchmark({"routine": "transfer_nixl", "rows": unnamed}, "old")[:2] == (
        999.0,
        1.0,
    )


def test_a_scattered_request_the_transport_would_stage_takes_the_staged_row():
    rows = [
        _nixl_row("request_scattered", "cuda", "64KiB", 1, 40.0, 1.6),
        _nixl_row("request_staged", "cuda", "64KiB", 1, 300.0, 0.2),  # one run: not staged
        _nixl_row("request_scattered", "cuda", "2MiB", 256, 2000.0, 260.0),
        _nixl_row("request_staged", "cuda", "2MiB", 256, 900.0, 600.0),
    ]
    gbps, latency_us, source = link_from_benchmark(_nixl_result(rows), "x.json")
    assert (gbps, latency_us) == (600.0, 40.0)
    assert "request_staged: 600 GB/s at 2MiB x 256" in source
    # Without the staged row, or where staging would not pay (few blocks), the scattered one.
    assert link_from_benchmark(_nixl_result(rows[:3]), "x")[:2] == (260.0, 40.0)
    few = [
        _nixl_row("request_scattered", "cuda", "2MiB", 4, 70.0, 120.0),
        _nixl_row("request_staged", "cuda", "2MiB", 4, 320.0, 26.0),
    ]
    assert link_from_benchmark(_nixl_result(rows[:1] + few), "x")[:2] == (120.0, 40.0)


@pytest.mark.parametrize(
    ("name", "memory", "case", "block", "blocks"),
    [
        (
            "2026-12-03_ecd3d83_h200/transfer_nixl_host.json",
            "host",
            "request_scattered",
            "2MiB",
            1024,
        ),
        ("2026-12-03_fd73786_h200/transfer_nixl.json", "cuda", "request_scattered", "64KiB", 4096),
        (
            "2026-12-04_7b88e0e_h200/transfer_nixl_cuda_ipc.json",
            "cuda",
            "request_staged",
            "2MiB",
            4096,
        ),
    ],
)
def test_the_committed_transfer_nixl_results_drive_the_simulation(
    tmp_path, name, memory, case, block, blocks
):
    path = RESULTS / name
    rows = json.loads(path.read_text())["rows"]
    (want,) = [
        r
        for r in rows
        if (r["case"], r["memory"], r["block"], r["blocks"]) == (case, memory, block, blocks)
    ]
    (one,) = [
        r
        for r in rows
        if (r["case"], r["memory"], r["block"], r["blocks"])
        == ("request_scattered", memory, "64KiB", 1)
    ]
    assert _run(tmp_path, "--transfer-json", str(path)) == 0
    transfer = json.loads((tmp_path / "disaggregated.json").read_text())["transfer"]
    assert transfer["gb_per_s"] == want["gbytes_per_s"]
    assert transfer["latency_s"] == pytest.approx(one["median_us"] * 1e-6)
    assert transfer["source"].startswith(f"{path} (transfer_nixl, {memory}, {case}: ")
    assert f"at {block} x {blocks}, " in transfer["source"]
    # An option still overrides its figure; the other stays the measured one.
    assert _run(tmp_path, "--transfer-json", str(path), "--transfer-gbps", "7") == 0
    transfer = json.loads((tmp_path / "disaggregated.json").read_text())["transfer"]
    assert transfer["gb_per_s"] == 7.0
    assert transfer["latency_s"] == pytest.approx(one["median_us"] * 1e-6)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ({"rows": []}, "neither an NCCL transfer result"),  # no routine, no summary
        ({"routine": "prefix_sim", "summary": "x"}, "neither an NCCL transfer result"),
        (_nixl_result([]), "no request_scattered rows"),
        (
            _nixl_result([_nixl_row("request_scattered", "host", "2MiB", 4, 10.0, 3.0)]),
            "no one-block request_scattered row",
        ),
        (
            _nixl_result([_nixl_row("request_scattered", "host", "64KiB", 1, 10.0, 0.0)]),
            "a bandwidth of 0.0 GB/s",
        ),
        ([1, 2], "neither an NCCL transfer result"),
    ],
)
def test_a_json_of_neither_kind_is_refused_with_both_named(tmp_path, capsys, content, words):
    bench = tmp_path / "t.json"
    bench.write_text(json.dumps(content))
    assert _run(tmp_path, "--transfer-json", str(bench)) == 2
    err = capsys.readouterr().err
    assert f"--transfer-json {bench}: neither an NCCL transfer result" in err, err
    assert "nor a transfer_nixl one" in err and words in err, err
    assert not (tmp_path / "disaggregated.json").exists()


def test_a_file_that_is_not_json_is_refused(tmp_path, capsys):
    bench = tmp_path / "t.json"
    bench.write_text('{"routine": "transfer_nixl"}\n{"rows": []}\n')
    assert _run(tmp_path, "--transfer-json", str(bench)) == 2
    assert f"--transfer-json {bench}: Extra data" in capsys.readouterr().err


def test_an_nccl_summary_with_no_bandwidth_is_refused(tmp_path, capsys):
    bench = tmp_path / "t.json"
    bench.write_text(json.dumps({"summary": [{"num_blocks": 1, "best_us": 5, "best_gb_per_s": 0}]}))
    assert _run(tmp_path, "--transfer-json", str(bench)) == 2
    err = capsys.readouterr().err
    assert f"--transfer-json {bench}: neither" in err and "a bandwidth of 0.0 GB/s" in err, err
