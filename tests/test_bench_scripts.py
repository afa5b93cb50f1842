"""The benchmark harness (bench/kvbench.py and its routines) runs end to end on a CPU, and the
scripts around it refuse what they must before running anything."""

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import kvpool
import pytest

REPO = Path(__file__).resolve().parent.parent


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_cpu_script_refuses_a_dirty_tree_before_writing_anything(tmp_path):
    # A repository holding the script and one tracked file, then a change to that file: the
    # figures would not name the code they measured, so the script must stop at once.
    (tmp_path / "bench").mkdir()
    shutil.copy(REPO / "bench" / "cpu.sh", tmp_path / "bench" / "cpu.sh")
    (tmp_path / "tracked.txt").write_text("committed\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "clean")
    (tmp_path / "tracked.txt").write_text("changed\n")

    run = subprocess.run(
        ["bash", "bench/cpu.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )

    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == "cpu.sh: the working tree has changes; commit them first"
    assert run.stdout == ""
    assert not (tmp_path / "bench" / "results").exists()
    # Committed, the same tree passes the check and goes on to its first step (which fails
    # here, where bench/provenance.py does not exist): the refusal was the dirty tree's.
    _git(tmp_path, "commit", "-q", "-am", "committed")
    run = subprocess.run(
        ["bash", "bench/cpu.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert run.returncode != 0
    assert "working tree has changes" not in run.stderr
    assert "provenance" in run.stderr


def test_the_shape_grid_records_a_failing_shape_and_writes_after_every_row(tmp_path, capsys):
    # bench/shape_grid.py (the fp8 benchmarks' loop) imports nothing GPU-only, so its contract
    # is checked here: a shape that raises becomes a row with its error and the next shape still
    # runs, and the JSON on disk holds every row measured so far at each step.
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("shape_grid", REPO / "bench" / "shape_grid.py")
    shape_grid = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shape_grid)

    def measure(batch, seq_len):
        if batch == 2:
            raise RuntimeError("no kernel for this shape")
        return {"shape": f"{batch}x{seq_len}", "us": batch * seq_len}

    out = tmp_path / "grid.json"
    result = {"rows": []}
    seen = []
    for row in shape_grid.measure_grid([(1, 8), (2, 8), (3, 8)], measure, result, str(out)):
        on_disk = json.loads(out.read_text())["rows"]
        assert on_disk[-1] == row and len(on_disk) == len(seen) + 1
        seen.append(row)
    assert seen == [
        {"shape": "1x8", "us": 8},
        {"shape": "2x8", "error": "RuntimeError: no kernel for this shape"},
        {"shape": "3x8", "us": 24},
    ]
    assert result["rows"] == seen
    assert "RuntimeError: no kernel for this shape" in capsys.readouterr().err  # the traceback


def _kvbench(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # The kvpool this test imported (an installed wheel in CI, python/ in a source checkout).
    package_root = str(Path(kvpool.__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / "kvbench.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_driver_lists_every_routine_and_each_has_a_main(tmp_path):
    run = _kvbench("--list", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    listed = [line.split()[0] for line in run.stdout.splitlines()]
    modules = sorted(p.stem for p in (REPO / "bench" / "routines").glob("*.py"))
    assert sorted(listed) == [m for m in modules if m != "__init__"]
    for name in listed:  # parsed, not imported: most routines import CuPy or torch at the top
        tree = ast.parse((REPO / "bench" / "routines" / f"{name}.py").read_text())
        mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        assert mains and mains[0].args.args[0].arg == "argv", name
    unknown = _kvbench("--routine", "no_such_routine", cwd=tmp_path)
    assert unknown.returncode == 2 and "invalid choice" in unknown.stderr


def test_a_cpu_routine_writes_its_json_with_provenance_through_the_driver(tmp_path):
    # The pool routine (ours against the pure-Python free list) at its shortest: the harness's
    # path from the command line to the JSON that the README's allocator figures are read from.
    out = tmp_path / "run"
    run = _kvbench(
        "--routine", "pool", "--out", str(out), "--commit", "abc1234", "--repeat", "1",
        "--min-time", "0.001", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    record = json.loads((out / "pool.json").read_text())
    assert record["provenance"]["commit"] == "abc1234"
    assert record["provenance"]["script"] == "bench/routines/pool.py"
    names = {case["name"] for case in record["cases"]}
    assert {"alloc_many16_free_many", "alloc_free_single"} <= names
    for case in record["cases"]:
        assert case["ours_us"] > 0 and case["baseline_us"] > 0
    assert record["targets"]
    assert sorted(p.name for p in out.iterdir()) == ["pool.json"]


def _stub_gpu_machine(tmp_path: Path, gpus: int) -> tuple[dict[str, str], Path]:
    """A PATH whose python3 reports `gpus` CUDA devices and otherwise only logs its arguments
    (every import "succeeds"), and whose nvidia-smi prints nothing."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(
        "#!/bin/bash\n"
        f'case "$*" in *getDeviceCount*) echo {gpus}; exit 0 ;; esac\n'
        f'echo "$*" >> "{log}"\n'
    )
    (bin_dir / "nvidia-smi").write_text("#!/bin/bash\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, log


def _gpu_sh(env: dict[str, str], out: Path) -> subprocess.CompletedProcess:
    """bench/gpu.sh into `out` on the stub machine `env`."""
    return subprocess.run(
        ["bash", str(REPO / "bench" / "gpu.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("gpus", [1, 2])
def test_gpu_script_runs_the_steps_asked_for_into_one_folder(tmp_path, gpus):
    # bench/gpu.sh's plumbing, without a GPU: each step calls the driver with the file names
    # tools/quote_figures.py reads, the two-GPU routines run only where two GPUs are found, and
    # summary.txt has one line per step run.
    env, log = _stub_gpu_machine(tmp_path, gpus)
    out = tmp_path / "run"
    env["STEPS"] = "decode pool sim transfer"
    run = _gpu_sh(env, out)
    assert run.returncode == 0, run.stderr
    calls = log.read_text().splitlines()
    driver = [c.split("--routine ", 1)[1] for c in calls if "bench/kvbench.py --routine" in c]
    expected = [
        f"decode --out {out} --name decode",
        f"pool --out {out} --name pool_cuda --device cuda",
        f"sim --out {out} --name sim_cuda --device cuda --num-requests 2000",
    ]
    if gpus == 2:
        expected.append(f"transfer --out {out} --name transfer")
    assert driver == expected
    assert any("--warm-flashinfer decode fp8 prefill" in c for c in calls)
    summary = (out / "summary.txt").read_text().splitlines()
    steps = [line.split(":")[0] for line in summary]
    assert steps == [e.split()[4] for e in expected] + ([] if gpus == 2 else ["transfer"])
    if gpus == 1:
        assert summary[-1] == "transfer: skipped (one GPU)"
    assert (out / "gpu.txt").exists()


def test_gpu_script_checks_every_step_name_before_running_any(tmp_path):
    env, log = _stub_gpu_machine(tmp_path, 1)
    env["STEPS"] = "pool decdoe"
    run = _gpu_sh(env, tmp_path / "run")
    assert run.returncode == 2
    assert "unknown step 'decdoe'" in run.stderr
    assert not any("--routine" in c for c in log.read_text().splitlines())  # pool did not run


def test_gpu_script_tests_step_is_its_groups_each_under_a_time_limit(tmp_path):
    env, log = _stub_gpu_machine(tmp_path, 1)
    env["STEPS"] = "tests"
    out = tmp_path / "run"
    run = _gpu_sh(env, out)
    assert run.returncode == 0, run.stderr
    steps = [line.split(":")[0] for line in (out / "summary.txt").read_text().splitlines()]
    assert steps[:4] == ["gpu_tests", "prefill_tests", "fp8_tests", "host_tier_tests"]
    assert steps[-1] == "gpu2_tests"  # skipped with one GPU, and said so
    pytest_calls = [c for c in log.read_text().splitlines() if "-m pytest" in c]
    assert len(pytest_calls) >= 4
    assert not any("--warm-flashinfer" in c for c in log.read_text().splitlines())


def test_gpu_script_refuses_a_machine_without_a_cuda_device(tmp_path):
    env, log = _stub_gpu_machine(tmp_path, 0)
    run = _gpu_sh(env, tmp_path / "run")
    assert run.returncode == 2
    assert "CuPy sees no CUDA device" in run.stderr
    assert not log.exists()  # no step ran


def test_a_routines_help_runs_nothing_and_makes_no_run_folder(tmp_path):
    before = sorted((REPO / "bench" / "results").iterdir())
    run = _kvbench("--routine", "sim", "--help", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "--num-requests" in run.stdout  # the routine's own options
    assert sorted((REPO / "bench" / "results").iterdir()) == before


def _load_bench_module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_timing_rotates_enough_input_sets_to_leave_the_l2_and_times_interleaved():
    timing = _load_bench_module("timing")
    mib = 1 << 20
    # Enough sets that one pass touches ROTATE_BYTES, at least one and at most MAX_ROTATIONS.
    assert timing.rotations(timing.ROTATE_BYTES) == 1
    assert timing.rotations(timing.ROTATE_BYTES * 3) == 1
    assert timing.rotations(100 * mib) == 6  # ceil(512 / 100)
    assert timing.rotations(mib) == timing.MAX_ROTATIONS
    blocks = []  # the functions in the order their runs came, a run of calls as one entry

    def mark(name):
        if not blocks or blocks[-1] != name:
            blocks.append(name)

    runs = timing.interleaved_timeit({"a": lambda: mark("a"), "b": lambda: mark("b")}, 3, 0.001)
    assert sorted(runs) == ["a", "b"] and all(len(r) == 3 and min(r) > 0 for r in runs.values())
    # Each calibrated once (a, then b), then the timed runs alternate: a, b, three times.
    assert blocks == ["a", "b"] * 4
    synced = []
    seconds, result = timing.synced_wall(lambda: 7, lambda: synced.append(1))
    assert result == 7 and seconds >= 0 and synced == [1, 1]
