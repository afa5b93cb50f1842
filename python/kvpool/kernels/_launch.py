"""Streams and kernel launches: the one way the kernel glue names a stream and launches a kernel.

Every kernel (decode, merge, append, copy) is launched by one ``cuLaunchKernel`` through CuPy's
driver binding, with a parameter block built from a ``ctypes.Structure`` (the kernelParams
array holds the addresses of the structure's fields), filled by field name
(:func:`fill_args`). A caller that launches the same kernel
again only rewrites the fields that changed (a plan keeps its block per call shape);
``RawKernel.__call__`` would instead convert and box every argument on every call. The driver
copies the parameters when the launch is queued, so a block may be rewritten right after.

Streams are CUstream handles (ints) inside the glue: :func:`stream_handle` reads any stream a
caller passes, :func:`launch_stream` picks the default one (torch's current stream for torch
inputs, else CuPy's), :func:`cupy_stream` wraps a handle for CuPy work (allocations, host copies) that
must be ordered with the launches.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from typing import Any, TypeVar

from kvpool.kernels._torch import torch_stream

_S = TypeVar("_S", bound=ctypes.Structure)


def stream_handle(stream: Any) -> int:
    """The CUstream handle of `stream`: None -> CuPy's current stream (of the current device);
    a CuPy stream; a torch stream (``cuda_stream``); anything with ``__cuda_stream__``."""
    if stream is None:
        import cupy

        return cupy.cuda.get_current_stream().ptr
    if type(stream).__module__.startswith("cupy") and hasattr(stream, "ptr"):
        return stream.ptr
    handle = getattr(stream, "cuda_stream", None)  # torch
    if handle is not None:
        return int(handle)
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int((proto() if callable(proto) else proto)[1])
    raise TypeError(
        f"stream must be a CuPy or PyTorch stream or have __cuda_stream__, got {type(stream).__name__}"
    )


def launch_stream(stream: Any, device_id: int, *arrays: Any) -> int:
    """The CUstream handle a call runs on: `stream` when given; else torch's current stream of
    the device when any of `arrays` (the call's inputs and outputs) is a torch tensor, so that
    ``with torch.cuda.stream(s):`` orders the call with the caller's torch work; else CuPy's
    current stream."""
    if stream is None:
        stream = torch_stream(device_id, *arrays)
    return stream_handle(stream)


def cupy_stream(handle: int) -> Any:
    """A CuPy stream over the CUstream `handle`, not taking ownership (use as a context)."""
    import cupy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(int(handle))


def wait_producers(stream: int, device_id: int, *views: Any) -> None:
    """Make `stream` wait for the streams the inputs' __cuda_array_interface__ names (ArrayView
    .stream: the producers, e.g. BlockTables.sync's upload on the pool's stream). Nothing is done
    when an input names no stream or the launch stream itself."""
    for v in views:
        s = v.stream
        if s is None or s == 0 or s == stream or (s == 1 and stream == 0):  # 1: legacy default
            continue
        import cupy

        rt = cupy.cuda.runtime
        with cupy.cuda.Device(device_id):
            ev = rt.eventCreateWithFlags(rt.eventDisableTiming)
            try:
                rt.eventRecord(ev, int(s))
                rt.streamWaitEvent(stream, ev, 0)
            finally:
                rt.eventDestroy(ev)  # released by CUDA once the wait is done


class Kernel:
    """A compiled kernel on one device: its CUfunction handle, with the objects that own it."""

    __slots__ = ("_owners", "device_id", "handle", "name")

    def __init__(self, module: Any, name: str, device_id: int, min_dynamic_smem: int = 0) -> None:
        import cupy

        with cupy.cuda.Device(device_id):
            raw = module.get_function(name)
            # The default cap is 48 KiB less the kernel's static shared memory (the fp8 decode's
            # staging tile is static), so compare with the cap, not with 48 KiB.
            if raw.max_dynamic_shared_size_bytes < min_dynamic_smem:
                raw.max_dynamic_shared_size_bytes = min_dynamic_smem
            fn = raw.kernel  # the cupy.cuda.Function of the current device
        self._owners = (module, raw, fn)
        self.device_id = device_id
        self.handle = fn.ptr
        self.name = name


def fill_args(struct_type: type[_S], **values: Any) -> _S:
    """A parameter block of `struct_type` filled by field name. Every field must be named (a
    field left out would silently be 0) and no other name is taken."""
    names = [f[0] for f in struct_type._fields_]  # type: ignore[attr-defined]
    missing = [n for n in names if n not in values]
    unknown = [n for n in values if n not in names]
    if missing or unknown:
        raise TypeError(f"{struct_type.__name__}: missing fields {missing}, unknown {unknown}")
    return struct_type(**values)


@functools.cache
def _field_offsets(struct_type: type[ctypes.Structure], skip: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(
        getattr(struct_type, f[0]).offset for f in struct_type._fields_ if f[0] not in skip
    )


def param_block(struct: ctypes.Structure, skip: tuple[str, ...] = ()) -> Any:
    """void*[] of the addresses of the struct's fields, in order (the kernelParams); `skip`
    leaves out fields the kernel does not take. Keep `struct` alive as long as the block."""
    base = ctypes.addressof(struct)
    offsets = _field_offsets(type(struct), skip)
    return (ctypes.c_void_p * len(offsets))(*[base + o for o in offsets])


def launch(
    kernel: Kernel, grid: tuple[int, int, int], threads: int, smem: int, stream: int, params: Any
) -> None:
    """Queue `kernel` on `stream` with the parameter block `params` (see param_block)."""
    from cupy.cuda import driver

    gx, gy, gz = grid
    try:
        driver.launchKernel(
            kernel.handle, gx, gy, gz, threads, 1, 1, smem, stream, ctypes.addressof(params), 0
        )
    except driver.CUDADriverError:
        # No (or another device's) context current on this thread: make the kernel's device
        # current through the runtime (which also makes its primary context current; cupy's
        # Device() context skips setDevice when the id already matches) and try once more. The
        # caller's current device is restored when it was another one.
        from cupy.cuda import runtime

        from kvpool._core import CudaError

        prev = runtime.getDevice()
        runtime.setDevice(kernel.device_id)
        try:
            driver.launchKernel(
                kernel.handle, gx, gy, gz, threads, 1, 1, smem, stream, ctypes.addressof(params), 0
            )
        except driver.CUDADriverError as e:
            raise CudaError(f"launching {kernel.name} failed: {e}") from e
        finally:
            if prev != kernel.device_id:
                runtime.setDevice(prev)
