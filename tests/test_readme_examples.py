"""README.md's examples run as written, so a renamed or changed API fails here and not in a
reader's hands: its ```python blocks in order on the host backend (those marked `# on a GPU` are
compiled only; those marked `# with NIXL` run where NIXL is installed, as in CI), its `kvpool
...` commands through `python -m kvpool`, and every file it or bench/FIGURES.md links exists.
The tour links every design note beside the code."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import kvpool
import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
GPU_MARK = "# on a GPU"
NIXL_MARK = "# with NIXL"  # run where NIXL is installed (CI), compiled only elsewhere
LINK = re.compile(r"\]\(([^)\s]+)\)")


def code_blocks(lang):
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.S | re.M)


def kvpool_commands():
    """Every `kvpool ...` command of the README's bash blocks (a `&&` chain split, comments cut)."""
    for block in code_blocks("bash"):
        for line in block.splitlines():
            for part in line.split("&&"):
                command = part.split("#")[0].strip()
                if command.startswith("kvpool "):
                    yield command


def test_the_host_examples_run_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing an example writes lands in the checkout
    host = [b for b in code_blocks("python") if not b.startswith(GPU_MARK)]
    assert len(host) >= 8, "the README's host examples were not found"
    assert any(b.startswith(NIXL_MARK) for b in host), "the README's NIXL example was not found"
    namespace = {}
    for i, code in enumerate(host):
        if code.startswith(NIXL_MARK) and not nixl_importable():
            # CI installs nixl-cu13 with the test extra (KVPOOL_TEST_WHEEL=1): run there.
            assert os.environ.get("KVPOOL_TEST_WHEEL") != "1", "NIXL is not importable"
            compile(code, f"README.md host example {i + 1}", "exec")
            continue
        exec(compile(code, f"README.md host example {i + 1}", "exec"), namespace)


def nixl_importable() -> bool:
    try:
        from kvpool.transfer.nixl_transport import load_nixl

        load_nixl()
    except ImportError:
        return False
    return True


def test_the_gpu_examples_are_python():
    gpu = [b for b in code_blocks("python") if b.startswith(GPU_MARK)]
    assert gpu, "the README's GPU examples were not found"
    for i, code in enumerate(gpu):
        compile(code, f"README.md GPU example {i + 1}", "exec")


@pytest.mark.parametrize("command", sorted(set(kvpool_commands())))
def test_the_cli_commands_run(command, tmp_path):
    args = shlex.split(command)[1:] + ["--no-plot", "--no-progress", "--out", str(tmp_path)]
    # The kvpool this test imported, also from a source checkout run with a relative PYTHONPATH.
    package_root = str(Path(kvpool.__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(tmp_path.glob("*.json")), f"{command} wrote no report"


def test_the_readme_shows_both_commands():
    commands = set(kvpool_commands())
    assert "kvpool simulate" in commands
    assert "bash bin/test.sh" in "".join(code_blocks("bash"))


@pytest.mark.parametrize("doc", ["README.md", "bench/FIGURES.md"])
def test_every_linked_file_exists(doc):
    path = REPO / doc
    missing = [
        target
        for target in LINK.findall(path.read_text())
        if "://" not in target and not (path.parent / target.split("#")[0]).exists()
    ]
    assert not missing, f"{doc} links files that do not exist: {missing}"


def test_the_tour_links_every_design_note():
    linked = {(REPO / t).resolve() for t in LINK.findall(README)}
    notes = [p for top in ("rust", "python", "cuda") for p in (REPO / top).rglob("*.md")]
    assert len(notes) >= 10, "the design notes were not found"
    unlinked = sorted(str(p.relative_to(REPO)) for p in notes if p.resolve() not in linked)
    assert not unlinked, f"design notes the README does not link: {unlinked}"
