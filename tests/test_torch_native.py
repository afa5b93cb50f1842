"""Torch-native kernel calls, the parts checkable without a GPU: which stream a call without
`stream` runs on (torch's current stream for torch inputs, CuPy's otherwise; faked here), and
the result type of a call without `out` (a tensor of q's dtype). The GPU runs are in
test_torch_native_gpu.py."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvpool  # noqa: E402
from kvpool.kernels import _args, _common, _launch, _torch  # noqa: E402


class _FakeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


@pytest.fixture
def streams(monkeypatch):
    """torch's current stream is 0x7070 + device; CuPy's (a fake module) is 0xC0C0."""
    asked: list[int] = []

    def current_stream(device):
        asked.append(device)
        return _FakeStream(0x7070 + device)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    fake_cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=0xC0C0))
    )
    fake_cupy.__name__ = "cupy"
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    return asked


def test_a_call_with_torch_inputs_runs_on_torchs_current_stream_of_the_pools_device(streams):
    t = torch.zeros(4, dtype=torch.int32)
    assert _launch.launch_stream(None, 3, np.zeros(2), t) == 0x7070 + 3
    assert streams == [3]


def test_a_call_without_torch_inputs_runs_on_cupys_current_stream(streams):
    assert _launch.launch_stream(None, 0, np.zeros(2), None) == 0xC0C0
    assert streams == []  # torch was not asked


def test_a_given_stream_wins_over_torchs(streams):
    t = torch.zeros(4, dtype=torch.int32)
    assert _launch.launch_stream(_FakeStream(0x55), 0, t) == 0x55
    assert streams == []


def test_the_one_call_forms_hand_torchs_stream_to_their_plan_only_on_a_cuda_pool(streams):
    q = torch.zeros(2, 4, 8, dtype=torch.bfloat16)
    host = kvpool.Pool(kvpool.KvLayout(1, 1, 16, 4, "bfloat16"), 2, device="host")
    assert _common.call_stream(None, host, q, None) is None  # a host pool takes no stream
    cuda_like = types.SimpleNamespace(device="cuda:1")
    assert _common.call_stream(None, cuda_like, None, q).cuda_stream == 0x7070 + 1
    assert _common.call_stream(None, cuda_like, np.zeros(2), None) is None
    given = _FakeStream(9)
    assert _common.call_stream(given, cuda_like, q, None) is given


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_call_without_out_on_torch_q_returns_a_tensor_of_qs_dtype(dtype):
    q = torch.zeros(3, 4, 8, dtype=getattr(torch, dtype))
    qv = _args.ArrayView(0, (3, 4, 8), (64, 16, 2), "<V2", None)
    out = _common.new_out(q, qv, 0)
    assert isinstance(out, torch.Tensor) and out.dtype == q.dtype and out.shape == q.shape


def test_torch_stream_needs_a_torch_tensor():
    assert _torch.torch_stream(0, np.zeros(1), None, [1]) is None
