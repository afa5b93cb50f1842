"""Imported first by every test module that needs NIXL (the two-process transfer tests through
tests/nixl_peers.py, the disk tier's): loads it, or skips the importing module, never where CI
installs the wheel with its test extra (``KVPOOL_TEST_WHEEL=1``: there a missing NIXL fails).
In a peer process (a test file run as a script, no pytest session) a missing NIXL ends it."""

from __future__ import annotations

import os

import pytest

try:
    from kvpool.transfer.nixl_transport import NixlTransport, load_nixl

    load_nixl()
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("KVPOOL_TEST_WHEEL") == "1":
        raise  # CI installs nixl-cu13 with the test extra: never skip there
    pytest.skip(f"NIXL is not importable ({e}); install kvpool[nixl]", allow_module_level=True)

__all__ = ["NixlTransport"]
