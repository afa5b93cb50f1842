"""Shared pytest setup: Hypothesis profiles, the `gpu` marker's skip (the only one GPU tests
use) and the `cp` fixture (CuPy; helpers for GPU tests are in gpu_fixtures.py).

Profiles (pydantic-core keeps the same pair):
- "ci" (the default, so also whenever CI is set): derandomized, so every run draws the
  same examples; modest example counts; failures print a reproduction blob.
- "soak": many random examples (5000 per test, or KVPOOL_SOAK_EXAMPLES); select with
  HYPOTHESIS_PROFILE=soak. Its last run over every state machine, with the command and
  Hypothesis' statistics: bench/results/2026-12-01_a2a1a33_dev-vm/hypothesis_soak.txt.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=60,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "soak",
    derandomize=False,
    deadline=None,
    max_examples=int(os.environ.get("KVPOOL_SOAK_EXAMPLES", "5000")),
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# An explicit HYPOTHESIS_PROFILE wins (a soak job may run under CI); otherwise "ci".
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "ci")


def _gpu_unavailable_reason() -> str | None:
    """Why GPU tests cannot run here, or None when CuPy and a CUDA device are both present."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CuPy may warn about its CUDA setup on import
            import cupy  # noqa: F401
    except Exception as e:  # ImportError, or CuPy failing to find its CUDA libraries
        return f"cupy is not importable ({type(e).__name__}: {e})"
    import kvpool

    if not kvpool.cuda_available():
        return "kvpool.cuda_available() is False (no CUDA driver or device)"
    return None


def _two_gpus_unavailable_reason() -> str | None:
    """Why two-GPU tests cannot run here, or None."""
    reason = _gpu_unavailable_reason()
    if reason is not None:
        return reason
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    return None if count >= 2 else f"{count} CUDA device(s), two needed"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker, why in (("gpu", _gpu_unavailable_reason), ("gpu2", _two_gpus_unavailable_reason)):
        marked = [item for item in items if item.get_closest_marker(marker) is not None]
        if not marked:
            continue
        reason = why()
        if reason is None:
            continue
        skip = pytest.mark.skip(reason=f"{marker} test: {reason}")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cp() -> Any:
    """CuPy, for tests marked `gpu` (skipped before this runs when CuPy or a GPU is missing)."""
    import cupy

    return cupy
