"""What the GPU test modules share. Skipping is conftest.py's job alone: tests marked `gpu`
are skipped there when CuPy or a CUDA device is missing, so these helpers may assume both.

- `cp`: CuPy, imported on first use, for module-level use in GPU test files (a file then
  imports without CuPy, and its marked tests are skipped). The `cp` fixture in conftest.py
  gives the same module to tests that take it as an argument.
- `device_free_bytes`: the driver's free device memory after CuPy's pool gave back its cache.
- Attention kernel inputs and outputs: `to_device` and `device_elems` (elements of a KV
  dtype on the device; random ones come from attention_inputs.py), `cuda_pool` (a CUDA pool
  filled with random elements), `poisoned` (an output full of NaN, so an unwritten element
  shows), `error_report` (a module fixture that writes the measured errors to the file
  $KVPOOL_ERROR_REPORT names).
- `SPIN_SOURCE`: CUDA C of a kernel `spin(ns)` that keeps its stream busy for `ns` nanoseconds
  (to show that work queued behind it waits).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import kvpool
import numpy as np
import pytest
from attention_inputs import random_elems


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


NAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0}  # a quiet NaN of each 16-bit output dtype


def to_device(host: np.ndarray, dtype: str) -> Any:
    """Elements of `dtype` (bfloat16 as uint16 bits) copied to the device."""
    return cp.asarray(host.view(np.uint16) if dtype == "bfloat16" else host)


def device_elems(rng: np.random.Generator, shape: Sequence[int], dtype: str) -> Any:
    """Random N(0, 1) elements of `dtype` on the device (bfloat16 as uint16 bits)."""
    return to_device(random_elems(rng, shape, dtype), dtype)


def cuda_pool(
    rng: np.random.Generator,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: str,
    num_blocks: int,
    num_layers: int,
) -> Any:
    """A CUDA pool whose every K and V element is random (`device_elems`)."""
    layout = kvpool.KvLayout(num_layers, num_kv_heads, head_dim, block_size, dtype)
    pool = kvpool.Pool(layout, num_blocks, device="cuda")
    for layer in range(num_layers):
        for view in (pool.k_view(layer), pool.v_view(layer)):
            arr = cp.asarray(view)
            arr[...] = device_elems(rng, arr.shape, dtype).view(arr.dtype)
    return pool


def poisoned(shape: Sequence[int], dtype: str) -> Any:
    """A 16-bit output array (bfloat16 as uint16) full of NaN."""
    out = cp.empty(shape, dtype=cp.float16 if dtype == "float16" else cp.uint16)
    out.view(cp.uint16)[...] = NAN_BITS[dtype]
    return out


def error_report(errors: dict[str, float], env: str = "KVPOOL_ERROR_REPORT") -> Any:
    """An autouse module fixture: after the module's tests, the largest row error of each case
    in `errors` goes to the file $env names (JSON), if it is set. Assign it to a module name."""

    @pytest.fixture(scope="module", autouse=True)
    def _write_error_report() -> Any:
        yield
        path = os.environ.get(env)
        if path:
            with open(path, "w") as f:
                json.dump(
                    {"max_rel_err": max(errors.values(), default=None), "cases": errors},
                    f,
                    indent=1,
                )

    return _write_error_report


SPIN_SOURCE = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""
