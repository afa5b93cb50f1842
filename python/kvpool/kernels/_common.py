"""What the decode and prefill plans share: the pool's numbers, argument checks of the softmax
scale, the fp8 scales, the stream and the batch arrays, the split workspace, results on the host
and the compiled kernels."""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import numpy as np

from kvpool import reference
from kvpool.exceptions import InvalidArgumentError
from kvpool.kernels import _build, _torch
from kvpool.kernels._args import (
    ArrayView,
    check_ptr,
    device_index,
    elem_ok,
    index_arg,
    pool_is_cuda,
)
from kvpool.kernels._args import dev as _dev
from kvpool.kernels._args import view as _view
from kvpool.kernels._launch import Kernel, cupy_stream
from kvpool.kernels._scales import KvScales

LOG2E = 1.4426950408889634  # the kernels work in the log2 domain (exp2)


class PoolInfo:
    """The numbers of a pool a launch needs, read once per plan."""

    __slots__ = (
        "base_ptr",
        "block_size",
        "cuda",
        "device_id",
        "dtype",
        "head_dim",
        "layout",
        "num_blocks",
        "num_kv_heads",
        "num_layers",
        "strides",
    )

    def __init__(self, pool: Any) -> None:
        layout = pool.layout
        self.layout = layout
        self.num_layers = layout.num_layers
        self.cuda = pool_is_cuda(pool)
        self.base_ptr = pool.base_ptr
        self.num_blocks = pool.num_blocks
        self.dtype = layout.dtype
        self.head_dim = layout.head_dim
        self.block_size = layout.block_size
        self.num_kv_heads = layout.num_kv_heads
        self.device_id = device_index(pool) if self.cuda else -1
        self.strides = layout.strides() if self.cuda else {}


# Device attributes and compiled kernels depend on nothing a plan binds (only the device and
# the variant), so they are cached for the process, not per plan.
@functools.cache
def num_sms(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.cache
def compute_capability(device_id: int) -> int:
    """The device's compute capability as major * 10 + minor (90 for Hopper)."""
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability)


@functools.cache
def compiled_kernel(variant: Any, name: str, device_id: int, min_dynamic_smem: int = 0) -> Kernel:
    """The kernel `name` of the module of `variant` on `device_id` (compiled once)."""
    return Kernel(_build.decode_module(variant), name, device_id, min_dynamic_smem)


def check_layer(layer: int, info: PoolInfo) -> int:
    layer = index_arg(layer, "layer")
    if not 0 <= layer < info.num_layers:
        raise InvalidArgumentError(f"layer {layer} outside 0..{info.num_layers - 1}")
    return layer


def softmax_scale_log2(scale: Any, head_dim: int) -> float:
    """The kernels' log2-domain softmax scale: 1/sqrt(head_dim) when `scale` is None, else a
    finite real number (a bool is refused as a wrong type, NaN and inf as wrong values)."""
    return LOG2E * host_scale(scale, head_dim)


def host_scale(scale: Any, head_dim: int) -> float:
    """The softmax scale as a float (see softmax_scale_log2)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value):
        raise InvalidArgumentError(f"scale must be finite, got {value}")
    return value


def check_scales(pool: Any, info: PoolInfo, scales: KvScales | None, op: str) -> None:
    """An fp8 pool needs its own KvScales; any other pool takes none."""
    if info.dtype in _build.FP8_DTYPES:
        if not isinstance(scales, KvScales) or scales.pool is not pool:
            raise InvalidArgumentError(
                f"{op} over a {info.dtype} pool needs scales=KvScales(pool) of this pool"
            )
    elif scales is not None:
        raise InvalidArgumentError(f"scales are for fp8 pools; this pool holds {info.dtype}")


def call_stream(stream: Any, pool: Any, *arrays: Any) -> Any:
    """The stream a one-call form hands its plan: `stream`, or on a CUDA pool whose call has
    torch tensors among `arrays` (q, out), torch's current stream (the plan sees only the
    batch arrays, which may be a BlockTables' own)."""
    if stream is None and pool_is_cuda(pool):
        return _torch.torch_stream(device_index(pool), *arrays)
    return stream


def check_host_stream(stream: Any) -> None:
    """A host pool runs on no stream: a stream is refused, as BlockTables.sync refuses it."""
    if stream is not None:
        raise InvalidArgumentError("a stream was given, but the pool is on the host")


def check_tables_pool(arr: Any, pool: Any, name: str) -> None:
    # BlockTables.pool (and so DeviceArray.pool) is the very Pool object BlockTables was made with.
    owner = getattr(arr, "pool", None)
    if owner is not None and owner is not pool:
        raise InvalidArgumentError(f"{name} belong to another pool")


def check_plan_pool(plan: Any, pool: Any, kind: type) -> None:
    """`plan` is a `kind` made for this pool."""
    if not isinstance(plan, kind):
        raise TypeError(f"plan must be a {kind.__name__}, got {type(plan).__name__}")
    if getattr(plan, "pool", None) is not pool:
        raise InvalidArgumentError(f"the {kind.__name__} was made for another pool")


