"""Argument plumbing for the CUDA wrappers: device arrays, element types, index arguments
(streams and launches are in _launch.py).

Inputs are taken without copies: torch tensors through their data pointer, strides and true
dtype (bfloat16 and float8 included), CuPy arrays and anything else with
``__cuda_array_interface__`` (Numba, kvpool's own views) through that; only the pointer, shape,
strides and element type are read. CuPy has no bfloat16, so there a bfloat16 buffer travels as
a 2-byte integer array, accepted as a fallback.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvpool.exceptions import InvalidArgumentError


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


class ArrayView(NamedTuple):
    """A device array as its __cuda_array_interface__ describes it, read without copies."""

    ptr: int
    shape: tuple[int, ...]
    byte_strides: tuple[int, ...]
    typestr: str  # NumPy array-interface type string, e.g. "<f2"; bfloat16 reads "<V2" or "<u2"
    stream: int | None  # the producer stream the interface names (None: no wait needed)

    @property
    def is_float(self) -> bool:
        """The element type is a float (float16 data; bfloat16 travels as a 2-byte non-float)."""
        return self.typestr[1] == "f"

    @property
    def layout_key(self) -> tuple:
        """What a prepared launch depends on (all but the pointer and the producer stream)."""
        return self.shape, self.byte_strides, self.typestr


# Array readers: an ArrayView's fields without building
# __cuda_array_interface__ dicts for the common types (CuPy and torch); anything else goes through
# the interface. The stream is the interface's "stream" entry (None for CuPy and torch, whose
# entry only names the consumer's current stream): work on another stream must wait on it.
_TORCH_TYPESTR: dict[Any, str] = {}


def _read_cupy(a: Any) -> ArrayView:
    return ArrayView(a.data.ptr, a.shape, a.strides, a.dtype.str, None)


def _read_torch(t: Any) -> ArrayView:
    if not t.is_cuda:
        raise InvalidArgumentError("must be a device array (__cuda_array_interface__)")
    ts = _TORCH_TYPESTR.get(t.dtype)
    if ts is None:
        import torch

        names = {
            torch.float16: "<f2",
            torch.bfloat16: "<V2",
            torch.float32: "<f4",
            torch.int16: "<i2",
            torch.int32: "<i4",
            torch.int64: "<i8",
            torch.uint8: "|u1",
        }
        ts = _TORCH_TYPESTR[t.dtype] = names.get(t.dtype, f"<V{t.element_size()}")
    size = t.element_size()
    return ArrayView(t.data_ptr(), tuple(t.shape), tuple(s * size for s in t.stride()), ts, None)


def _read_cai(obj: Any) -> ArrayView:
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        raise InvalidArgumentError("must be a device array (__cuda_array_interface__)")
    shape = tuple(int(s) for s in cai["shape"])
    typestr = cai["typestr"]
    strides = cai.get("strides")
    if strides is None:  # C-contiguous
        acc, rev = int(typestr[2:]), []
        for s in reversed(shape):
            rev.append(acc)
            acc *= s
        strides = tuple(reversed(rev))
    return ArrayView(int(cai["data"][0]), shape, tuple(strides), typestr, cai.get("stream"))


_READERS: dict[type, Any] = {}


def view(obj: Any, name: str) -> ArrayView:
    """The ArrayView of a device array; `name` in errors."""
    reader = _READERS.get(type(obj))
    if reader is None:
        mod = type(obj).__module__
        if mod.startswith("cupy") and hasattr(obj, "data") and hasattr(obj, "strides"):
            reader = _read_cupy
        elif mod.startswith("torch") and hasattr(obj, "data_ptr"):
            reader = _read_torch
        else:
            reader = _read_cai
        _READERS[type(obj)] = reader
    try:
        return reader(obj)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{name} {e}") from None


def dev(v: ArrayView, name: str) -> DevArray:
    """A DevArray (strides in elements) of an ArrayView."""
    ptr, shape, strides_b, typestr = v.ptr, v.shape, v.byte_strides, v.typestr
    itemsize = int(typestr[2:])
    if any(s % itemsize for s in strides_b):
        raise InvalidArgumentError(f"{name}: strides must be multiples of the item size")
    strides = tuple(s // itemsize for s in strides_b)
    if 0 in shape:
        # An empty array's strides mean nothing (CuPy reports zeros): use C order, so the
        # layout checks that follow judge only arrays that have elements.
        strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DevArray(ptr, tuple(shape), strides, typestr, itemsize)


_PTR_DEVICE: dict[int, int] = {}


def ptr_device(ptr: int) -> int:
    """Device of a device (or managed) pointer, -1 otherwise; cached per pointer value."""
    d = _PTR_DEVICE.get(ptr)
    if d is None:
        import cupy

        attrs = cupy.cuda.runtime.pointerGetAttributes(ptr)
        d = attrs.device if attrs.type in (2, 3) else -1
        if len(_PTR_DEVICE) > 4096:
            _PTR_DEVICE.clear()
        _PTR_DEVICE[ptr] = d
    return d


def check_ptr(ptr: int, name: str, device_id: int) -> None:
    if ptr_device(ptr) != device_id:
        raise InvalidArgumentError(f"{name} is not in memory of the pool's device cuda:{device_id}")


def elem_ok(kind: str, itemsize: int, dtype: str, elem_bytes: int) -> bool:
    """An element type (kind, itemsize) holds the pool's `dtype`: float16 -> a 2-byte float;
    bfloat16 -> any 2-byte type other than a float (CuPy and NumPy have no bfloat16, so such
    buffers travel as uint16/int16/void); other dtypes -> the same element size."""
    if elem_bytes == 2:
        return itemsize == 2 and (kind == "f" if dtype == "float16" else kind in "uiV")
    return itemsize == elem_bytes


def check_elem16(arr: DevArray, name: str, dtype: str) -> None:
    """arr holds the pool's 16-bit element type (see elem_ok)."""
    if not elem_ok(arr.kind, arr.itemsize, dtype, 2):
        raise InvalidArgumentError(
            f"{name} has element type {arr.typestr!r}; the pool's dtype is {dtype}"
        )


def index_arg(value: Any, name: str) -> int:
    """An integer argument (int, NumPy integer, ...); bools, floats and other types are a
    TypeError, as in the binding (``True`` would otherwise pass as 1)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def check_int_array(arr: DevArray, name: str, itemsize: int, ndim: int) -> None:
    if arr.kind != "i" or arr.itemsize != itemsize or len(arr.shape) != ndim:
        raise InvalidArgumentError(
            f"{name} must be an int{8 * itemsize} array of {ndim} dimension(s), "
            f"got {arr.typestr} with shape {arr.shape}"
        )
    if arr.strides[-1] != 1:
        raise InvalidArgumentError(f"{name}: the last dimension must be contiguous")


def device_index(pool: Any) -> int:
    """The CUDA device ordinal of a pool ("cuda:N"; plain "cuda" is 0)."""
    d = str(pool.device)
    return int(d.split(":")[1]) if ":" in d else 0


def pool_is_cuda(pool: Any) -> bool:
    return str(pool.device).startswith("cuda")
