"""BlockTables on a CUDA pool: the uploaded table and seq_lens, and the ordering of uploads.

Kernels read the device table through raw pointers (not `cupy.asarray`, which synchronizes
the producer's stream on the host as CAI v3 asks, and would hide ordering bugs). A spin
kernel holds the pool's stream busy so uploads stay in flight while the host keeps mutating.
`deviceSynchronize` is used only before checking results.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gpu_fixtures import SPIN_SOURCE
from kvpool import BlockTables, KvLayout, Pool

pytestmark = pytest.mark.gpu

BS = 16
LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=BS)
NUM_BLOCKS = 4096
MAX_SEQS = 64
MAX_BLOCKS = 32
SPIN_NS = 50_000_000  # 50 ms: far longer than anything the host does meanwhile

KERNELS = (
    SPIN_SOURCE
    + r"""
extern "C" __global__ void snapshot(const int* __restrict__ src, int* __restrict__ dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}
"""
)


@pytest.fixture(scope="module")
def kernels(cp: Any) -> Any:
    return cp.RawModule(code=KERNELS)


@pytest.fixture
def pool() -> Iterator[Pool]:
    pool = Pool(LAYOUT, NUM_BLOCKS, device="cuda")
    yield pool
    import cupy

    cupy.cuda.runtime.deviceSynchronize()


@pytest.fixture
def stream(cp: Any, pool: Pool) -> Any:
    assert pool.stream is not None
    return cp.cuda.Stream.from_external(pool.stream)


@pytest.fixture
def tables(pool: Pool) -> BlockTables:
    return BlockTables(pool, MAX_SEQS, MAX_BLOCKS)


def host_state(tables: BlockTables) -> tuple[np.ndarray, np.ndarray]:
    ids = tables.request_ids()
    return tables.block_table(ids), tables.seq_lens(ids)


def raw_view(cp: Any, array: Any) -> Any:
    """A CuPy array over a DeviceArray's memory, without the CAI stream synchronisation."""
    shape = tuple(array.shape)
    nbytes = 4 * int(np.prod(shape))
    memory = cp.cuda.UnownedMemory(array.ptr, nbytes, array)
    return cp.ndarray(shape, cp.int32, cp.cuda.MemoryPointer(memory, 0))


class Snapshots:
    """Preallocated device buffers; `take` enqueues a kernel copying the synced arrays into
    the next one, on the pool's stream, so it sees exactly what the stream order promises."""

    def __init__(self, cp: Any, kernels: Any, stream: Any, count: int) -> None:
        self.cp, self.stream = cp, stream
        self.copy = kernels.get_function("snapshot")
        self.tables = cp.full((count, MAX_SEQS * MAX_BLOCKS), -7, cp.int32)
        self.seq_lens = cp.full((count, MAX_SEQS), -7, cp.int32)
        self.shapes: list[tuple[int, ...]] = []
        cp.cuda.runtime.deviceSynchronize()  # the buffers are ready before any spin starts

    def take(self, table: Any, seq_lens: Any) -> None:
        i = len(self.shapes)
        n = int(np.prod(table.shape))
        with self.stream:
            self.copy((32,), (256,), (np.uint64(table.ptr), self.tables[i], np.int64(n)))
            self.copy(
                (1,),
                (64,),
                (np.uint64(seq_lens.ptr), self.seq_lens[i], np.int64(seq_lens.shape[0])),
            )
        self.shapes.append(tuple(table.shape))

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        shape = self.shapes[i]
        table = self.tables[i, : int(np.prod(shape))].get().reshape(shape)
        return table, self.seq_lens[i, : shape[0]].get()


def spin(kernels: Any, stream: Any, ns: int = SPIN_NS) -> None:
    with stream:
        kernels.get_function("spin")((1,), (1,), (np.uint64(ns),))


def mutate(tables: BlockTables, rng: random.Random, steps: int, next_id: list[int]) -> None:
    """Random adds, appends (single and batched), forks and frees within the capacities."""
    for _ in range(steps):
        ids = tables.request_ids()
        op = rng.random()
        if not ids or (op < 0.25 and len(ids) < MAX_SEQS):
            next_id[0] += 1
            tables.add(next_id[0], rng.randrange(0, 4 * BS))
        elif op < 0.35 and len(ids) < MAX_SEQS:
            next_id[0] += 1
            tables.fork(rng.choice(ids), next_id[0])
        elif op < 0.5:
            tables.free(rng.choice(ids))
        elif op < 0.7:
            rid = rng.choice(ids)
            room = MAX_BLOCKS * BS - tables.num_tokens(rid)
            tables.append_tokens(rid, rng.randrange(0, min(room, 2 * BS) + 1))
        else:
            batch = rng.sample(ids, rng.randrange(1, len(ids) + 1))
            counts = [
                rng.randrange(0, min(MAX_BLOCKS * BS - tables.num_tokens(r), 5) + 1) for r in batch
            ]
            tables.append_tokens_many(batch, counts)
    tables.check_invariants()
    tables.pool.check_invariants(exact_refs=True)


def test_stream_and_array_interfaces(cp: Any, pool: Pool, stream: Any, tables: BlockTables) -> None:
    assert pool.device.startswith("cuda") and pool.stream is not None
    _version, handle = pool.stream.__cuda_stream__()
    assert handle == pool.stream.ptr == stream.ptr != 0
    tables.add(1, 20)
    table, seq_lens = tables.sync()
    for array, shape in ((table, (1, MAX_BLOCKS)), (seq_lens, (1,))):
        cai = array.__cuda_array_interface__
        assert cai["version"] == 3 and cai["typestr"] == "<i4" and cai["stream"] == stream.ptr
        assert tuple(cai["shape"]) == tuple(array.shape) == shape and array.stream == stream.ptr