def fp8_query_dtype(kind: str, itemsize: int, pool_dtype: str) -> str:
    """The query dtype over an fp8 cache: float16 (a 2-byte float) or bfloat16 (any other
    2-byte type); anything else (fp8 queries among them) is refused."""
    if itemsize != 2:
        raise InvalidArgumentError(
            f"q over a {pool_dtype} pool must be float16 or bfloat16, got a {itemsize}-byte type"
        )
    return "float16" if kind == "f" else "bfloat16"


def host_array(x: Any, name: str) -> np.ndarray:
    """A host pool's input as NumPy (a CPU torch tensor as a view of its bits)."""
    if _torch.is_torch(x):
        return _torch.host_numpy(x, name)
    if hasattr(x, "__cuda_array_interface__"):
        raise InvalidArgumentError(f"{name} is a device array but the pool is on the host")
    return np.asarray(x)


def host_result(res: np.ndarray, q_dtype: str, q: Any, q_np: np.ndarray, out: Any) -> Any:
    """The float64 reference's result in q's element type: into `out` when given, a torch
    tensor when q is one."""
    res = reference.from_float64(res, q_dtype)
    if out is None:
        return _torch.like_torch(res, q) if _torch.is_torch(q) else res.view(q_np.dtype)
    if _torch.is_torch(out):
        out.copy_(_torch.like_torch(res.view(_torch.host_numpy(out, "out").dtype), out))
        return out
    out[...] = res.view(out.dtype)
    return out


def host_query(
    q: Any, info: PoolInfo, fp8: bool, check_shape: Any, out: Any
) -> tuple[np.ndarray, str, int]:
    """A host plan's query as NumPy, with its element type and width, checked with `out`: the
    element types the CUDA path accepts (float16 data for a float16 pool, 2-byte non-float data,
    bfloat16 bits, for a bfloat16 pool; never a numeric conversion), and over an fp8 pool either
    float16 or bfloat16. `check_shape` is the plan's own shape check."""
    q_np = host_array(q, "q")
    check_shape(q_np.shape)
    q_dtype = fp8_query_dtype(q_np.dtype.kind, q_np.itemsize, info.dtype) if fp8 else info.dtype
    q_bytes = 2 if fp8 else info.layout.elem_bytes
    if not elem_ok(q_np.dtype.kind, q_np.itemsize, q_dtype, q_bytes):
        raise InvalidArgumentError(f"q has dtype {q_np.dtype}; the pool's dtype is {info.dtype}")
    check_host_out(out, q_np.shape, q_dtype, q_bytes)
    return q_np, q_dtype, q_bytes


def check_host_out(out: Any, shape: tuple[int, ...], q_dtype: str, q_bytes: int) -> None:
    arr = None if out is None else host_array(out, "out")
    if arr is not None and (
        arr.shape != shape or not elem_ok(arr.dtype.kind, arr.itemsize, q_dtype, q_bytes)
    ):
        raise InvalidArgumentError(
            f"out must be a host array of shape {shape} holding {q_dtype}, got "
            f"{arr.dtype} {arr.shape}"
        )


def same_batch_array(given: Any, bound: Any, bound_view: ArrayView | None, name: str) -> None:
    """`given` is the batch array a plan was made from: that very object, the same device
    memory (pointer, shape, strides, type), or a host array of equal contents."""
    if given is bound:
        return
    if bound_view is not None:  # a device array bound by the plan
        if hasattr(given, "__cuda_array_interface__") or _torch.is_torch(given):
            v = _view(given, name)
            if (v.ptr, v.layout_key) == (bound_view.ptr, bound_view.layout_key):
                return
    elif not hasattr(given, "__cuda_array_interface__"):
        try:
            a = host_array(given, name)
        except InvalidArgumentError:  # a device tensor against a host plan
            a = None
        b = np.asarray(bound)
        if a is not None and a.shape == b.shape and np.array_equal(a, b):
            return
    raise InvalidArgumentError(
        f"{name} is not the array the plan was made for (another batch): make a plan for "
        "this batch, or call plan.run"
    )


def new_out(q: Any, qv: ArrayView, device_id: int) -> Any:
    """The result array of a call without `out`: a torch tensor like q when q is one, else a
    CuPy array (float16, or uint16 holding bfloat16 bits)."""
    if _torch.is_torch(q):
        return _torch.empty_like(q)
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.empty(tuple(qv.shape), dtype=cupy.float16 if qv.is_float else cupy.uint16)


class Workspace:
    """The float32 split partials of a plan: the caller's array (checked) or one the plan
    allocates on its stream and keeps, so every run reuses it (runs of one plan are ordered on
    its stream) and CuPy's pool hands its memory out again only in that stream's order."""

    __slots__ = ("array", "ptr")

    def __init__(self, workspace: Any, need: int, device_id: int, stream: int) -> None:
        if workspace is None:
            import cupy

            with cupy.cuda.Device(device_id), cupy_stream(stream):
                self.array = cupy.empty(max(need, 1), cupy.float32)
            self.ptr = int(self.array.data.ptr)
            return
        ws = _dev(_view(workspace, "workspace"), "workspace")
        if ws.typestr[1:] != "f4" or len(ws.shape) != 1 or ws.strides[0] != 1 or ws.shape[0] < need:
            raise InvalidArgumentError(
                f"workspace must be a contiguous 1-d float32 array of >= {need} elements"
            )
        check_ptr(ws.ptr, "workspace", device_id)
        self.array, self.ptr = workspace, ws.ptr
