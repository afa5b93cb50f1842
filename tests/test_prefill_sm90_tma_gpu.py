"""The Hopper prefill kernel with TMA K/V loads (cuda/paged_prefill_sm90.cu, KV_TMA=1) through
the whole prefill GPU suite (marker `gpu`): every test of tests/test_prefill_gpu.py runs again
with _tuning's prefill_kernel forced to "sm90" and prefill_tma on (pages under
_build.SM90_TMA_MIN_BLOCK tokens keep the cp.async module), plus the cases only TMA has: keys
past a sequence's end that hold NaN in its last page (the tile holding kv_end goes the
cp.async way, which zero-fills them), and table entries outside the pool (outside the map:
zeros). Skipped on devices other than compute capability 9.0.
"""

from __future__ import annotations

import numpy as np
import pytest
import test_prefill_gpu
from attention_inputs import qo_indptr, shuffled_tables
from gpu_fixtures import NAN_BITS, cp, cuda_pool
from kvpool.kernels import _build, _tuning, prefill_plan

pytestmark = pytest.mark.gpu

for _name in dir(test_prefill_gpu):
    if _name.startswith("test_"):
        globals()[_name] = getattr(test_prefill_gpu, _name)


@pytest.fixture(autouse=True)
def _force_sm90_tma():
    if int(cp.cuda.Device().compute_capability) != 90:
        pytest.skip("the sm90 prefill kernel needs compute capability 9.0")
    with _tuning.override(prefill_kernel="sm90", prefill_tma=True):
        yield


@pytest.mark.parametrize("bs", [1, 4, 8, 16, 256])
def test_the_plan_takes_tma_from_the_smallest_tma_page_up(bs):
    rng = np.random.default_rng(5)
    pool = cuda_pool(rng, 2, 128, bs, "float16", 64 * 256 // bs, 1)
    lens = np.array([300, 1], np.int32)
    tables = shuffled_tables(rng, lens, bs, 64 * 256 // bs)
    plan = prefill_plan(pool, qo_indptr([200, 1]), cp.asarray(tables), lens, 8)
    assert plan.variant.sm90 and plan.variant.tma == (bs >= _build.SM90_TMA_MIN_BLOCK)
    assert ("-DKV_TMA=1" in plan.variant.options()) == plan.variant.tma


def _not_finite(bits: np.ndarray, dtype: str) -> np.ndarray:
    exp = 0x7C00 if dtype == "float16" else 0x7F80
    return (bits & exp) == exp


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_nan_past_the_end_and_ids_outside_the_pool_read_as_the_cp_async_module_reads(dtype, d):
    """Every key slot past each sequence's length holds NaN (in its last page and in blocks no
    table names): the TMA module gives exactly the cp.async module's bits (same tiles, same
    order of operations), with nothing non-finite. Then table entries outside the pool inside
    the keys (an id past num_blocks, and -1: both read as zeros by either module) the same."""
    rng = np.random.default_rng(d)
    bs, hkv, hq = 16, 2, 8
    num_blocks = 96
    pool = cuda_pool(rng, hkv, d, bs, dtype, num_blocks, 2)
    lens = np.array([300, 77, 129, 1000], np.int32)
    qo = np.array([300, 13, 128, 200])
    tables = shuffled_tables(rng, lens, bs, num_blocks)
    used = set()
    for i, n in enumerate(lens):
        used.update(int(b) for b in tables[i, : -(-int(n) // bs)])
    for layer in range(2):
        for view in (pool.k_view(layer), pool.v_view(layer)):
            a = cp.asarray(view).view(cp.uint16)  # [block, token, head, dim]
            for b in range(num_blocks):
                if b not in used:
                    a[b] = NAN_BITS[dtype]
            for i, n in enumerate(lens):
                last = int(tables[i, (int(n) - 1) // bs])
                a[last, int(n) % bs or bs :] = NAN_BITS[dtype]
    q = cp.asarray(rng.standard_normal((int(qo.sum()), hq, d)).astype(np.float16))
    if dtype == "bfloat16":
        q = q.view(cp.uint16) & 0xFF80  # bf16 bit patterns of small values
    ind = qo_indptr(qo)
    bad = tables.copy()
    bad[3, 5], bad[3, 40] = num_blocks + 5, -1  # inside sequence 3's 1000 keys
    for label, tab in (("tables", tables), ("ids outside the pool", bad)):
        for causal in (True, False):
            outs = {}
            for tma in (False, True):
                with _tuning.override(prefill_tma=tma):
                    plan = prefill_plan(pool, ind, cp.asarray(tab), lens, hq, causal=causal)
                assert plan.variant.tma == tma
                outs[tma] = cp.asnumpy(plan.run(q, 1)).view(np.uint16)
            assert not _not_finite(outs[True], dtype).any(), f"{label} causal={causal}"
            assert (outs[True] == outs[False]).all(), f"{label} causal={causal}"
