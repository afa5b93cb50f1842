"""DLPack export of pool views: true dtypes (bfloat16, float8_e4m3fn), strides in elements,
zero copy, both capsule kinds, and the consumer's requests refused when they cannot be met."""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys

import kvpool
import numpy as np
import pytest
from kvpool._pool_array import PoolArray

# DLPack's dtype codes (dlpack.h): kDLFloat 2, kDLBfloat 4, kDLFloat8_e4m3fn 10, kDLFloat8_e5m2 12.
DL_DTYPES = {
    "float16": (2, 16),
    "float32": (2, 32),
    "bfloat16": (4, 16),
    "float8_e4m3fn": (10, 8),
    "float8_e5m2": (12, 8),
}


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class Versioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


def _capsule_pointer(capsule, name: bytes) -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get(capsule, name)


def _pool(dtype: str) -> kvpool.Pool:
    return kvpool.Pool(kvpool.KvLayout(3, 2, 16, 4, dtype), 5, device="host")


def _slab_view(array: np.ndarray) -> kvpool._core.SlabView:
    """A host pool's view is a NumPy array over a SlabView (its slab_view), which exports DLPack."""
    assert isinstance(array.slab_view, kvpool._core.SlabView)
    return array.slab_view


@pytest.mark.parametrize("dtype", sorted(DL_DTYPES))
@pytest.mark.parametrize("versioned", [False, True])
def test_capsule_describes_the_view(dtype, versioned):
    pool = _pool(dtype)
    view = _slab_view(pool.v_view(2))
    assert view.__dlpack_device__() == (1, 0)
    cap = view.__dlpack__(max_version=(1, 0)) if versioned else view.__dlpack__()
    name = b"dltensor_versioned" if versioned else b"dltensor"
    ptr = _capsule_pointer(cap, name)
    if versioned:
        v = Versioned.from_address(ptr)
        assert (v.major, v.flags) == (1, 0)
        t = v.dl_tensor
    else:
        t = DLTensor.from_address(ptr)
    cai = view.__array_interface__
    elem = pool.layout.elem_bytes
    assert t.data == cai["data"][0] and (t.device_type, t.device_id) == (1, 0)
    assert (t.code, t.bits, t.lanes) == (*DL_DTYPES[dtype], 1)
    assert [t.shape[i] for i in range(t.ndim)] == list(cai["shape"])
    assert [t.strides[i] for i in range(t.ndim)] == [s // elem for s in cai["strides"]]
    del cap  # never consumed: the capsule's destructor frees it
    gc.collect()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_numpy_from_dlpack_shares_memory(dtype):
    pool = _pool(dtype)
    arr = np.from_dlpack(_slab_view(pool.k_view(1)))
    assert arr.shape == (5, 4, 2, 16) and arr.dtype == np.dtype(dtype)
    arr[4, 3, 1, 7] = 2.5
    assert np.asarray(pool.k_view(1))[4, 3, 1, 7] == 2.5
    assert np.asarray(pool.v_view(1))[4, 3, 1, 7] == 0
    del pool  # the array keeps the view, which keeps the pool
    gc.collect()
    assert arr[4, 3, 1, 7] == 2.5


def test_requests_that_cannot_be_met_are_refused():
    view = _slab_view(_pool("float16").k_view(0))
    with pytest.raises(BufferError, match="never copied"):
        view.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="device"):
        view.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError, match="no stream"):
        view.__dlpack__(stream=0)
    assert view.__dlpack__(copy=False, dl_device=(1, 0)) is not None


# An export still alive when the interpreter exits: released while Py_FinalizeEx frees module
# globals, when no Python call may be made. Each kind: consumed (numpy holds the tensor) and
# an unconsumed capsule.
EXIT_SCRIPTS = {
    "versioned": "EXPORT = np.from_dlpack(VIEW)",
    "legacy": (
        "class Legacy:\n"
        "    def __dlpack__(self, **kwargs):\n"
        "        return VIEW.__dlpack__()\n"
        "    def __dlpack_device__(self):\n"
        "        return VIEW.__dlpack_device__()\n"
        "EXPORT = np.from_dlpack(Legacy())"
    ),
    "unconsumed versioned capsule": "EXPORT = VIEW.__dlpack__(max_version=(1, 0))",
    "unconsumed legacy capsule": "EXPORT = VIEW.__dlpack__()",
}


