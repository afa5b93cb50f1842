"""`kvpool simulate` end to end on a tiny workload."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool.cli import main

TINY = ["simulate", "--num-requests", "60", "--kv-memory", "512MiB", "--max-model-len", "1024",
        "--max-running-seqs", "32", "--max-tokens-per-step", "512", "--no-progress"]

SUMMARY_FIELDS = {
    "completed", "steps", "mean_running", "peak_running", "mean_waiting", "peak_blocks_used",
    "kv_utilization", "mean_wasted_kv_bytes", "peak_wasted_kv_bytes", "preemptions",
    "output_tokens", "prefill_tokens", "tokens_per_step", "output_tokens_per_step",
    "modelled_time_s", "modelled_output_tokens_per_s", "wall_s", "alloc_s", "alloc_share",
    "run_wall_s", "latency_mean_s", "latency_p50_s", "latency_p99_s", "ttft_mean_s", "ttft_p99_s",
    "series",
}


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    assert main([*TINY, "--out", str(out)]) == 0
    return out


def test_json_report_has_every_field(report_dir):
    report = json.loads((report_dir / "simulate.json").read_text())
    for key in ("model", "kv_memory_bytes", "num_blocks", "device", "scheduler", "workload", "timing",
                "results", "comparison", "total_wall_s", "command"):
        assert key in report, key
    assert report["num_blocks"] == 256  # 512 MiB of 2 MiB Llama-3-8B blocks
    assert report["timing"]["clock"] == "modelled"
    for name in ("paged", "contiguous"):
        result = report["results"][name]
        assert SUMMARY_FIELDS <= result.keys(), SUMMARY_FIELDS - result.keys()
        assert result["completed"] == 60
        assert set(result["series"]) == {"step", "time_s", "running", "waiting", "kv_utilization", "blocks_used"}
    assert "blocked_by_fragmentation" in report["results"]["contiguous"]
    c = report["comparison"]
    assert c["mean_concurrency_ratio"] > 1
    assert c["paged_kv_utilization"] > c["contiguous_kv_utilization"]


def test_png_is_a_valid_image(report_dir):
    import matplotlib.image

    path = report_dir / "simulate.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 300 and image.shape[1] > 400


def test_trace_file_runs(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{i * 0.01},{20 + i},{10 + i}\n" for i in range(20)))
    assert main([*TINY, "--trace", str(trace), "--out", str(tmp_path / "r"), "--no-plot"]) == 0
    report = json.loads((tmp_path / "r" / "simulate.json").read_text())
    assert report["workload"]["kind"] == "trace" and report["results"]["paged"]["completed"] == 20
    assert "paged" in capsys.readouterr().out


def test_malformed_trace_is_a_clear_error(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 4}\n{"arrival_s": 1, "prompt_tokens": "many"}\n')
    assert main([*TINY, "--trace", str(trace), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:2:" in err and "prompt_tokens must be a number" in err
    assert not (tmp_path / "r").exists()


def test_python_dash_m_exit_status(tmp_path):
    run = subprocess.run([sys.executable, "-m", "kvpool", "simulate", "--trace", str(tmp_path / "missing.jsonl")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "cannot read trace" in run.stderr and "Traceback" not in run.stderr


def test_bad_arguments():
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--model", "gpt-5"])
    assert e.value.code == 2
    assert main([*TINY, "--kv-memory", "lots"]) == 2
