"""The fp8 decode's fragment mapping (cuda/fp8_fragments.cuh) replayed lane by lane in NumPy
(tools/fp8_fragment_emulator.py): for every fp8 head width and both formats, the emulated
mma data flow must reproduce Q K^T and P V of the dequantized tile exactly, with no bank
conflict and no read of a byte the copies did not write. No GPU needed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "tools" / "fp8_fragment_emulator.py"
_spec = importlib.util.spec_from_file_location("fp8_fragment_emulator", _PATH)
emu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emu)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dp", range(32, 257, 16))
def test_fragments_reproduce_the_tile_products_exactly(fmt, dp):
    rng = np.random.default_rng(dp)
    for _ in range(2):
        emu.run_tile(emu.Layout(dp), fmt, rng)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_integer_conversion_matches_the_value_tables(fmt):
    emu.check_integer_conversion(fmt)


def test_a_wrong_byte_permute_is_caught(monkeypatch):
    real = emu.byte_perm
    monkeypatch.setattr(emu, "byte_perm", lambda x, y, sel: real(y, x, sel))  # tokens swapped
    with pytest.raises(AssertionError, match="O differs"):
        emu.run_tile(emu.Layout(128), "e4m3", np.random.default_rng(1))


def test_layout_mirrors_the_host_sizes():
    from kvpool.kernels import _build

    for dp in range(32, 257, 16):
        lay = emu.Layout(dp)
        assert _build.fp8_row_bytes(dp) == (lay.k_row, lay.v_row)
