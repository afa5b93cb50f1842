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
