"""Checks shared by the `kvpool simulate` option tests: a refusal is exit status 2 with one
line, and a bad option is refused before any pool, tables, tier or simulation exists."""

from __future__ import annotations

import pytest
from kvpool.sim.cli import main


def refused(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    """Runs the CLI in-process and returns its one error line (exit status 2 asserted)."""
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpool simulate: error: "), err
    assert "Traceback" not in err
    return lines[0]


def forbid_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes any pool, tables, host tier or simulation fail the test. The CLI imports simulate
    and simulate_disaggregated by name, so its own references are patched too."""

    def refuse(*args, **kwargs):
        raise AssertionError("the simulation started although an option was bad")

    for name in (
        "kvpool.Pool",
        "kvpool.BlockTables",
        "kvpool.HostTier",
        "kvpool.sim.runner.simulate",
        "kvpool.sim.cli.simulate",
        "kvpool.sim.cli.simulate_disaggregated",
    ):
        monkeypatch.setattr(name, refuse)
