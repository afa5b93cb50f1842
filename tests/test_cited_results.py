"""Every run folder and file under bench/results/ that the repository's documents and sources
cite exists (old runs are pruned to what is cited; this keeps a prune from breaking a citation),
and every run folder there is cited by something other than the index (a run nobody cites is
pruned, not kept)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# A run folder (<date>_<commit>_<machine>), then optionally a path inside it.
CITED = re.compile(r"(\d{4}-\d{2}-\d{2}_[0-9a-f]{7,40}_[A-Za-z0-9-]+)((?:/[A-Za-z0-9_.{}*-]+)*)")
INDEX = "bench/results/README.md"


def cited_paths():
    files = subprocess.run(
        ["git", "ls-files", "*.md", "*.py", "*.rs", "*.sh", "*.toml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        if name.startswith("bench/results/2"):  # a run's own logs name folders of the GPU machine
            continue
        for m in CITED.finditer((REPO / name).read_text(errors="replace")):
            yield name, m.group(1), m.group(2)


def expand(rest):
    """`pool_host_{1..4}.json` -> four names; `prefix_sim_*.png` stays a glob."""
    m = re.search(r"\{(\d+)\.\.(\d+)\}", rest)
    if not m:
        return [rest]
    return [rest[: m.start()] + str(i) + rest[m.end() :] for i in range(int(m[1]), int(m[2]) + 1)]


@pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(),
    reason="lists the tracked files with git",
)
def test_every_cited_result_exists():
    missing = []
    seen = 0
    for source, run, rest in cited_paths():
        seen += 1
        for r in expand(rest.rstrip(".")):
            target = RESULTS / (run + r)
            ok = any(RESULTS.glob(run + r)) if "*" in r else target.exists()
            if not ok:
                missing.append(f"{source}: {run}{r}")
    assert seen > 20, "the pattern found too few citations to be checking anything"
    assert not missing, "cited but not under bench/results/:\n" + "\n".join(sorted(set(missing)))


@pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(),
    reason="lists the tracked files with git",
)
def test_every_run_folder_is_cited_outside_the_index():
    cited = {run for source, run, _ in cited_paths() if source != INDEX}
    entries = sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md")
    assert entries, "no run folders found"
    not_runs = [name for name in entries if not CITED.fullmatch(name)]
    assert not not_runs, f"not named <date>_<commit>_<machine>: {not_runs}"
    uncited = [name for name in entries if name not in cited]
    assert not uncited, f"cited by nothing but {INDEX} (prune them): {uncited}"
