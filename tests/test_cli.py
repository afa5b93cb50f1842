"""`kvpool simulate` end to end on a tiny workload."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_checks import forbid_simulation, refused
from kvpool.sim.cli import main

BASE = [
    "simulate",
    "--kv-memory",
    "512MiB",
    "--max-model-len",
    "1024",
    "--max-running-seqs",
    "32",
    "--max-tokens-per-step",
    "512",
    "--no-progress",
]
TINY = [*BASE, "--num-requests", "60"]

SUMMARY_FIELDS = {
    "completed",
    "steps",
    "mean_running",
    "peak_running",
    "mean_waiting",
    "peak_blocks_used",
    "kv_utilization",
    "mean_wasted_kv_bytes",
    "peak_wasted_kv_bytes",
    "preemptions",
    "output_tokens",
    "prefill_tokens",
    "tokens_per_step",
    "output_tokens_per_step",
    "modelled_time_s",
    "modelled_output_tokens_per_s",
    "wall_s",
    "alloc_s",
    "alloc_share",
    "run_wall_s",
    "latency_mean_s",
    "latency_p50_s",
    "latency_p99_s",
    "ttft_mean_s",
    "ttft_p99_s",
    "series",
}


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    assert main([*TINY, "--out", str(out)]) == 0
    return out


def test_json_report_has_every_field(report_dir):
    report = json.loads((report_dir / "simulate.json").read_text())
    for key in (
        "model",
        "kv_memory_bytes",
        "num_blocks",
        "device",
        "scheduler",
        "workload",
        "timing",
        "results",
        "comparison",
        "total_wall_s",
        "command",
    ):
        assert key in report, key
    assert report["num_blocks"] == 256  # 512 MiB of 2 MiB Llama-3-8B blocks
    assert report["timing"]["clock"] == "modelled"
    for name in ("paged", "contiguous"):
        result = report["results"][name]
        assert result.keys() >= SUMMARY_FIELDS, SUMMARY_FIELDS - result.keys()
        assert result["completed"] == 60
        assert set(result["series"]) == {
            "step",
            "time_s",
            "running",
            "waiting",
            "kv_utilization",
            "blocks_used",
        }
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
    trace.write_text(
        "arrival_s,prompt_tokens,output_tokens\n"
        + "".join(f"{i * 0.01},{20 + i},{10 + i}\n" for i in range(20))
    )
    assert main([*BASE, "--trace", str(trace), "--out", str(tmp_path / "r"), "--no-plot"]) == 0
    report = json.loads((tmp_path / "r" / "simulate.json").read_text())
    assert report["workload"]["kind"] == "trace" and report["results"]["paged"]["completed"] == 20
    assert "paged" in capsys.readouterr().out


def test_malformed_trace_is_a_clear_error(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 4}\n{"arrival_s": 1, "prompt_tokens": "many"}\n'
    )
    assert main([*BASE, "--trace", str(trace), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"--trace {trace}:2:" in err and "prompt_tokens must be a number" in err
    assert not (tmp_path / "r").exists()


def test_python_dash_m_exit_status(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "kvpool", "simulate", "--trace", str(tmp_path / "missing.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "error: --trace " in run.stderr and "cannot read trace" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt-5"], "argument --model: unknown model preset 'gpt-5'"),
        (["--kv-memory", "lots"], "bytes; cannot read memory size 'lots'"),
        (["--kv-memory", "0"], "--kv-memory must hold 1 to 2147483647 blocks of 2097152 bytes"),
        (["--kv-memory", "0"], "bytes; memory size must be positive"),
        (["--kv-memory", "1e400"], "bytes; memory size '1e400' is too large"),
        (["--kv-memory", "1e400"], "i.e. 2097152 to 4503599625273344 bytes"),
        (["--kv-memory", "1MiB"], "--kv-memory must hold 1 to 2147483647 blocks of 2097152 bytes"),
        (["--kv-memory", "1e300"], "--kv-memory must hold 1 to 2147483647 blocks"),
        (
            ["--max-model-len", "99999999999999999999"],
            "argument --max-model-len: must be in [2, 2147483647]",
        ),
        (
            ["--max-model-len", "100000"],
            "--max-model-len must be in [2, 4096] (one sequence of it must fit",
        ),
        (["--max-model-len", "1"], "argument --max-model-len: must be in [2, 2147483647], got 1"),
        (["--block-size", "0"], "argument --block-size: must be in [1, 2147483647], got 0"),
        (["--block-size", "16.5"], "argument --block-size: must be an integer in [1, 2147483647]"),
        (["--num-prefixes", "-1"], "argument --num-prefixes: must be in [0, 2147483647], got -1"),
        (
            ["--num-prefixes", "2", "--prefix-tokens", "-5"],
            "argument --prefix-tokens: must be in [0, ",
        ),
        (
            ["--num-prefixes", "2", "--prefix-tokens", "1023"],
            "--prefix-tokens must be in [0, 1022]",
        ),
        (["--measure-every", "0"], "argument --measure-every: must be in [1, 2147483647], got 0"),
        (["--num-requests", "0"], "argument --num-requests: must be in [1, 10000000], got 0"),
        (["--seed", "-1"], "argument --seed: must be in [0, "),
        (["--watermark", "1"], "argument --watermark: must be a number in [0, 1), got '1'"),
        (["--watermark", "nan"], "argument --watermark: must be a number in [0, 1)"),
        (["--max-running-seqs", "0"], "argument --max-running-seqs: must be in [1, "),
        (
            ["--max-tokens-per-step", "16"],
            "--max-tokens-per-step must be >= --max-running-seqs (32)",
        ),
        (
            ["--max-running-seqs", "40000000", "--max-tokens-per-step", "40000000"],
            "--max-running-seqs must be in [1, 33554431]",
        ),
        (["--policy", "random"], "argument --policy: invalid choice: 'random'"),
        (
            ["--kv-dtype", "int4"],
            "argument --kv-dtype: must be one of float16, bfloat16, "
            "float8_e4m3fn, float8_e5m2 (fp8 = float8_e4m3fn), got 'int4'",
        ),
        (["--kv-dtype", "float32"], "argument --kv-dtype: must be one of float16, bfloat16, "),
    ],
)
def test_every_bad_option_is_one_line_and_exit_2(capsys, tmp_path, args, message):
    line = refused(capsys, [*TINY, *args, "--out", str(tmp_path / "r")])
    assert message in line, line
    assert not (tmp_path / "r").exists()


def test_block_sizes_the_model_allows_run(tmp_path):
    # The host pool's stand-in layout takes every block size the model's layout takes.
    for block_size in (1, 3, 8):
        out = tmp_path / str(block_size)
        assert (
            main(
                [
                    *TINY,
                    "--num-requests",
                    "5",
                    "--block-size",
                    str(block_size),
                    "--no-plot",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        report = json.loads((out / "simulate.json").read_text())
        assert report["model"]["block_size"] == block_size
        assert report["results"]["paged"]["completed"] == 5


def test_options_are_checked_before_anything_is_allocated(capsys, monkeypatch, tmp_path):
    forbid_simulation(monkeypatch)
    line = refused(capsys, [*TINY, "--max-model-len", "10000000", "--out", str(tmp_path / "r")])
    assert "--max-model-len must be in [2, 4096]" in line


def test_python_dash_m_bad_option_is_one_line(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpool",
            *TINY,
            "--kv-memory",
            "1e400",
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "kvpool simulate: error: --kv-memory must hold 1 to 2147483647 blocks of 2097152 bytes "
        "(llama-3-8b, --block-size 16), i.e. 2097152 to 4503599625273344 bytes; "
        "memory size '1e400' is too large to be a number of bytes"
    ]


def test_command_records_the_given_argv(report_dir):
    report = json.loads((report_dir / "simulate.json").read_text())
    assert report["command"] == ["kvpool", *TINY, "--out", str(report_dir)]  # not pytest's sys.argv


def test_model_names_are_normalised(tmp_path):
    assert (
        main(
            [
                *TINY,
                "--num-requests",
                "5",
                "--model",
                "Llama_3_8B",
                "--no-plot",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "simulate.json").read_text())
    assert report["model"]["name"] == "llama-3-8b"


def test_cuda_on_a_cpu_box_is_a_clean_error(tmp_path):
    import kvpool

    if kvpool.cuda_available():
        pytest.skip("a GPU is present")
    run = subprocess.run(
        [sys.executable, "-m", "kvpool", *TINY, "--device", "cuda", "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr  # an option's fault: it names --device
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpool simulate: error: --device cuda")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("arrival", ["poisson", "burst"])
def test_rate_and_arrival_options(tmp_path, arrival):
    extra = ["--burst-size", "8"] if arrival == "burst" else []
    out = tmp_path / arrival
    assert (
        main([*TINY, "--rate", "40", "--arrival", arrival, *extra, "--no-plot", "--out", str(out)])
        == 0
    )
    workload = json.loads((out / "simulate.json").read_text())["workload"]
    assert workload["arrival"] == arrival and workload["rate_per_s"] == 40
    assert workload["last_arrival_s"] > 0
    if arrival == "burst":
        assert workload["burst_size"] == 8
        assert workload["last_arrival_s"] == pytest.approx((59 // 8) * 8 / 40)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "fast"], "rate must be a number"),
        (["--rate", "0"], "rate must be > 0"),
        (["--rate", "nan"], "rate must be > 0"),
        (
            ["--rate", "10", "--arrival", "burst", "--burst-size", "0"],
            "--burst-size: must be in [1, ",
        ),
        (
            ["--rate", "10", "--arrival", "burst", "--burst-size", "-2"],
            "--burst-size: must be in [1, ",
        ),
        (["--arrival", "burst"], "--arrival needs a finite --rate"),
        (["--rate", "inf", "--arrival", "burst"], "--arrival needs a finite --rate"),
        (["--rate", "10", "--burst-size", "4"], "--burst-size needs --arrival burst"),
        (["--prefix-tokens", "32"], "--prefix-tokens needs --num-prefixes"),
        (["--trace", "t.jsonl"], "--num-requests cannot be used with --trace"),
        (
            ["--trace", "t.jsonl", "--seed", "3", "--rate", "5"],
            "--num-requests, --seed, --rate cannot be used",
        ),
    ],
)
def test_bad_or_inert_option_combinations(capsys, args, message):
    assert message in refused(capsys, [*TINY, *args])


def test_unusable_out_fails_before_the_simulation(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert "--out" in refused(capsys, [*TINY, "--out", str(blocker)])
    assert "exists and is not a directory" in refused(capsys, [*TINY, "--out", str(blocker)])
    assert "is not a directory" in refused(capsys, [*TINY, "--out", str(blocker / "sub")])


def test_missing_plot_dependency_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main([*TINY, "--out", str(tmp_path / "r")]) == 1
    assert "install kvpool[sim]" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_fp8_cache_holds_twice_the_blocks(tmp_path):
    runs = {}
    for dtype in ("float16", "fp8"):
        out = tmp_path / dtype
        assert (
            main(
                [*TINY, "--num-requests", "5", "--kv-dtype", dtype, "--no-plot", "--out", str(out)]
            )
            == 0
        )
        runs[dtype] = json.loads((out / "simulate.json").read_text())
    assert runs["fp8"]["model"]["dtype"] == "float8_e4m3fn"
    assert runs["fp8"]["num_blocks"] == 2 * runs["float16"]["num_blocks"]
    assert runs["fp8"]["model"]["token_bytes"] * 2 == runs["float16"]["model"]["token_bytes"]
