"""Torch tensors in and out of the kernels, without importing torch where it is not installed.

A torch tensor is recognised by its type's module (``torch``), so the core imports and runs
without torch. On a CUDA pool tensors are read in place through their data pointer and strides
(:mod:`kvpool.kernels._args`) and a call without `out` returns a torch tensor of q's dtype
(bfloat16 included); a call without `stream` whose inputs include a torch tensor runs on
torch's current stream of the pool's device (``with torch.cuda.stream(s):`` is obeyed), one
without torch inputs on CuPy's. On a host pool a CPU tensor is seen as a NumPy array of its
bits (bfloat16 as uint16, which NumPy has no type for) and a result comes back as a tensor of
the query's dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.exceptions import InvalidArgumentError


def is_torch(x: Any) -> bool:
    """Whether `x` is a torch tensor (checked without importing torch)."""
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def torch_stream(device_id: int, *arrays: Any) -> Any:
    """torch's current stream on cuda:`device_id` when any of `arrays` is a torch tensor (the
    stream a torch caller's work is ordered on), else None."""
    if not any(is_torch(a) for a in arrays):
        return None
    import torch

    return torch.cuda.current_stream(device_id)


def host_numpy(t: Any, name: str) -> np.ndarray:
    """A NumPy view of a CPU tensor: its own dtype, or the raw 2-byte bits of a bfloat16 (and
    1-byte bits of a float8) tensor."""
    if t.device.type != "cpu":
        raise InvalidArgumentError(f"{name} is a {t.device} tensor but the pool is on the host")
    t = t.detach()
    if str(t.dtype) == "torch.bfloat16":
        import torch

        return t.view(torch.int16).numpy().view(np.uint16)
    if t.element_size() == 1 and t.is_floating_point():  # float8: its codes
        import torch

        return t.view(torch.uint8).numpy()
    return t.numpy()


def like_torch(arr: np.ndarray, like: Any) -> Any:
    """A NumPy result as a CPU tensor of `like`'s dtype (the bits reinterpreted, not converted)."""
    import torch

    res = torch.from_numpy(np.ascontiguousarray(arr))
    if res.dtype != like.dtype:
        res = res.view(like.dtype)
    return res


def empty_like(t: Any) -> Any:
    """An uninitialised tensor of t's shape, dtype and device (the result of a call with torch
    inputs and no `out`)."""
    import torch

    return torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)
