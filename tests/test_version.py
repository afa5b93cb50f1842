"""`kvpool.__version__` and `kvpool --version`: the installed distribution's version, which
maturin takes from Cargo.toml."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import kvpool
import pytest
from kvpool.sim.cli import main

CARGO_TOML = Path(__file__).resolve().parents[1] / "Cargo.toml"


def installed_version() -> str:
    try:
        return version("kvpool")
    except PackageNotFoundError:
        pytest.skip("kvpool is imported from a source tree that was never installed")


def test_version_is_the_installed_distributions():
    assert kvpool.__version__ == installed_version()


def test_version_matches_cargo_toml():
    cargo = tomllib.loads(CARGO_TOML.read_text(encoding="utf-8"))
    assert installed_version() == cargo["workspace"]["package"]["version"]
    assert kvpool.__version__ == cargo["workspace"]["package"]["version"]


def test_cli_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"kvpool {kvpool.__version__}\n"


def test_python_dash_m_version():
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"kvpool {kvpool.__version__}\n"


def test_version_needs_no_subcommand_and_simulates_nothing(monkeypatch, capsys):
    import kvpool.sim.cli as cli

    def refuse(*args, **kwargs):
        raise AssertionError("--version ran a simulation")

    monkeypatch.setattr(cli, "simulate_command", refuse)
    assert main(["--version", "simulate"]) == 0
    assert capsys.readouterr().out.startswith("kvpool ")
