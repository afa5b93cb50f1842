"""Decode and prefill plans on a CUDA pool (marker `gpu`): a plan of another batch with the
same totals, of another pool or of the wrong type is refused before a launch; scale and stream
are checked as on a host pool; runs of one plan over every layer match the one-call form. Torch
tensors of their true dtypes (bfloat16) go in and come out of attention and append_kv, on a CUDA
pool and on a host pool (skipped without torch)."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from attention_check import assert_attention_close
from attention_inputs import qo_indptr, random_elems, shuffled_tables
from gpu_fixtures import NAN_BITS, cp, cuda_pool, device_elems, poisoned
from kvpool import reference
from kvpool.kernels import (
    append_kv,
    decode_plan,
    paged_attention_decode,
    paged_attention_prefill,
    prefill_plan,
)

pytestmark = pytest.mark.gpu
ERR = kvpool.InvalidArgumentError


class Batch:
    """A 2-layer CUDA pool and a 3-sequence batch on it (device arrays)."""

    def __init__(self, seed: int, dtype: str = "float16", lens=(5, 40, 17), qo=(1, 6, 17)):
        rng = np.random.default_rng(seed)
        self.dtype = dtype
        self.lens = np.array(lens, np.int32)
        self.pool = cuda_pool(rng, 2, 64, 8, dtype, sum(-(-int(n) // 8) for n in lens) + 8, 2)
        self.tables = shuffled_tables(rng, self.lens, 8, self.pool.num_blocks, extra=2)
        self.indptr = qo_indptr(list(qo))
        self.bt, self.sl = cp.asarray(self.tables), cp.asarray(self.lens)
        self.ip = cp.asarray(self.indptr)
        self.q = device_elems(rng, (len(lens), 4, 64), dtype)
        self.pq = device_elems(rng, (int(self.indptr[-1]), 4, 64), dtype)

    def want_decode(self, layer: int, scale=None):
        k, v = (cp.asnumpy(cp.asarray(f(layer))) for f in (self.pool.k_view, self.pool.v_view))
        return reference.paged_attention_decode(
            cp.asnumpy(self.q), k, v, self.tables, self.lens, self.dtype, scale
        )


def _untouched(out, dtype):
    cp.cuda.runtime.deviceSynchronize()
    assert (out.view(cp.uint16) == NAN_BITS[dtype]).all(), "a kernel ran"


def test_a_cuda_plan_of_another_batch_with_the_same_totals_is_refused():
    """Before, the check compared (num_seqs, total_q, heads, causal) only: this passed."""
    b = Batch(1)
    out = poisoned(b.pq.shape, "float16")
    other_lens = cp.asarray(np.array([6, 39, 17], np.int32))
    other_ip = cp.asarray(qo_indptr([2, 5, 17]))
    plan = prefill_plan(b.pool, b.indptr, b.bt, b.lens, 4)  # host lengths: the plan's copies
    for ip, sl in ((other_ip, b.sl), (b.ip, other_lens), (b.ip, b.sl)):
        with pytest.raises(ERR, match="not the array the plan was made for"):
            paged_attention_prefill(b.pq, b.pool, 0, ip, b.bt, sl, out=out, plan=plan)
    with pytest.raises(ERR, match="block_tables is not"):
        paged_attention_prefill(b.pq, b.pool, 0, b.indptr, b.bt.copy(), b.lens, out=out, plan=plan)
    from_device = prefill_plan(b.pool, b.ip, b.bt, b.sl, 4)  # the caller's device lengths
    with pytest.raises(ERR, match="seq_lens is not"):
        paged_attention_prefill(b.pq, b.pool, 0, b.ip, b.bt, other_lens, out=out, plan=from_device)
    dplan = decode_plan(b.pool, b.bt, b.sl, 4, max_seq_len=40)
    with pytest.raises(ERR, match="seq_lens is not"):
        paged_attention_decode(b.q, b.pool, 0, b.bt, other_lens, out=out[:3], plan=dplan)
    with pytest.raises(ERR, match="another pool"):
        paged_attention_decode(b.q, Batch(2).pool, 0, b.bt, b.sl, out=out[:3], plan=dplan)
    with pytest.raises(TypeError, match="DecodePlan"):
        paged_attention_decode(b.q, b.pool, 0, b.bt, b.sl, out=out[:3], plan=plan)
    _untouched(out, "float16")
    # The plan's own arrays pass, and give the one-call result.
    got = paged_attention_prefill(b.pq, b.pool, 1, b.indptr, b.bt, list(b.lens), plan=plan)
    assert cp.array_equal(got, paged_attention_prefill(b.pq, b.pool, 1, b.ip, b.bt, b.sl))
    assert cp.array_equal(from_device.run(b.pq, 1), got)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), True])
def test_a_bad_scale_is_refused_before_a_launch(scale):
    b = Batch(3)
    out = poisoned(b.q.shape, "float16")
    error = TypeError if scale is True else ERR
    with pytest.raises(error, match="scale"):
        paged_attention_decode(b.q, b.pool, 0, b.bt, b.sl, out=out, scale=scale, max_seq_len=40)
    with pytest.raises(error, match="scale"):
        prefill_plan(b.pool, b.indptr, b.bt, b.lens, 4, scale=scale)
    _untouched(out, "float16")


@pytest.mark.parametrize("stream", [1, "x", 2.5])
def test_a_bad_stream_is_refused_as_on_a_host_pool(stream):
    # Neither an int, a str nor a float is a stream (no __cuda_stream__): a TypeError.
    b = Batch(4)
    out = poisoned(b.q.shape, "float16")
    with pytest.raises(TypeError, match="stream"):
        paged_attention_decode(b.q, b.pool, 0, b.bt, b.sl, out=out, stream=stream, max_seq_len=40)
    with pytest.raises(TypeError, match="stream"):
        prefill_plan(b.pool, b.indptr, b.bt, b.lens, 4, stream=stream)
    _untouched(out, "float16")


def test_one_decode_plan_runs_every_layer():
    b = Batch(5, "bfloat16", lens=(700, 3, 129), qo=(1, 1, 1))
    plan = decode_plan(b.pool, b.bt, b.sl, 4, num_splits=4, scale=0.2)
    assert plan.split and plan.counters is not None
    for layer in range(2):
        out = poisoned(b.q.shape, "bfloat16")
        assert plan.run(b.q, layer, out=out) is out
        assert_attention_close(out, b.want_decode(layer, 0.2), "bfloat16", f"plan layer {layer}")
    assert int(cp.count_nonzero(plan.counters)) == 0


def test_torch_tensors_in_and_out_on_a_cuda_pool():
    torch = pytest.importorskip("torch")
    b = Batch(6, "bfloat16")
    tq = torch.as_tensor(b.q.view(cp.int16), device="cuda").view(torch.bfloat16)  # true dtype
    bt, sl = torch.as_tensor(b.bt, device="cuda"), torch.as_tensor(b.sl, device="cuda")
    res = paged_attention_decode(tq, b.pool, 1, bt, sl)
    assert isinstance(res, torch.Tensor) and res.dtype == torch.bfloat16 and res.is_cuda
    got = res.view(torch.int16).cpu().numpy().view(np.uint16)
    assert_attention_close(got, b.want_decode(1), "bfloat16", "torch decode")
    out = torch.full_like(tq, float("nan"))
    assert paged_attention_decode(tq, b.pool, 1, bt, sl, out=out) is out
    assert torch.equal(out, res)
    tpq = torch.as_tensor(b.pq.view(cp.int16), device="cuda").view(torch.bfloat16)
    pres = prefill_plan(b.pool, b.indptr, bt, b.lens, 4).run(tpq, 1)
    assert isinstance(pres, torch.Tensor) and pres.dtype == torch.bfloat16
    want = paged_attention_prefill(b.pq, b.pool, 1, b.ip, b.bt, b.sl)
    assert np.array_equal(pres.view(torch.int16).cpu().numpy().view(np.uint16), cp.asnumpy(want))
    # append_kv of bfloat16 tensors writes the same bytes as the 2-byte integer fallback.
    k = torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([0, 9, 17], device="cuda", dtype=torch.int64)
    append_kv(k, k, b.pool, 0, slots)
    kc = cp.asarray(b.pool.k_view(0)).view(cp.uint16)  # [num_blocks, block_size, heads, dim]
    bits = cp.asarray(k.view(torch.int16)).view(cp.uint16)
    where = cp.asarray(slots)
    assert cp.array_equal(kc[where // 8, where % 8], bits)


def test_torch_tensors_in_and_out_on_a_host_pool():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    pool = kvpool.Pool(kvpool.KvLayout(1, 2, 64, 8, "bfloat16"), 16, device="host")
    lens = np.array([5, 20], np.int32)
    tables = shuffled_tables(rng, lens, 8, pool.num_blocks)
    bits = random_elems(rng, (int(lens.sum()), 2, 64), "bfloat16")
    k = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    slots = np.concatenate(
        [tables[i, np.arange(n) // 8] * 8 + np.arange(n) % 8 for i, n in enumerate(lens)]
    ).astype(np.int64)
    append_kv(k, k, pool, 0, torch.from_numpy(slots))
    kc = np.asarray(pool.k_view(0)).view(np.uint16)
    assert np.array_equal(kc[slots // 8, slots % 8], bits)
    q_bits = random_elems(rng, (2, 4, 64), "bfloat16")
    tq = torch.from_numpy(q_bits.view(np.int16)).view(torch.bfloat16)
    res = paged_attention_decode(tq, pool, 0, tables, lens)
    assert isinstance(res, torch.Tensor) and res.dtype == torch.bfloat16
    want = paged_attention_decode(q_bits, pool, 0, tables, lens)  # the 2-byte fallback
    assert np.array_equal(res.view(torch.int16).numpy().view(np.uint16), want)
    out = torch.zeros_like(tq)
    assert paged_attention_decode(tq, pool, 0, tables, lens, out=out) is out
    assert torch.equal(out, res)
