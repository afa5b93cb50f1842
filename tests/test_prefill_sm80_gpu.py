"""The Ampere prefill kernel (cuda/paged_prefill.cu) through the whole prefill GPU suite
(marker `gpu`), with _tuning's prefill_kernel forced to "sm80": on compute capability 9.0 the
default runs the Hopper kernel for wide tiles (tests/test_prefill_gpu.py then covers that
default), so this keeps the Ampere kernel's wide tiles tested there too.
"""

from __future__ import annotations

import pytest
import test_prefill_gpu
from kvpool.kernels import _tuning

pytestmark = pytest.mark.gpu

for _name in dir(test_prefill_gpu):
    if _name.startswith("test_"):
        globals()[_name] = getattr(test_prefill_gpu, _name)


@pytest.fixture(autouse=True)
def _force_sm80():
    with _tuning.override(prefill_kernel="sm80"):
        yield
