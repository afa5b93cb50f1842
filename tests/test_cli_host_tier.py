"""`kvpool simulate --cpu-kv-memory`: the host-tier run, its report rows and its option checks."""

from __future__ import annotations

import json

import pytest
from cli_checks import forbid_simulation, refused
from kvpool.sim.cli import main
from kvpool.sim.report import table_rows

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
]


@pytest.fixture(scope="module")
def tier_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("tier")
    assert main([*PREEMPTING, "--cpu-kv-memory", "64GiB", "--out", str(out)]) == 0
    return json.loads((out / "simulate.json").read_text()), out


def test_three_schedulers_at_the_same_gpu_memory(tier_report):
    report, out = tier_report
    assert list(report["results"]) == ["paged", "paged_host_tier", "contiguous"]
    for result in report["results"].values():
        assert result["completed"] == 80
    tier = report["results"]["paged_host_tier"]["host_tier"]
    assert tier["mode"] == "auto" and tier["host_blocks"] == 64 * 2**30 // (2 * 2**20)
    assert tier["host_link_bytes_per_s"] == 55e9 and tier["host_link_latency_s"] == 15e-6
    assert tier["swapped_in"] == tier["swapped_out"] > 0
    h = report["host_tier_comparison"]
    assert h["preemptions"]["no_tier"] > 0
    assert h["preemptions_by_swap"] + h["preemptions_by_recompute"] == h["preemptions"]["host_tier"]
    assert (
        h["recomputed_tokens_saved"]
        == h["recomputed_tokens"]["no_tier"] - h["recomputed_tokens"]["host_tier"]
    )
    assert h["swapped_bytes"] == 2 * tier["swapped_out_bytes"]
    assert (out / "simulate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_has_a_column_and_rows_for_the_tier(tier_report):
    rows = {row[0]: row[1:] for row in table_rows(tier_report[0])}
    assert all(len(cells) == 3 for cells in rows.values())
    paged, tier, contiguous = rows["preemptions by swap"]
    assert paged == "-" and contiguous == "-" and int(tier.replace(",", "")) > 0
    assert "recomputed tokens" in rows and "TTFT p99 (modelled)" in rows


def test_forced_modes_and_link_options(tmp_path):
    runs = {}
    for mode, extra in (("swap", []), ("recompute", []), ("auto", ["--host-link-gbps", "1"])):
        out = tmp_path / mode
        assert (
            main(
                [
                    *PREEMPTING,
                    "--cpu-kv-memory",
                    "64GiB",
                    "--preemption",
                    mode,
                    *extra,
                    "--no-plot",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        runs[mode] = json.loads((out / "simulate.json").read_text())
    swap = runs["swap"]["host_tier_comparison"]
    assert swap["preemptions_by_recompute"] == 0 and swap["preemptions_by_swap"] > 0
    assert runs["recompute"]["host_tier_comparison"]["preemptions_by_swap"] == 0
    # Recompute through the tier is the run without one.
    assert (
        runs["recompute"]["results"]["paged_host_tier"]["modelled_time_s"]
        == runs["recompute"]["results"]["paged"]["modelled_time_s"]
    )
    slow = runs["auto"]["results"]["paged_host_tier"]["host_tier"]
    assert slow["host_link_bytes_per_s"] == 1e9 and slow["swapped_out"] == 0  # recompute is cheaper


def test_without_the_option_nothing_changes(tmp_path):
    assert main([*PREEMPTING, "--num-requests", "10", "--no-plot", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "simulate.json").read_text())
    assert (
        list(report["results"]) == ["paged", "contiguous"] and "host_tier_comparison" not in report
    )


def test_a_shared_prefix_workload_gets_the_tier_and_no_prefix_caching_run(tmp_path):
    # Prefix caching would be on by default here; with a host tier it is off (not modelled).
    assert (
        main(
            [
                *PREEMPTING,
                "--num-requests",
                "20",
                "--num-prefixes",
                "2",
                "--prefix-tokens",
                "64",
                "--cpu-kv-memory",
                "8GiB",
                "--no-plot",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "simulate.json").read_text())
    assert list(report["results"]) == ["paged", "paged_host_tier", "contiguous"]
    assert report["workload"]["prefix_sharing"] is True
    assert report["workload"]["prefix_caching"] == "off (not modelled with --cpu-kv-memory)"
    assert "prefix_caching" not in report


def test_the_simulator_refuses_a_host_tier_with_prefix_caching():
    from kvpool.scheduler.swap import HostTierSpec
    from kvpool.sim.presets import get_preset
    from kvpool.sim.runner import SimulationSpec, simulate

    spec = SimulationSpec(
        preset=get_preset("llama-3-8b"),
        kv_memory_bytes=2**30,
        requests=[],
        host_tier=HostTierSpec(2**30),
        prefix_caching=True,
    )
    with pytest.raises(ValueError, match="host tier and prefix caching are not modelled together"):
        simulate(spec)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpu-kv-memory", "-1"], "--cpu-kv-memory: cannot read memory size '-1'"),
        (
            ["--cpu-kv-memory", "1e400"],
            "--cpu-kv-memory: memory size '1e400' is too large to be a number of bytes",
        ),
        (["--cpu-kv-memory", "0"], "--cpu-kv-memory: memory size must be positive"),
        (["--cpu-kv-memory", "lots"], "--cpu-kv-memory: cannot read memory size 'lots'"),
        (
            ["--cpu-kv-memory", "1MiB"],
            "--cpu-kv-memory must hold 1 to 2147483647 blocks of 2097152 bytes",
        ),
        (["--cpu-kv-memory", "1e300"], "--cpu-kv-memory must hold 1 to 2147483647 blocks"),
        (["--preemption", "swap"], "--preemption need --cpu-kv-memory"),
        (
            ["--host-link-gbps", "20", "--host-link-latency-us", "5"],
            "--host-link-gbps, --host-link-latency-us need --cpu-kv-memory",
        ),
        (
            ["--cpu-kv-memory", "1GiB", "--preemption", "always"],
            "argument --preemption: invalid choice: 'always'",
        ),
        (
            ["--cpu-kv-memory", "1GiB", "--host-link-gbps", "0"],
            "argument --host-link-gbps: must be a finite number >= 0.001 and <= 1e+06",
        ),
        (
            ["--cpu-kv-memory", "1GiB", "--host-link-gbps", "inf"],
            "argument --host-link-gbps: must be a finite number >= 0.001",
        ),
        (
            ["--cpu-kv-memory", "1GiB", "--host-link-latency-us", "-1"],
            "argument --host-link-latency-us: must be a finite number >= 0",
        ),
        (
            ["--cpu-kv-memory", "1GiB", "--disaggregated"],
            "--cpu-kv-memory cannot be used with --disaggregated",
        ),
    ],
)
def test_bad_host_tier_options(capsys, tmp_path, args, message):
    line = refused(capsys, [*PREEMPTING, *args, "--out", str(tmp_path / "r")])
    assert message in line, line
    assert not (tmp_path / "r").exists()


def test_a_bad_tier_size_is_refused_before_anything_is_allocated(capsys, monkeypatch, tmp_path):
    forbid_simulation(monkeypatch)
    for size in ("-1", "1e400"):
        assert "--cpu-kv-memory" in refused(
            capsys, [*PREEMPTING, "--cpu-kv-memory", size, "--out", str(tmp_path / "r")]
        )
