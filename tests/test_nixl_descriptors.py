"""NIXL descriptors and registrations of host and CUDA pools, built without NIXL or a GPU: the
memory type and device id of a pool's slab (DRAM for a host pool, VRAM with the device ordinal
for a CUDA one, a clear refusal otherwise), one row per run of blocks contiguous on both sides
carrying that device id, and each side's rows given its own device id and memory type when a
transport hands them to NIXL. The transfers themselves: tests/test_nixl_transfer.py (host, two
processes) and tests/test_nixl_gpu.py (CUDA pools on the GPU)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import kvpool
import numpy as np
import pytest
from kvpool import TransferError
from kvpool.transfer import plan_pieces
from kvpool.transfer.nixl_transport import (
    CUDA_IPC_GET,
    NixlTransport,
    enable_cuda_ipc_get,
    nixl_memory,
    on_device,
    refuse_growable,
    run_descriptors,
    settle_source,
)
from kvpool.transfer.pieces import GROUPED


def fake_pool(device: str, growable: bool = False, block_bytes: int = 10) -> SimpleNamespace:
    return SimpleNamespace(device=device, growable=growable, block_bytes=block_bytes)


def test_a_host_pool_registers_as_dram_of_device_zero():
    pool = kvpool.Pool(kvpool.KvLayout(1, 1, 8, 16), 4, device="host")
    assert nixl_memory(pool) == ("DRAM", 0)
    settle_source(pool)  # nothing to wait for on a host pool (and no CuPy needed)


def test_a_cuda_pools_agent_asks_ucx_for_cuda_ipc_get_unless_the_user_chose(monkeypatch):
    monkeypatch.setenv(CUDA_IPC_GET, "unset")  # so that the teardown restores the variable
    monkeypatch.delenv(CUDA_IPC_GET)
    enable_cuda_ipc_get("DRAM")  # a host pool's agent leaves UCX's default alone
    assert CUDA_IPC_GET not in os.environ
    enable_cuda_ipc_get("VRAM")
    assert os.environ[CUDA_IPC_GET] == "y"
    monkeypatch.setenv(CUDA_IPC_GET, "auto")  # the user's choice stays
    enable_cuda_ipc_get("VRAM")
    assert os.environ[CUDA_IPC_GET] == "auto"


@pytest.mark.parametrize(("device", "want"), [("cuda", 0), ("cuda:0", 0), ("cuda:3", 3)])
def test_a_cuda_pool_registers_as_vram_of_its_device(device, want):
    assert nixl_memory(fake_pool(device)) == ("VRAM", want)


@pytest.mark.parametrize(
    ("pool", "match"),
    [
        (fake_pool("cuda:x"), "host and CUDA pools only.*'cuda:x'"),
        (fake_pool("disk"), "host and CUDA pools only.*'disk'"),
    ],
)
def test_what_nixl_is_not_given_here_is_refused_by_name(pool, match):
    with pytest.raises(TransferError, match=match):
        nixl_memory(pool)
    with pytest.raises(TransferError, match=match):  # before NIXL is loaded or anyone waited
        NixlTransport.connect(0, "/nonexistent/rendezvous.json", pool, timeout=0.01)


@pytest.mark.parametrize("device", ["host", "cuda:1"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_growable_pool_is_refused_at_connect_before_nixl_or_the_rendezvous(device, rank):
    pool = SimpleNamespace(device=device, growable=True, num_blocks=128, block_bytes=10)
    for refuse in (
        lambda: refuse_growable(pool),
        lambda: NixlTransport.connect(rank, "/nonexistent/rendezvous.json", pool, timeout=0.01),
    ):
        with pytest.raises(TransferError, match="growable pools.*128 blocks.*fixed-size pool"):
            refuse()


def test_a_real_growable_host_pool_is_refused_and_a_fixed_one_is_not():
    layout = kvpool.KvLayout(1, 1, 8, 16)
    growable = kvpool.Pool(layout, growable=True, max_num_blocks=64, device="host")
    with pytest.raises(TransferError, match="growable pools"):
        refuse_growable(growable)
    refuse_growable(kvpool.Pool(layout, 4, device="host"))


def test_run_descriptors_carry_the_device_id_one_row_per_run():
    src = np.array([4, 5, 6, 9, 10, 2], np.int32)
    dst = np.array([0, 1, 3, 4, 5, 6], np.int32)
    pieces = plan_pieces(GROUPED, src, dst, len(src))
    rows = run_descriptors(1 << 40, 10, src, pieces, device=3)
    base = 1 << 40
    assert rows.tolist() == [
        [base + 40, 20, 3],
        [base + 60, 10, 3],
        [base + 90, 20, 3],
        [base + 20, 10, 3],
    ]
    assert rows.dtype == np.uint64


def test_on_device_sets_every_row_and_leaves_the_callers_rows_alone():
    rows = np.array([[100, 8, 0], [200, 16, 0]], np.uint64)
    moved = on_device(rows, 2)
    assert moved.tolist() == [[100, 8, 2], [200, 16, 2]]
    assert rows[:, 2].tolist() == [0, 0]
    assert on_device(np.zeros((0, 3), np.uint64), 1).shape == (0, 3)


class RecordingAgent:
    def __init__(self) -> None:
        self.lists: list[tuple[list, str]] = []

    def get_xfer_descs(self, rows: np.ndarray, mem_type: str) -> tuple[list, str]:
        self.lists.append((rows.tolist(), mem_type))
        return rows.tolist(), mem_type


@pytest.mark.parametrize(
    ("mine", "theirs", "want_local", "want_remote"),
    [
        ("cuda:1", ("VRAM", 0), (1, "VRAM"), (0, "VRAM")),
        ("host", ("VRAM", 2), (0, "DRAM"), (2, "VRAM")),
        ("cuda", ("DRAM", 0), (0, "VRAM"), (0, "DRAM")),
    ],
)
def test_each_side_of_a_transfer_gets_its_own_device_id_and_memory_type(
    mine, theirs, want_local, want_remote
):
    agent = RecordingAgent()
    hello = {
        "agent": "peer",
        "base_ptr": 5000,
        "num_blocks": 8,
        "block_bytes": 10,
        "mem_type": theirs[0],
        "device_id": theirs[1],
    }
    transport = NixlTransport(None, None, agent, fake_pool(mine), hello)  # type: ignore[arg-type]
    local = np.array([[100, 20, 0], [140, 10, 0]], np.uint64)
    remote = np.array([[5000, 20, 0], [5070, 10, 0]], np.uint64)
    got_local, got_remote = transport.xfer_descs(local, remote)
    assert got_local == ([[100, 20, want_local[0]], [140, 10, want_local[0]]], want_local[1])
    assert got_remote == ([[5000, 20, want_remote[0]], [5070, 10, want_remote[0]]], want_remote[1])