@pytest.mark.parametrize("seed", range(4))
def test_uploaded_table_equals_the_host_table(
    cp: Any, stream: Any, tables: BlockTables, seed: int
) -> None:
    rng = random.Random(seed)
    next_id = [0]
    for _ in range(30):
        mutate(tables, rng, rng.randrange(1, 12), next_id)
        table, seq_lens = tables.sync()
        expected_table, expected_lens = host_state(tables)
        with stream:  # read on the pool's stream
            got_table = cp.asarray(table).get()
            got_lens = cp.asarray(seq_lens).get()
        stream.synchronize()
        np.testing.assert_array_equal(got_table, expected_table)
        np.testing.assert_array_equal(got_lens, expected_lens)


def test_upload_behind_a_long_kernel_is_ordered(
    cp: Any, kernels: Any, stream: Any, tables: BlockTables
) -> None:
    rng = random.Random(7)
    next_id = [0]
    mutate(tables, rng, 40, next_id)
    tables.sync()
    snaps = Snapshots(cp, kernels, stream, 1)
    spin(kernels, stream)
    mutate(tables, rng, 40, next_id)
    table, seq_lens = tables.sync()
    expected = host_state(tables)
    assert not stream.done, "the upload should still be queued behind the spin kernel"
    snaps.take(table, seq_lens)
    cp.cuda.runtime.deviceSynchronize()
    got = snaps.get(0)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


def test_mutating_after_sync_never_corrupts_the_in_flight_copy(
    cp: Any, kernels: Any, stream: Any, tables: BlockTables
) -> None:
    """Sync, then rewrite most rows and sync again while the first copy is still queued: the
    kernel between the two syncs must see the first state, the one after them the second."""
    rng = random.Random(11)
    next_id = [0]
    for r in range(MAX_SEQS // 2):
        tables.add(r, rng.randrange(1, 4 * BS))
    next_id[0] = MAX_SEQS
    tables.sync()
    snaps = Snapshots(cp, kernels, stream, 3)
    spin(kernels, stream)

    first = host_state(tables)
    snaps.take(*tables.sync())
    assert not stream.done
    tables.append_tokens_many(tables.request_ids(), BS)  # every row takes a block
    mutate(tables, rng, 200, next_id)
    second = host_state(tables)
    snaps.take(*tables.sync())
    # A third sync reuses the first staging buffer: it must wait for the first copy.
    mutate(tables, rng, 200, next_id)
    third = host_state(tables)
    snaps.take(*tables.sync())

    cp.cuda.runtime.deviceSynchronize()
    for i, expected in enumerate((first, second, third)):
        got = snaps.get(i)
        np.testing.assert_array_equal(got[0], expected[0], err_msg=f"snapshot {i}")
        np.testing.assert_array_equal(got[1], expected[1], err_msg=f"snapshot {i}")
    with stream:
        table, seq_lens = tables.sync()
        np.testing.assert_array_equal(raw_view(cp, table).get(), third[0])
        np.testing.assert_array_equal(raw_view(cp, seq_lens).get(), third[1])


@pytest.mark.parametrize("seed", range(3))
def test_many_syncs_in_flight(
    cp: Any, kernels: Any, stream: Any, tables: BlockTables, seed: int
) -> None:
    """Dozens of mutate + sync + snapshot rounds queued behind one spin kernel: every snapshot
    equals the host state at its sync (dirty-row tracking across both staging buffers)."""
    rng = random.Random(100 + seed)
    next_id = [0]
    rounds = 40
    snaps = Snapshots(cp, kernels, stream, rounds)
    spin(kernels, stream, SPIN_NS // 5)
    expected = []
    for _ in range(rounds):
        mutate(tables, rng, rng.randrange(0, 10), next_id)
        expected.append(host_state(tables))
        snaps.take(*tables.sync())
    cp.cuda.runtime.deviceSynchronize()
    for i, (table, seq_lens) in enumerate(expected):
        got = snaps.get(i)
        np.testing.assert_array_equal(got[0], table, err_msg=f"round {i}")
        np.testing.assert_array_equal(got[1], seq_lens, err_msg=f"round {i}")


def test_sync_on_a_callers_stream(cp: Any, kernels: Any, tables: BlockTables) -> None:
    other = cp.cuda.Stream(non_blocking=True)
    tables.add(1, 3 * BS + 1)
    tables.add(2, 1)
    snaps = Snapshots(cp, kernels, other, 1)
    spin(kernels, other)
    table, seq_lens = tables.sync(stream=other)
    assert table.__cuda_array_interface__["stream"] == other.ptr
    expected = host_state(tables)
    snaps.take(table, seq_lens)
    cp.cuda.runtime.deviceSynchronize()
    got = snaps.get(0)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


def test_empty_tables_sync(cp: Any, stream: Any, tables: BlockTables) -> None:
    table, seq_lens = tables.sync()
    assert tuple(table.shape) == (0, MAX_BLOCKS) and tuple(seq_lens.shape) == (0,)
    tables.add(1, 5)
    tables.free(1)
    table, _ = tables.sync()
    with stream:
        assert cp.asarray(table).shape == (0, MAX_BLOCKS)
