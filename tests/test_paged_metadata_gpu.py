"""The paged_metadata kernel against its NumPy reference (marker `gpu`): slot mappings and
FlashInfer CSR page tables of random ragged steps (more sequences than the kernel's 1024
threads, so the scan carries across chunks), outputs poisoned before every launch, and a
CUDA graph captured once and replayed over new tables and lengths in the same buffers."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from gpu_fixtures import cp
from kvpool import reference

pytestmark = pytest.mark.gpu
POISON = -7777


class Buffers:
    """Caller-owned device buffers of one step shape, and the host values behind them."""

    def __init__(self, num_seqs, width, num_slots):
        self.table = cp.zeros((num_seqs, width), cp.int32)
        self.lens = cp.zeros(num_seqs, cp.int32)
        self.qo = cp.zeros(num_seqs + 1, cp.int32)
        self.slots = cp.empty(num_slots, cp.int64)
        self.indptr = cp.empty(num_seqs + 1, cp.int32)
        self.indices = cp.empty(num_seqs * width + 3, cp.int32)
        self.last = cp.empty(num_seqs, cp.int32)

    def fill(self, rng, block_size, max_new):
        """New random table, lengths and step offsets in place; the outputs poisoned."""
        n, width = self.table.shape
        table = rng.integers(0, 1 << 20, (n, width)).astype(np.int32)
        lens = rng.integers(0, width * block_size + 1, n).astype(np.int32)
        new = np.minimum(lens, rng.integers(0, max_new + 1, n))
        qo = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
        assert qo[-1] <= self.slots.size
        for dev, host in ((self.table, table), (self.lens, lens), (self.qo, qo)):
            dev.set(host)
        for out in (self.slots, self.indptr, self.indices, self.last):
            out.fill(POISON)
        return table, lens, qo

    def launch(self, block_size, stream=None):
        kvpool.paged_metadata(
            self.table,
            self.lens,
            block_size,
            qo_indptr=self.qo,
            slot_mapping=self.slots,
            indptr=self.indptr,
            indices=self.indices,
            last_page_len=self.last,
            stream=stream,
        )

    def check(self, host, block_size):
        table, lens, qo = host
        want = reference.paged_metadata(
            table, lens, block_size, qo, self.slots.size, self.indices.size
        )
        got = [x.get() for x in (self.slots, self.indptr, self.indices, self.last)]
        for name, g, w in zip(("slot_mapping", "indptr", "indices", "last_page_len"), got, want):
            np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.parametrize(
    ("num_seqs", "width", "block_size", "max_new"),
    [
        (1, 1, 16, 16),
        (5, 9, 16, 1),
        (37, 64, 16, 300),
        (1500, 17, 8, 3),
        (3000, 4, 1, 2),
        (0, 4, 16, 1),
    ],
)
def test_kernel_equals_the_reference(num_seqs, width, block_size, max_new):
    rng = np.random.default_rng(num_seqs)
    buf = Buffers(num_seqs, width, num_slots=num_seqs * max_new + 7)
    for _ in range(3):
        host = buf.fill(rng, block_size, max_new)
        buf.launch(block_size)
        buf.check(host, block_size)


def test_the_check_sees_a_wrong_entry():
    rng = np.random.default_rng(1)
    buf = Buffers(40, 8, 400)
    host = buf.fill(rng, 16, 10)
    buf.launch(16)
    buf.indices[int(buf.indptr[3].get())] += 1
    with pytest.raises(AssertionError, match="indices"):
        buf.check(host, 16)


def test_a_captured_graph_replays_over_new_tables_in_the_same_buffers():
    """Captured once on a stream, replayed 5 times: each replay after new values were copied
    into the same input buffers (and the outputs poisoned) gives the reference's output."""
    rng = np.random.default_rng(2)
    buf = Buffers(300, 12, 300 * 8)
    stream = cp.cuda.Stream(non_blocking=True)
    host = buf.fill(rng, 16, 8)
    buf.launch(16, stream)  # compiles and loads the kernel outside the capture
    stream.synchronize()
    buf.check(host, 16)
    with stream:
        stream.begin_capture()
        buf.launch(16, stream)
        graph = stream.end_capture()
    for _ in range(5):
        host = buf.fill(rng, 16, 8)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        buf.check(host, 16)


def test_bad_arguments_raise_before_anything_runs():
    buf = Buffers(4, 3, 10)
    with pytest.raises(kvpool.InvalidArgumentError, match="indices must hold"):
        kvpool.paged_metadata(
            buf.table,
            buf.lens,
            16,
            indptr=buf.indptr,
            indices=buf.indices[:5],
            last_page_len=buf.last,
        )
    with pytest.raises(kvpool.InvalidArgumentError, match="int64"):
        kvpool.paged_metadata(buf.table, buf.lens, 16, qo_indptr=buf.qo, slot_mapping=buf.indptr)
    with pytest.raises(kvpool.InvalidArgumentError, match="qo_indptr and slot_mapping"):
        kvpool.paged_metadata(buf.table, buf.lens, 16, slot_mapping=buf.slots)
    with pytest.raises(TypeError, match="block_size"):  # a bool is not an integer here
        kvpool.paged_metadata(buf.table, buf.lens, True, slot_mapping=buf.slots, qo_indptr=buf.qo)
