"""Argument plumbing for the CUDA wrappers: device arrays, streams, dtype names.

Inputs are taken through ``__cuda_array_interface__`` (CuPy, PyTorch, Numba, kvpool's own
views) without copies; only the pointer, shape, strides and element type are read, so bfloat16
buffers (which CuPy has no dtype for) pass as any 2-byte type.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from kvpool._core import InvalidArgumentError


@dataclass(frozen=True)
class DevArray:
    """A device buffer seen through __cuda_array_interface__ (strides in elements)."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    typestr: str
    itemsize: int

    @property
    def kind(self) -> str:
        return self.typestr[1]


def dev_array(obj: Any, name: str) -> DevArray:
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        raise InvalidArgumentError(f"{name} must be a device array (__cuda_array_interface__)")
    shape = tuple(int(s) for s in cai["shape"])
    typestr = cai["typestr"]
    itemsize = int(typestr[2:])
    strides_b = cai.get("strides")
    if strides_b is None:  # C-contiguous
        acc, rev = itemsize, []
        for s in reversed(shape):
            rev.append(acc)
            acc *= s
        strides_b = tuple(reversed(rev))
    if any(s % itemsize for s in strides_b):
        raise InvalidArgumentError(f"{name}: strides must be multiples of the item size")
    ptr = int(cai["data"][0])
    return DevArray(ptr, shape, tuple(s // itemsize for s in strides_b), typestr, itemsize)


def check_elem16(arr: DevArray, name: str, dtype: str) -> None:
    """arr holds the pool's 16-bit element type: float16 -> '<f2'; bfloat16 -> any 2-byte type
    other than float16 (CuPy has no bfloat16, so such buffers travel as uint16/int16/void)."""
    ok = arr.itemsize == 2 and (
        arr.kind == "f" if dtype == "float16" else arr.kind in "uiV"
    )
    if not ok:
        raise InvalidArgumentError(
            f"{name} has element type {arr.typestr!r}; the pool's dtype is {dtype}"
        )


def check_int_array(arr: DevArray, name: str, itemsize: int, ndim: int) -> None:
    if arr.kind != "i" or arr.itemsize != itemsize or len(arr.shape) != ndim:
        raise InvalidArgumentError(
            f"{name} must be an int{8 * itemsize} array of {ndim} dimension(s), "
            f"got {arr.typestr} with shape {arr.shape}"
        )
    if arr.strides[-1] != 1:
        raise InvalidArgumentError(f"{name}: the last dimension must be contiguous")


def cupy_stream(stream: Any) -> Any:
    """A CuPy stream for `stream`: None -> CuPy's current stream; a CuPy stream as is; anything
    with __cuda_stream__ (or a torch stream's `cuda_stream`) wrapped without taking ownership."""
    import cupy

    if stream is None:
        return cupy.cuda.get_current_stream()
    if type(stream).__module__.startswith("cupy") and hasattr(stream, "ptr"):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        handle = (proto() if callable(proto) else proto)[1]
    elif hasattr(stream, "cuda_stream"):
        handle = stream.cuda_stream
    else:
        raise InvalidArgumentError("stream must be a CuPy stream or have __cuda_stream__")
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            return from_external(stream)
        except Exception:  # older signature: fall back to the raw handle below
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(int(handle))


def pool_is_cuda(pool: Any) -> bool:
    return str(pool.device).startswith("cuda")
