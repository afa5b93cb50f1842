"""MlaScales: the dequantization scales of an fp8 MLA latent group.

An fp8 (float8_e4m3fn) latent group stores ``fp8(x / scale)`` for every element of a token's
row (c_kv and k_pe alike) and reads back ``fp8 * scale``: one float32 scale per layer of the
group (vLLM's per-layer ``k_scale`` of its fp8 MLA cache), held where the pool lives (a CuPy
array on the pool's device, NumPy for a host pool). The MLA kernel reads a layer's scale at
launch time from that array, so a CUDA graph sees a later set.

Like KvScales (kernels/_scales.py, the regular fp8 pool's per-layer K and V scales), a scale is
set once per layer and then frozen: it applies to every token already written with it.

- ``set(layer, scale)``: from calibration (a finite float32 > 0); always takes effect.
- ``calibrate_from(layer, latent, slot_mapping)``: amax / 448 over the rows whose slot is real
  (>= 0), never padding (-1); a no-op (False) when the layer is set, no row is real or the real
  rows are all zero. Reads the amax back to the host (a device sync), then the layer is frozen.
- ``auto_calibrate=True``: ``mla_append_latent(..., scales=s)`` calibrates an unset layer from
  its first write. Unset layers have scale 1.0.

Layers are the model's layer numbers (those of the group); ``index(layer)`` is its place in the
group.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool import reference
from kvpool.exceptions import InvalidArgumentError
from kvpool.kernels import _build
from kvpool.kernels._args import device_index, index_arg, pool_is_cuda
from kvpool.kernels._scales import _as_host_int64, _rows_as_float32


def group_layer_index(spec: Any, group: int, layer: Any, whose: str) -> int:
    """The place inside MLA group ``group`` of ``spec`` of model layer ``layer``;
    InvalidArgumentError naming ``whose`` group it is (``"the plan's"``) for a layer outside
    the model or in another group."""
    layer = index_arg(layer, "layer")
    if not 0 <= layer < spec.num_layers:
        raise InvalidArgumentError(f"layer {layer} outside 0..{spec.num_layers - 1}")
    g, idx = spec.group_of_layer(layer)
    if g != group:
        raise InvalidArgumentError(
            f"layer {layer} is in group {g} ({spec.groups[g].kind}), not in {whose} MLA group "
            f"{group}"
        )
    return int(idx)


class MlaScales:
    """Per-layer dequantization scales of one fp8 MLA latent group (see the module docstring)."""

    def __init__(self, pool: Any, spec: Any, group: Any, *, auto_calibrate: bool = False) -> None:
        if type(spec).__name__ != "ModelKvSpec" or not hasattr(spec, "latent_offset_bytes"):
            raise TypeError(f"spec must be a ModelKvSpec, got {type(spec).__name__}")
        g = index_arg(group, "group")
        if not 0 <= g < spec.num_groups:
            raise InvalidArgumentError(f"group {g} outside 0..{spec.num_groups - 1}")
        kv = spec.groups[g]
        if kv.kind != "mla_latent" or kv.dtype not in _build.MLA_FP8_DTYPES:
            raise InvalidArgumentError(
                f"MlaScales needs an fp8 mla_latent group ({', '.join(_build.MLA_FP8_DTYPES)}); "
                f"group {g} is a {kv.dtype} {kv.kind} group"
            )
        if spec.page_bytes != pool.block_bytes:
            raise InvalidArgumentError(
                f"the pool's blocks ({pool.block_bytes} bytes) are not the spec's pages "
                f"({spec.page_bytes}): make the pool with Pool.for_spec(spec, ...)"
            )
        self.pool, self.spec, self.group = pool, spec, g
        self.dtype = kv.dtype
        self.layers = tuple(int(x) for x in kv.layers)
        self.auto_calibrate = bool(auto_calibrate)
        self.cuda = pool_is_cuda(pool)
        n = len(self.layers)
        if self.cuda:
            import cupy

            with cupy.cuda.Device(device_index(pool)):
                self.scale = cupy.ones((n,), cupy.float32)
        else:
            self.scale = np.ones((n,), np.float32)
        self._frozen = np.zeros(n, dtype=bool)

    def index(self, layer: Any) -> int:
        """The place in the group of model layer `layer` (refused outside the group)."""
        return group_layer_index(self.spec, self.group, layer, "the scales'")

    def is_set(self, layer: int) -> bool:
        """Whether the layer's scale was set or calibrated (and is frozen)."""
        return bool(self._frozen[self.index(layer)])

    def layer_scale(self, layer: int) -> float:
        """The layer's scale as a host float (a float32 value)."""
        v = self.scale[self.index(layer)]
        return float(v.get() if self.cuda else v)

    def ptr(self, layer: int) -> int:
        """Device address of the layer's scale (a CUDA pool)."""
        return self.index_ptr(self.index(layer))

    def index_ptr(self, idx: int) -> int:
        """Device address of the scale of the group's `idx`-th layer (a CUDA pool)."""
        return int(self.scale.data.ptr) + 4 * idx

    def set(self, layer: int, scale: Any) -> None:
        """Set the layer's scale (finite, > 0 as a float32). Checked before anything changes."""
        idx = self.index(layer)
        if isinstance(scale, (bool, np.bool_)) or not isinstance(
            scale, (int, float, np.integer, np.floating)
        ):
            raise TypeError(f"scale must be a float, got {type(scale).__name__}")
        val = float(scale)
        with np.errstate(over="ignore"):
            v32 = np.float32(val)
        if not (np.isfinite(val) and val > 0 and np.isfinite(v32) and v32 > 0):
            raise InvalidArgumentError(f"scale must be finite and > 0 as a float32, got {val}")
        self.scale[idx] = v32
        self._frozen[idx] = True

    def calibrate_from(self, layer: int, latent: Any, slot_mapping: Any) -> bool:
        """Derive the layer's scale from the real rows of a write (see the module docstring);
        True when this call set it."""
        idx = self.index(layer)
        if self._frozen[idx]:
            return False
        x32 = _rows_as_float32(latent, self.dtype, "latent")
        slots = _as_host_int64(slot_mapping)
        width = _build.MLA_LATENT_DIM + _build.MLA_ROPE_DIM
        if x32.ndim != 2 or tuple(x32.shape) != (len(slots), width):
            raise InvalidArgumentError(
                f"latent must be [{len(slots)}, {width}], got {tuple(x32.shape)}"
            )
        real = np.flatnonzero(slots >= 0)
        if len(real) == 0:
            return False
        if hasattr(x32, "get"):
            import cupy

            amax = float(cupy.abs(x32[cupy.asarray(real)]).max().get())
        else:
            amax = float(np.abs(x32[real]).max())
        if not np.isfinite(amax):
            raise InvalidArgumentError("calibrate_from: latent holds a non-finite value")
        if amax <= 0:
            return False
        self.set(layer, amax / reference.FP8[self.dtype].max_value)
        return True
