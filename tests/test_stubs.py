"""`_core.pyi` matches the compiled module (mypy's stubtest). The stub is all that type checkers
and editors see of the Rust extension, and nothing else notices when a binding change leaves it
saying something else. mypy is in the `test` extra, so a missing mypy fails here rather than
skipping."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_stubtest_passes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "kvpool._core"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    output = done.stdout + done.stderr
    print(output)
    assert done.returncode == 0, f"stubtest found mismatches in python/kvpool/_core.pyi:\n{output}"
