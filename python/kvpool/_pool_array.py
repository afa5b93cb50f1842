"""`PoolArray`: the NumPy view of a host pool's K or V that knows the pool's element type.

NumPy has no bfloat16 or float8, so a host pool of those dtypes is seen as 2- or 1-byte
unsigned integers (its bits). `PoolArray` is that array with one more thing: `kv_dtype`, the
pool's dtype, which its DLPack export carries (``torch.from_dlpack(pool.k_view(0))`` is a
bfloat16 tensor of the pool's memory, not a uint16 one). Slices, reshapes and copies keep
`kv_dtype` (the bits are unchanged); anything that computes on the bits (a ufunc, `astype`
to another type, a view as another type) gives a plain array, whose export says what it holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool._core import SlabView, dlpack_as

_ITEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}


class PoolArray(np.ndarray):
    """A NumPy array of a host pool's K or V bits, with the pool's dtype (`kv_dtype`) in its
    DLPack export (`__dlpack__`)."""

    kv_dtype: str | None

    @property
    def slab_view(self) -> SlabView | None:
        """The pool's SlabView this array's memory belongs to (it holds the pool alive), or
        None for a copy."""
        base = self.base
        while isinstance(base, np.ndarray):
            base = base.base
        return base if isinstance(base, SlabView) else None

    def __array_finalize__(self, obj: Any) -> None:
        # A slice, reshape or copy holds the same bits: it keeps the dtype; a view as another
        # item type does not hold the pool's elements any more.
        source = getattr(obj, "kv_dtype", None)
        same_items = isinstance(obj, np.ndarray) and obj.dtype == self.dtype
        self.kv_dtype = source if same_items else None

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        # Arithmetic on raw bfloat16 / float8 bits is arithmetic on integers: its result is
        # a plain array, never labelled with the pool's dtype.
        plain = tuple(x.view(np.ndarray) if isinstance(x, PoolArray) else x for x in inputs)
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(
                x.view(np.ndarray) if isinstance(x, PoolArray) else x for x in out
            )
        return getattr(ufunc, method)(*plain, **kwargs)

    def astype(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.view(np.ndarray).astype(*args, **kwargs)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        if self.kv_dtype is None or self.dtype.itemsize != _ITEM_BYTES[self.kv_dtype]:
            plain = self.view(np.ndarray)
            return plain.__dlpack__(
                stream=stream, max_version=max_version, dl_device=dl_device, copy=copy
            )
        if stream is not None:
            raise BufferError("a host array takes no stream")
        return dlpack_as(
            self, self.kv_dtype, max_version=max_version, dl_device=dl_device, copy=copy
        )

    def __dlpack_device__(self) -> tuple[int, int]:  # type: ignore[override]
        return (1, 0)

    def __reduce__(self) -> Any:
        # A pickled view is a copy of the bits: a plain array (the pool is not pickled).
        return self.view(np.ndarray).__reduce__()


def pool_array(view: Any, dtype: str) -> PoolArray:
    """The PoolArray over a host SlabView (Pool.k_view / v_view): its base is the view, which
    holds the pool alive."""
    arr = np.asarray(view).view(PoolArray)
    arr.kv_dtype = dtype
    return arr