@pytest.mark.parametrize("kind", sorted(EXIT_SCRIPTS))
def test_an_export_alive_at_interpreter_exit_exits_cleanly(kind: str) -> None:
    script = (
        "import numpy as np\n"
        "import kvpool\n"
        "POOL = kvpool.Pool(kvpool.KvLayout(2, 1, 16, 4), 4, device='host')\n"
        "VIEW = POOL.k_view(0).slab_view\n" + EXIT_SCRIPTS[kind] + "\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "panic" not in done.stderr and done.stderr == "", done.stderr


# A host pool's K/V array view (kvpool.PoolArray) carries the pool's dtype: NumPy holds
# bfloat16 and float8 as raw integers, DLPack hands them on as themselves.


def _torch_dtype(torch, name: str):
    return getattr(torch, name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float16"])
def test_torch_from_dlpack_of_a_host_view_has_the_pool_dtype_and_values(dtype):
    torch = pytest.importorskip("torch")
    pool = _pool(dtype)
    view = pool.k_view(1)
    assert isinstance(view, PoolArray) and view.kv_dtype == dtype
    want = torch.randn(tuple(view.shape)).to(_torch_dtype(torch, dtype))
    bits = want.view(torch.uint8 if want.element_size() == 1 else torch.int16).numpy()
    view[...] = bits.view(view.dtype)
    got = torch.from_dlpack(view)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # zero copy: a write through the tensor is a write into the pool
    got[4, 3, 1, 7] = 1.5
    assert torch.from_dlpack(pool.k_view(1))[4, 3, 1, 7].item() == 1.5
    # a slice and a copy keep the dtype; their values are the slice's
    part = torch.from_dlpack(view[2:, 1, :, 3:9])
    assert part.dtype == want.dtype and torch.equal(part, got[2:, 1, :, 3:9])
    assert torch.from_dlpack(view[1].copy()).dtype == want.dtype


def test_arithmetic_on_host_view_bits_is_a_plain_array():
    pool = _pool("bfloat16")
    view = pool.v_view(0)
    for derived in (view + 1, view.astype(np.float32), np.maximum(view, 0)):
        assert type(derived) is np.ndarray
    assert view.view(np.uint8).kv_dtype is not None  # a view of the bits as bytes...
    exported = np.from_dlpack(view.view(np.uint8))  # ...exports as what it holds: bytes
    assert exported.dtype == np.uint8


def test_dlpack_as_refuses_what_it_cannot_label():
    arr = np.zeros((3, 4), np.float32)
    with pytest.raises(kvpool.InvalidArgumentError, match="2-byte items"):
        kvpool._core.dlpack_as(arr, "bfloat16")
    with pytest.raises(kvpool.InvalidArgumentError, match="2-byte items"):
        kvpool._core.dlpack_as(np.zeros(3, np.float16), "bfloat16")  # a float is not bits
    with pytest.raises(TypeError, match="NumPy array"):
        kvpool._core.dlpack_as([1, 2], "bfloat16")
    with pytest.raises(kvpool.LayoutError):
        kvpool._core.dlpack_as(np.zeros(3, np.uint16), "int7")
    cap = kvpool._core.dlpack_as(np.zeros(3, np.uint16)[::2], "bfloat16", max_version=(1, 0))
    t = Versioned.from_address(_capsule_pointer(cap, b"dltensor_versioned")).dl_tensor
    assert (t.code, t.bits, t.strides[0], t.shape[0]) == (4, 16, 2, 2)


def test_a_read_only_array_exports_a_read_only_capsule():
    arr = np.zeros(4, np.uint16)
    arr.flags.writeable = False
    cap = kvpool._core.dlpack_as(arr, "bfloat16", max_version=(1, 0))
    assert Versioned.from_address(_capsule_pointer(cap, b"dltensor_versioned")).flags == 1
