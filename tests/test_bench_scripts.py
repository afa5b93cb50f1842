"""The refusals of the benchmark session scripts, which run no benchmark when they refuse."""

import shutil
import subprocess
from pathlib import Path

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
def test_vm_session_refuses_a_dirty_tree_before_writing_anything(tmp_path):
    # A repository holding the script and one tracked file, then a change to that file: the
    # figures would not name the code they measured, so the script must stop at once.
    (tmp_path / "bench").mkdir()
    shutil.copy(REPO / "bench" / "vm_session.sh", tmp_path / "bench" / "vm_session.sh")
    (tmp_path / "tracked.txt").write_text("committed\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "clean")
    (tmp_path / "tracked.txt").write_text("changed\n")

    run = subprocess.run(
        ["bash", "bench/vm_session.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )

    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == "vm_session.sh: the working tree has changes; commit them first"
    assert run.stdout == ""
    assert not (tmp_path / "bench" / "results").exists()
    # Committed, the same tree passes the check and goes on to its first step (which fails
    # here, where bench/provenance.py does not exist): the refusal was the dirty tree's.
    _git(tmp_path, "commit", "-q", "-am", "committed")
    run = subprocess.run(
        ["bash", "bench/vm_session.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60
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
