"""KvScales: the dequantization scales of an fp8 pool.

An fp8 cache stores ``fp8(x / scale)`` and reads back ``fp8 * scale``. One KvScales holds, for
every layer, a K and a V scale: per tensor (``granularity="tensor"``, vLLM's ``k_scale`` /
``v_scale``: float32 ``[num_layers]``) or per KV head (``"head"``: ``[num_layers,
num_kv_heads]``). The arrays live where the pool lives (CuPy arrays on the pool's device, NumPy
for a host pool); the kernels read them at launch time, so a CUDA graph sees later changes.

Scales are set once per layer and then frozen, since a scale applies to every token already
written with it:

- ``set(layer, k_scale, v_scale)``: from calibration (finite, > 0, a scalar or one per KV head).
  An explicit set always takes effect (the caller's responsibility: before writing the layer).
- ``calibrate_from(layer, k, v, slot_mapping)``: amax / fp8_max over the tokens whose slot is
  real (>= 0), never over padding or dummy (warm-up, graph-capture) rows, whose slot is -1;
  a no-op (returns False) when the layer is already set, when no token is real, or when the
  real tokens are all zero (a scale derived from zeros would be meaningless). It reads the amax
  back to the host once per layer (a device sync), then the layer is frozen.
- ``auto_calibrate=True``: ``append_kv(..., scales=s)`` calls ``calibrate_from`` before the
  first write of each layer that is still unset. Unset layers have scale 1.0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool import reference
from kvpool.exceptions import InvalidArgumentError
from kvpool.kernels._args import dev, device_index, index_arg, pool_is_cuda, view

GRANULARITIES = ("tensor", "head")


class KvScales:
    """Per-layer K and V dequantization scales of an fp8 pool (see the module docstring)."""

    def __init__(
        self, pool: Any, granularity: str = "tensor", *, auto_calibrate: bool = False
    ) -> None:
        layout = pool.layout
        if layout.dtype not in reference.FP8:
            raise InvalidArgumentError(
                f"KvScales needs an fp8 pool (float8_e4m3fn or float8_e5m2), got {layout.dtype}"
            )
        if granularity not in GRANULARITIES:
            raise InvalidArgumentError(
                f"granularity must be one of {GRANULARITIES}, got {granularity!r}"
            )
        self.pool = pool
        self.dtype = layout.dtype
        self.granularity = granularity
        self.auto_calibrate = bool(auto_calibrate)
        self.num_layers, self.num_kv_heads = layout.num_layers, layout.num_kv_heads
        shape = (
            (self.num_layers,) if granularity == "tensor" else (self.num_layers, self.num_kv_heads)
        )
        self.cuda = pool_is_cuda(pool)
        if self.cuda:
            import cupy

            with cupy.cuda.Device(device_index(pool)):
                self.k_scale = cupy.ones(shape, cupy.float32)
                self.v_scale = cupy.ones(shape, cupy.float32)
        else:
            self.k_scale = np.ones(shape, np.float32)
            self.v_scale = np.ones(shape, np.float32)
        self._frozen = np.zeros(self.num_layers, dtype=bool)

    @property
    def head_stride(self) -> int:
        """Elements between two KV heads' scales of one layer (0: one scale per tensor)."""
        return 0 if self.granularity == "tensor" else 1

    def is_set(self, layer: int) -> bool:
        """Whether the layer's scales were set or calibrated (and are frozen)."""
        return bool(self._frozen[self._layer(layer)])

    def layer_scales(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Host float32 copies of the layer's K and V scales, one per KV head."""
        layer = self._layer(layer)
        out = []
        for arr in (self.k_scale, self.v_scale):
            row = arr[layer]
            row = row.get() if self.cuda else np.asarray(row)
            out.append(
                np.broadcast_to(
                    np.asarray(row, np.float32).reshape(-1), (self.num_kv_heads,)
                ).copy()
            )
        return out[0], out[1]

    def ptrs(self, layer: int) -> tuple[int, int]:
        """Device addresses of the layer's first K and V scale (a CUDA pool)."""
        per_layer = 4 * (1 if self.granularity == "tensor" else self.num_kv_heads)
        off = self._layer(layer) * per_layer
        return self.k_scale.data.ptr + off, self.v_scale.data.ptr + off

    def set(self, layer: int, k_scale: Any, v_scale: Any) -> None:
        """Set the layer's scales (a scalar, or [num_kv_heads] for per-head scales); each must be
        finite and > 0. Checked before anything changes."""
        layer = self._layer(layer)
        ks, vs = self._checked(k_scale, "k_scale"), self._checked(v_scale, "v_scale")
        for arr, val in ((self.k_scale, ks), (self.v_scale, vs)):
            if self.cuda:
                import cupy

                val = cupy.asarray(val)
            arr[layer] = val if self.granularity == "head" else val[0]
        self._frozen[layer] = True

    def calibrate_from(self, layer: int, k: Any, v: Any, slot_mapping: Any) -> bool:
        """Derive the layer's scales from the real tokens of a write (see the module docstring);
        True when the scales were set by this call."""
        layer = self._layer(layer)
        if self._frozen[layer]:
            return False
        k_amax = self._amax(k, slot_mapping, "k")
        v_amax = self._amax(v, slot_mapping, "v")
        if k_amax is None or v_amax is None:
            return False
        if self.granularity == "tensor":
            k_amax, v_amax = np.asarray(k_amax.max()), np.asarray(v_amax.max())
        if not (np.isfinite(k_amax).all() and np.isfinite(v_amax).all()):
            raise InvalidArgumentError("calibrate_from: k or v holds a non-finite value")
        if not (k_amax > 0).all() or not (v_amax > 0).all():
            return False
        fp8_max = reference.FP8[self.dtype].max_value
        self.set(layer, k_amax / fp8_max, v_amax / fp8_max)
        return True

    def _layer(self, layer: Any) -> int:
        layer = index_arg(layer, "layer")
        if not 0 <= layer < self.num_layers:
            raise InvalidArgumentError(f"layer {layer} outside 0..{self.num_layers - 1}")
        return layer

    def _checked(self, value: Any, name: str) -> np.ndarray:
        if isinstance(value, (bool, np.bool_)):
            raise InvalidArgumentError(f"{name} must be a float or an array of floats")
        try:
            arr = np.asarray(value.get() if hasattr(value, "get") else value, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"{name} must be a float or an array of floats, got {type(value).__name__}"
            ) from None
        want = () if self.granularity == "tensor" else (self.num_kv_heads,)
        if arr.shape not in ((), want):
            raise InvalidArgumentError(
                f"{name} must be a scalar{' or [' + str(want[0]) + ']' if want else ''} "
                f"for {self.granularity} scales, got shape {arr.shape}"
            )
        if not (np.isfinite(arr).all() and (arr > 0).all()):
            raise InvalidArgumentError(f"{name} must be finite and > 0, got {arr.tolist()}")
        arr32 = arr.astype(np.float32)
        if not (arr32 > 0).all() or not np.isfinite(arr32).all():
            raise InvalidArgumentError(f"{name} {arr.tolist()} is not a positive float32")
        return np.broadcast_to(arr32.reshape(-1), (want[0] if want else 1,)).copy()

    def _amax(self, x: Any, slot_mapping: Any, name: str) -> np.ndarray | None:
        """Per KV head max |x| over the rows whose slot is >= 0 (None: no such row)."""
        x32, slots = _rows_as_float32(x, self.dtype, name), _as_host_int64(slot_mapping)
        if x32.ndim != 3 or x32.shape[1] != self.num_kv_heads or x32.shape[0] != len(slots):
            raise InvalidArgumentError(
                f"{name} must be [{len(slots)}, {self.num_kv_heads}, "
                f"head_dim], got {tuple(x32.shape)}"
            )
        real = np.flatnonzero(slots >= 0)
        if len(real) == 0:
            return None
        if hasattr(x32, "get"):
            import cupy

            amax = cupy.abs(x32[cupy.asarray(real)]).max(axis=(0, 2)).get()
        else:
            amax = np.abs(x32[real]).max(axis=(0, 2))
        return np.asarray(amax, dtype=np.float64)


def _as_host_int64(slot_mapping: Any) -> np.ndarray:
    if hasattr(slot_mapping, "__cuda_array_interface__"):
        import cupy

        slot_mapping = cupy.asarray(slot_mapping).get()
    slots = np.asarray(slot_mapping)
    if slots.ndim != 1 or slots.dtype.kind not in "iu":
        raise InvalidArgumentError("slot_mapping must be a 1-d integer array")
    return slots.astype(np.int64)


def _rows_as_float32(x: Any, cache_dtype: str, name: str) -> Any:
    """K or V rows (float16, or bfloat16: torch bfloat16 or 2-byte integers) as float32, on the
    host (NumPy) or the device (CuPy) where they are."""
    if hasattr(x, "__cuda_array_interface__") or type(x).__module__.startswith("torch"):
        import cupy

        v = view(x, name)
        a = dev(v, name)
        if a.itemsize != 2:
            raise InvalidArgumentError(
                f"{name} must hold float16 or bfloat16 values to write "
                f"into a {cache_dtype} pool, got {a.typestr!r}"
            )
        nbytes = (
            sum((n - 1) * st for n, st in zip(a.shape, v.byte_strides, strict=True)) + 2
            if 0 not in a.shape
            else 0
        )
        mem = cupy.cuda.UnownedMemory(a.ptr, nbytes, x)
        raw = cupy.ndarray(
            a.shape, cupy.uint16, cupy.cuda.MemoryPointer(mem, 0), strides=v.byte_strides
        )
        if a.kind == "f":
            return raw.view(cupy.float16).astype(cupy.float32)
        return (raw.astype(cupy.uint32) << 16).view(cupy.float32)
    arr = np.asarray(x)
    if arr.itemsize != 2:
        raise InvalidArgumentError(
            f"{name} must hold float16 or bfloat16 values to write into a "
            f"{cache_dtype} pool, got {arr.dtype}"
        )
    dtype = "float16" if arr.dtype.kind == "f" else "bfloat16"
    return reference.to_float64(arr, dtype).astype(np.float32)
