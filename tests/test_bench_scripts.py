"""The refusals of the benchmark session scripts, which run no benchmark when they refuse."""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


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

    run = subprocess.run(["bash", "bench/vm_session.sh"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)

    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == "vm_session.sh: the working tree has changes; commit them first"
    assert run.stdout == ""
    assert not (tmp_path / "bench" / "results").exists()
    # Committed, the same tree passes the check and goes on to its first step (which fails
    # here, where bench/provenance.py does not exist): the refusal was the dirty tree's.
    _git(tmp_path, "commit", "-q", "-am", "committed")
    run = subprocess.run(["bash", "bench/vm_session.sh"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0
    assert "working tree has changes" not in run.stderr
    assert "provenance" in run.stderr
