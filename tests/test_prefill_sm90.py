"""CPU checks of the Hopper prefill's host side: the generated wgmma header is the generator's
output, the knob's values, and which kernel a plan picks for its tiles."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kvpool.kernels import _build, _tuning

ROOT = Path(__file__).resolve().parent.parent


def test_the_wgmma_header_is_the_generators_output():
    gen = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_wgmma.py"), "--check"])
    assert gen.returncode == 0, "cuda/wgmma_sm90.cuh is stale: run python tools/gen_wgmma.py"


def test_the_prefill_kernel_knob_takes_three_values():
    assert _tuning.current().prefill_kernel == "auto"
    for value in _tuning.PREFILL_KERNELS:
        with _tuning.override(prefill_kernel=value) as t:
            assert t.prefill_kernel == value
    with pytest.raises(ValueError, match="prefill_kernel"), _tuning.override(prefill_kernel="sm75"):
        pass


@pytest.mark.parametrize("d", _build.HEAD_DIMS)
def test_sm90_variants_fit_one_cta_per_sm(d):
    v = _build.sm90_prefill_variant("bfloat16", d, 16)
    assert v.sm90 and v.arch == "sm_90a" and v.threads == 384 and v.rows == 128
    assert v.dynamic_smem_bytes <= _build.SMEM_PER_SM and v.ctas_per_sm == 1
    assert v.kernel == "paged_prefill_sm90" and v.source == "paged_prefill_sm90.cu"
    assert not v.merge_variant.sm90 and v.merge_variant.head_dim == d
    assert f"-DBN={_build.SM90_BN[d]}" in v.options()
    with pytest.raises(ValueError, match="16-bit"):
        _build.PrefillVariant("float8_e4m3fn", d, 16, _build.SM90_WARPS, "float16", sm90=True)


@pytest.mark.parametrize("d", _build.HEAD_DIMS)
@pytest.mark.parametrize("bs", _build.PREFILL_BLOCK_SIZES)
def test_the_producers_shuffled_page_ids_are_each_rows_own(d, bs):
    """paged_prefill_sm90.cu's producer: lane l of a warp holds table entries l, l + 32, ... of
    a tile (PAGES_PER_LANE registers); the thread copying row `row` (rows i * PROD_RPI + row0)
    takes register (i * PROD_RPI) / (32 * BLOCK_SIZE), a compile-time index, from lane
    (row / BLOCK_SIZE) % 32. The same arithmetic here, for every thread, row and block size:
    the entry it gets is the page that holds the row's token (tiles start at multiples of BN)."""
    bn = _build.SM90_BN[d]
    rpi = 128 // (d // 8)  # PROD_RPI: 128 producer threads, d / 8 16-byte chunks per row
    tile_pages = 1 if bs >= bn else bn // bs
    per_lane = -(-tile_pages // 32)
    assert (32 * bs) % rpi == 0 and rpi <= 32  # the kernel's static_assert
    for t0 in (0, bn, 7 * bn):
        for tid in range(128):
            row0 = tid // (d // 8)
            for i in range(bn // rpi):
                row = i * rpi + row0
                p = 0 if bs >= bn else row // bs
                reg = (i * rpi) // (32 * bs)
                assert reg < per_lane and reg == p // 32
                entry = 32 * reg + p % 32
                assert entry < tile_pages
                assert t0 // bs + entry == (t0 + row) // bs
