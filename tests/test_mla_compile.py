"""Every MLA decode module (paged_mla_decode.cu: both dtypes, every head tile the plan may
choose; with the rope part and without it, ROPE=0, for the head_dim 512 K = V plans; over an
e4m3 latent cache, KV_FP8=1, with float16 and bfloat16 queries) compiles with NVRTC for sm_80 and sm_90 without spills (CI, no GPU; the helpers of
test_kernels_compile.py)."""

from __future__ import annotations

import re

import pytest
from kvpool.kernels import _build

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")

from test_kernels_compile import ARCHS, MAX_SPILL_BYTES, compile_cubin


def test_every_plan_choice_has_a_module():
    from kvpool.kernels._mla import MLA_HEAD_TILES, mla_variant

    got = {
        mla_variant(dt, t, rope)
        for dt in _build.MLA_DTYPES
        for t in MLA_HEAD_TILES
        for rope in (_build.MLA_ROPE_DIM, 0)  # MLA, and the shared K = V head of 512
    } | {  # an e4m3 latent cache read with float16 / bfloat16 queries
        mla_variant(dt, t, kv_fp8=True) for dt in _build.MLA_DTYPES for t in MLA_HEAD_TILES
    }
    assert got == set(_build.mla_variants())
    for v in got:
        assert v.dynamic_smem_bytes <= _build.SMEM_PER_SM


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("item", _build.mla_sources(), ids=lambda item: item[0])
def test_mla_module_compiles(item, arch):
    label, src, opts = item
    log = compile_cubin(src, opts, arch)
    for spill in re.findall(r"(\d+) bytes spill stores", log):
        assert int(spill) <= MAX_SPILL_BYTES, f"{label} on {arch} spills {spill} bytes:\n{log}"
