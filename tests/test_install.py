"""The installed wheel, as bin/test.sh installs it: the tests run against it and not against the
source tree, it carries the manylinux tag tools/build_wheels.sh checked, its console script
works, and the optional dependencies CI promises are there.

bin/test.sh sets KVPOOL_TEST_WHEEL=1; without it (a developer's PYTHONPATH=python run) these
tests skip, since there is no installed wheel to check.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from importlib.metadata import distribution
from pathlib import Path

import kvpool
import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    os.environ.get("KVPOOL_TEST_WHEEL") != "1",
    reason="KVPOOL_TEST_WHEEL=1 is set by bin/test.sh, which installs the wheel",
)


def test_kvpool_is_imported_from_the_installed_wheel():
    package = Path(kvpool.__file__).resolve().parent
    assert not package.is_relative_to(REPO / "python"), package  # bin/test.sh's .venv is in REPO
    assert package.parent == Path(sysconfig.get_paths()["purelib"]).resolve()
    assert Path(kvpool._core.__file__).resolve().parent == package


def test_the_installed_wheel_is_manylinux_2_17():
    wheel = distribution("kvpool").read_text("WHEEL") or ""
    tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]
    assert "cp311-abi3-manylinux_2_17_x86_64" in tags, wheel


def test_the_console_script_reports_the_version():
    script = Path(sys.executable).parent / "kvpool"
    done = subprocess.run(
        [str(script), "--version"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"kvpool {kvpool.__version__}\n"


def test_the_wheel_carries_the_kernel_sources():
    sources = kvpool._core.kernel_sources()
    cuda = sorted(p.name for p in (REPO / "cuda").iterdir() if p.suffix in (".cu", ".cuh"))
    assert sorted(sources) == cuda


def test_torch_and_transformers_are_installed():
    # CI installs the transformers extra, so tests/test_transformers_cpu.py runs there and its
    # importorskip cannot quietly skip it.
    import torch
    import transformers

    assert torch.__version__.startswith("2.11.")
    assert transformers.__version__.startswith("5.17.")
