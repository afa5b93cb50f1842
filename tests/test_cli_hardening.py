"""`kvpool simulate` options that ran into nonsense or a traceback: each is refused with exit
status 2 and one line naming the option, before anything is generated or allocated."""

from __future__ import annotations

import kvpool
import pytest
from cli_checks import forbid_simulation, refused
from kvpool.sim.cli import main

TINY = [
    "simulate",
    "--kv-memory",
    "512MiB",
    "--max-model-len",
    "1024",
    "--max-running-seqs",
    "32",
    "--max-tokens-per-step",
    "512",
    "--num-requests",
    "20",
    "--no-progress",
    "--no-plot",
]


@pytest.fixture
def no_simulation(monkeypatch):
    """Fails the test if a pool, tables, a tier or a simulation is made."""
    forbid_simulation(monkeypatch)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # 1e-300 requests/s put arrivals near 1e302 s: latencies of 0.0 s, 0 tokens/s
        (["--rate", "1e-300"], "argument --rate: rate must be >= 0.001 requests/s"),
        (["--rate", "0.0009"], "argument --rate: rate must be >= 0.001 requests/s"),
        (["--rate", "1e400"], "argument --rate: rate '1e400' is beyond any float"),  # was inf
        (
            ["--workload", "multiturn", "--think-time", "1e300"],
            "argument --think-time: must be a number of seconds in [0, 86400]",
        ),
        (["--out", ""], "argument --out: must name a directory, got ''"),  # was the cwd
        (["--out", "  "], "argument --out: must name a directory"),
        # ran without sharing anything, while --prefix-tokens alone was refused
        (["--num-prefixes", "3"], "--num-prefixes needs --prefix-tokens >= 1"),
        (["--num-prefixes", "3", "--prefix-tokens", "0"], "--num-prefixes needs --prefix-tokens"),
        # a 1e-300 GB/s link or a 1e300 us fixed cost reported latencies near 1e300 s
        (
            ["--cpu-kv-memory", "1GiB", "--host-link-gbps", "1e-300"],
            "argument --host-link-gbps: must be a finite number >= 0.001 and <= 1e+06",
        ),
        (
            ["--cpu-kv-memory", "1GiB", "--host-link-latency-us", "1e300"],
            "argument --host-link-latency-us: must be a finite number >= 0 and <= 1e+06",
        ),
        (
            ["--disaggregated", "--transfer-gbps", "1e-300"],
            "argument --transfer-gbps: must be a finite number >= 0.001 and <= 1e+06",
        ),
        (
            ["--disaggregated", "--transfer-latency-us", "1e300"],
            "argument --transfer-latency-us: must be a finite number > 0 and <= 1e+06",
        ),
    ],
)
def test_bad_option_is_one_line_naming_it(capsys, tmp_path, no_simulation, args, message):
    out = [] if "--out" in args else ["--out", str(tmp_path / "r")]
    line = refused(capsys, [*TINY, *args, *out])
    assert message in line, line
    assert not (tmp_path / "r").exists()


def test_slowest_rate_and_spelled_infinity_run(tmp_path):
    import json

    for rate, out in (("0.001", tmp_path / "slow"), ("+Infinity", tmp_path / "inf")):
        assert main([*TINY, "--rate", rate, "--out", str(out)]) == 0
        report = json.loads((out / "simulate.json").read_text())
        assert report["results"]["paged"]["completed"] == 20
        assert report["results"]["paged"]["latency_mean_s"] > 0
    assert (
        json.loads((tmp_path / "inf" / "simulate.json").read_text())["workload"]["arrival"]
        == "all at t=0"
    )


def test_device_cuda_without_cuda_names_the_option(tmp_path, capsys, no_simulation):
    # It ran until the pool was made, then exited 1 with CudaUnavailableError.
    if kvpool.cuda_available():
        pytest.skip("a GPU is present")
    line = refused(capsys, [*TINY, "--device", "cuda", "--out", str(tmp_path / "r")])
    assert line == (
        "kvpool simulate: error: --device cuda: no CUDA driver or device here; use --device "
        "host (or auto)"
    )
    assert not (tmp_path / "r").exists()
