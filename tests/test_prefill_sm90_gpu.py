"""The Hopper prefill kernel (cuda/paged_prefill_sm90.cu) through the whole prefill GPU suite
(marker `gpu`): every test of tests/test_prefill_gpu.py runs again here with _tuning's
prefill_kernel forced to "sm90" (float64 reference per sequence and head, mutation cases,
ragged batches, prefix-cached continuation, qo_len 1, splits, graph capture). Tests that force
prefill_rows_per_cta there run the Ampere kernel's tiles, so narrow-against-wide compares the
two kernels. Skipped on devices other than compute capability 9.0.
"""

from __future__ import annotations

import numpy as np
import pytest
import test_prefill_gpu
from attention_inputs import qo_indptr, shuffled_tables
from gpu_fixtures import cp, cuda_pool
from kvpool.kernels import _build, _tuning, prefill_plan

pytestmark = pytest.mark.gpu

# Every test of the Ampere suite, collected again in this module (so the fixture below wraps it).
for _name in dir(test_prefill_gpu):
    if _name.startswith("test_"):
        globals()[_name] = getattr(test_prefill_gpu, _name)


@pytest.fixture(autouse=True)
def _force_sm90():
    if int(cp.cuda.Device().compute_capability) != 90:
        pytest.skip("the sm90 prefill kernel needs compute capability 9.0")
    with _tuning.override(prefill_kernel="sm90"):
        yield


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_forced_plan_runs_the_sm90_kernel_and_sm80_the_ampere_one(dtype):
    rng = np.random.default_rng(3)
    pool = cuda_pool(rng, 2, 128, 16, dtype, 64, 1)
    lens = np.array([300, 1], np.int32)
    qo = np.array([200, 1])
    tables = shuffled_tables(rng, lens, 16, 64)
    plan = prefill_plan(pool, qo_indptr(qo), cp.asarray(tables), lens, 8)
    assert plan.variant.sm90 and plan.rows_per_cta == _build.SM90_ROWS
    assert plan.work.kv_tile == _build.SM90_BN[128]
    with _tuning.override(prefill_kernel="sm80"):
        plan = prefill_plan(pool, qo_indptr(qo), cp.asarray(tables), lens, 8)
    assert not plan.variant.sm90 and plan.rows_per_cta in (64, 16)
