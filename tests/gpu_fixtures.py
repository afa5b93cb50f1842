"""What the GPU test modules share. Skipping is conftest.py's job alone: tests marked `gpu`
are skipped there when CuPy or a CUDA device is missing, so these helpers may assume both.

- `cp`: CuPy, imported on first use, for module-level use in GPU test files (a file then
  imports without CuPy, and its marked tests are skipped). The `cp` fixture in conftest.py
  gives the same module to tests that take it as an argument.
- `device_free_bytes`: the driver's free device memory after CuPy's pool gave back its cache.
"""

from __future__ import annotations

from typing import Any


class _LazyCupy:
    def __getattr__(self, name: str) -> Any:
        import cupy

        return getattr(cupy, name)


cp: Any = _LazyCupy()


def device_free_bytes(cupy: Any = cp) -> int:
    cupy.cuda.runtime.deviceSynchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    free, _total = cupy.cuda.runtime.memGetInfo()
    return int(free)
