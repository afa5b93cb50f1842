"""Torch-native kernel calls on a GPU: torch tensors in, torch tensors of q's dtype out; a call
without `stream` inside ``with torch.cuda.stream(s):`` runs on `s`; BlockTables.sync's device
arrays through DLPack (int32, the upload waited for on the consumer's stream)."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from attention_inputs import shuffled_tables
from gpu_fixtures import SPIN_SOURCE, cp, cuda_pool

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def _batch(rng, pool, lens):
    tables = shuffled_tables(rng, lens, pool.layout.block_size, pool.num_blocks, extra=2)
    cp.cuda.Device().synchronize()  # the pool's random fill ran on CuPy's stream
    return torch.from_numpy(tables).cuda(), torch.from_numpy(lens).cuda()


def test_decode_without_out_returns_a_bfloat16_tensor_equal_to_the_out_form():
    rng = np.random.default_rng(11)
    lens = np.array([40, 3, 97], np.int32)
    pool = cuda_pool(rng, 2, 128, 16, "bfloat16", 40, 1)
    bt, sl = _batch(rng, pool, lens)
    q = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16)
    got = kvpool.paged_attention_decode(q, pool, 0, bt, sl, max_seq_len=int(lens.max()))
    assert isinstance(got, torch.Tensor)
    assert got.dtype == torch.bfloat16 and got.device == q.device and got.shape == q.shape
    out = torch.full_like(q, float("nan"))
    kvpool.paged_attention_decode(q, pool, 0, bt, sl, out=out, max_seq_len=int(lens.max()))
    torch.cuda.synchronize()
    assert torch.equal(got, out)


def test_prefill_without_out_returns_a_float16_tensor_equal_to_the_out_form():
    rng = np.random.default_rng(12)
    lens = np.array([20, 35], np.int32)
    qo = np.array([0, 7, 7 + 35], np.int32)
    pool = cuda_pool(rng, 2, 64, 16, "float16", 20, 1)
    bt, _ = _batch(rng, pool, lens)
    q = torch.randn(int(qo[-1]), 4, 64, device="cuda", dtype=torch.float16)
    got = kvpool.paged_attention_prefill(q, pool, 0, qo, bt, lens)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float16
    out = torch.full_like(q, float("nan"))
    kvpool.paged_attention_prefill(q, pool, 0, qo, bt, lens, out=out)
    torch.cuda.synchronize()
    assert torch.equal(got, out)


def test_plans_and_calls_without_a_stream_follow_torchs_current_stream():
    rng = np.random.default_rng(13)
    lens = np.array([10, 30], np.int32)
    pool = cuda_pool(rng, 2, 64, 16, "bfloat16", 12, 1)
    bt, sl = _batch(rng, pool, lens)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        plan = kvpool.decode_plan(pool, bt, sl, 4, max_seq_len=30)
        assert plan.stream == s.cuda_stream
        qo = np.array([0, 2, 4], np.int32)
        pre = kvpool.prefill_plan(pool, qo, bt, lens, 4)
        assert pre.stream == s.cuda_stream
        q = torch.randn(2, 4, 64, device="cuda", dtype=torch.bfloat16)
        out = plan.run(q, 0)
        # the one-call form: q is a torch tensor, so s even with CuPy batch arrays
        cbt, csl = cp.asarray(bt.cpu().numpy()), cp.asarray(lens)
        cp.cuda.Device().synchronize()
        again = kvpool.paged_attention_decode(q, pool, 0, cbt, csl, max_seq_len=30)
    s.synchronize()
    assert torch.equal(out, again)


def test_sync_arrays_through_dlpack_are_int32_tensors_that_wait_for_the_upload():
    layout = kvpool.KvLayout(1, 1, 64, 16)
    pool = kvpool.Pool(layout, 64, device="cuda")
    tables = kvpool.BlockTables(pool, 4, 8)
    for rid, n in enumerate((5, 40, 17)):
        tables.add(rid, n)
    spin = cp.RawModule(code=SPIN_SOURCE).get_function("spin")
    pool_stream = cp.cuda.Stream.from_external(pool.stream)
    with pool_stream:
        spin((1,), (1,), (np.uint64(50_000_000),))  # 50 ms: the upload queues behind it
    table, seq_lens = tables.sync()
    assert table.__dlpack_device__() == (2, 0)
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        t_table, t_lens = torch.from_dlpack(table), torch.from_dlpack(seq_lens)
        copies = t_table.clone(), t_lens.clone()  # on `consumer`: after the upload
    consumer.synchronize()
    assert t_table.dtype == torch.int32 and t_table.shape == (3, 8)
    assert t_table.data_ptr() == table.ptr
    want = tables.block_table(tables.request_ids())
    assert copies[0].cpu().numpy().tolist() == want.tolist()
    assert copies[1].cpu().numpy().tolist() == [5, 40, 17]
    with pytest.raises(kvpool.InvalidArgumentError, match="reserved"):
        table.__dlpack__(stream=0)
    with pytest.raises(BufferError, match="copy"):
        table.__dlpack__(copy=True)
