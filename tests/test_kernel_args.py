"""The kernel glue's argument readers, without a GPU: named array views, stream handles, and
index arguments that refuse bools (True would otherwise pass as 1)."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from kvpool.kernels import append_kv, paged_attention_decode
from kvpool.kernels._args import ArrayView, dev, index_arg, view
from kvpool.kernels._launch import stream_handle


class FakeDeviceArray:
    def __init__(self, shape, typestr, strides=None, stream=None):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (4096, False),
            "strides": strides,
            "version": 3,
            "stream": stream,
        }


def test_view_names_its_fields():
    v = view(FakeDeviceArray((3, 4), "<u2", stream=7), "x")
    assert isinstance(v, ArrayView)
    assert (v.ptr, v.shape, v.byte_strides, v.typestr, v.stream) == (4096, (3, 4), (8, 2), "<u2", 7)
    assert not v.is_float and view(FakeDeviceArray((2,), "<f2"), "y").is_float
    assert v.layout_key == ((3, 4), (8, 2), "<u2")
    assert dev(v, "x").strides == (4, 1)


def test_view_of_a_host_array_names_the_argument():
    with pytest.raises(kvpool.InvalidArgumentError, match="^q must be a device array"):
        view(np.zeros(3), "q")


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.5, "1", None])
def test_index_arguments_refuse_bools_and_non_integers(value):
    with pytest.raises(TypeError, match="^layer must be an integer"):
        index_arg(value, "layer")


def test_index_arguments_take_python_and_numpy_integers():
    assert (
        index_arg(3, "n") == 3
        and index_arg(np.int64(5), "n") == 5
        and index_arg(np.uint8(2), "n") == 2
    )


def test_kernel_entry_points_refuse_a_bool_layer():
    pool = kvpool.Pool(kvpool.KvLayout(2, 2, 64, 16), 8, device="host")
    kv = np.zeros((1, 2, 64), np.float16)
    with pytest.raises(TypeError, match="layer must be an integer, got True"):
        append_kv(kv, kv, pool, True, np.array([0], np.int64))
    with pytest.raises(TypeError, match="layer must be an integer, got False"):
        paged_attention_decode(kv, pool, False, np.zeros((1, 1), np.int32), np.ones(1, np.int32))
    assert pool.num_free == 8  # nothing happened


class FakeStream:
    def __cuda_stream__(self):
        return (0, 1234)


def test_stream_handle_reads_the_stream_protocols():
    assert stream_handle(FakeStream()) == 1234

    class TorchLike:
        cuda_stream = 99

    assert stream_handle(TorchLike()) == 99
    with pytest.raises(TypeError, match="stream must be .* got object"):
        stream_handle(object())


def test_append_parameter_blocks_are_filled_from_one_set_of_fields():
    # append_kv and append_kv_fp8 share their first 16 parameters (_AppendFp8Args extends
    # _AppendArgs); both are filled from _append_fields, checked here without a GPU.
    from types import SimpleNamespace

    from kvpool.kernels import _cache_ops
    from kvpool.kernels._launch import fill_args

    pool = kvpool.Pool(kvpool.KvLayout(2, 2, 64, 16), 8, device="host")
    rows = SimpleNamespace(ptr=4096, strides=(128, 64), itemsize=2)
    fields = _cache_ops._append_fields(pool, 1, rows, rows, SimpleNamespace(ptr=8192), 2, 8)
    assert list(fields) == [name for name, _ in _cache_ops._AppendArgs._fields_]
    st = pool.layout.strides()
    assert fields["k_base"] == pool.base_ptr + st["layer"]
    assert fields["v_base"] == fields["k_base"] + st["kv"]
    assert (fields["k_tok_stride"], fields["k_head_stride"]) == (256, 128)
    assert fields["num_slots"] == 8 * 16
    fill_args(_cache_ops._AppendArgs, **fields)
    extra = dict(k_scale=1, v_scale=2, scale_head_stride=1, in_bf16=0, fmt=0)
    fill_args(_cache_ops._AppendFp8Args, **fields, **extra)
