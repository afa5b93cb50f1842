"""Decode and prefill plans on a host pool, without a GPU: plan once, run per layer, the same
results as the one-call forms; a plan is bound to its pool and batch, and refuses anything
else (a wrong type with TypeError, a wrong value with InvalidArgumentError); the softmax scale
and the stream are checked as on a CUDA pool; parameter blocks are filled by field name."""

from __future__ import annotations

import ctypes

import kvpool
import numpy as np
import pytest
from attention_inputs import fill_host_pool, qo_indptr, random_elems, shuffled_tables
from kvpool import reference
from kvpool.kernels import (
    DecodePlan,
    PrefillPlan,
    append_kv,
    copy_blocks,
    decode_plan,
    paged_attention_decode,
    paged_attention_prefill,
    prefill_plan,
)
from kvpool.kernels._launch import fill_args

ERR = kvpool.InvalidArgumentError


class Batch:
    """A host pool of 2 layers and a 3-sequence batch on it: decode and prefill arrays."""

    def __init__(self, seed: int, lens=(5, 40, 17), qo=(1, 6, 17)) -> None:
        rng = np.random.default_rng(seed)
        layout = kvpool.KvLayout(2, 2, 64, 8, "float16")
        self.pool = fill_host_pool(kvpool.Pool(layout, 32, device="host"), rng)
        self.lens = np.array(lens, np.int32)
        self.tables = shuffled_tables(rng, self.lens, 8, self.pool.num_blocks)
        self.indptr = qo_indptr(list(qo))
        self.q = random_elems(rng, (len(lens), 4, 64), "float16")
        self.pq = random_elems(rng, (int(self.indptr[-1]), 4, 64), "float16")

    def decode(self, **kw):
        return paged_attention_decode(self.q, self.pool, 1, self.tables, self.lens, **kw)

    def prefill(self, **kw):
        return paged_attention_prefill(
            self.pq, self.pool, 1, self.indptr, self.tables, self.lens, **kw
        )


def test_a_decode_plan_runs_every_layer_like_the_one_call_form():
    b = Batch(1)
    plan = decode_plan(b.pool, b.tables, b.lens, 4, scale=0.3)
    assert isinstance(plan, DecodePlan) and plan.num_seqs == 3 and not plan.split
    for layer in range(2):
        want = paged_attention_decode(b.q, b.pool, layer, b.tables, b.lens, scale=0.3)
        assert np.array_equal(plan.run(b.q, layer), want)
        out = np.zeros_like(b.q)
        assert plan.run(b.q, layer, out=out) is out and np.array_equal(out, want)
        one_call = paged_attention_decode(b.q, b.pool, layer, b.tables, b.lens, plan=plan)
        assert np.array_equal(one_call, want)
    exact = reference.paged_attention_decode(
        b.q, b.pool.k_view(0), b.pool.v_view(0), b.tables, b.lens, "float16", 0.3
    )
    assert np.array_equal(plan.run(b.q, 0), reference.from_float64(exact, "float16"))


def test_a_prefill_plan_runs_every_layer_like_the_one_call_form():
    b = Batch(2)
    plan = prefill_plan(b.pool, b.indptr, b.tables, b.lens, 4, causal=False, scale=0.2)
    assert isinstance(plan, PrefillPlan) and plan.total_q == 24 and plan.num_seqs == 3
    for layer in range(2):
        want = paged_attention_prefill(
            b.pq, b.pool, layer, b.indptr, b.tables, b.lens, causal=False, scale=0.2
        )
        assert np.array_equal(plan.run(b.pq, layer), want)
        # The very arrays, or host arrays of equal contents, pass with the plan.
        again = paged_attention_prefill(
            b.pq, b.pool, layer, b.indptr.copy(), b.tables, list(b.lens), causal=False, plan=plan
        )
        assert np.array_equal(again, want)


def test_a_plan_of_the_wrong_type_is_a_type_error():
    b = Batch(3)
    for bad in ("x", 3, object()):
        with pytest.raises(TypeError, match="DecodePlan"):
            b.decode(plan=bad)
        with pytest.raises(TypeError, match="PrefillPlan"):
            b.prefill(plan=bad)
    with pytest.raises(TypeError, match="DecodePlan"):
        b.decode(plan=prefill_plan(b.pool, b.indptr, b.tables, b.lens, 4))
    with pytest.raises(TypeError, match="PrefillPlan"):
        b.prefill(plan=decode_plan(b.pool, b.tables, b.lens, 4))


def test_a_plan_of_another_pool_is_refused():
    a, b = Batch(4), Batch(4)  # equal pools, equal batches: only the pool differs
    with pytest.raises(ERR, match="another pool"):
        a.decode(plan=decode_plan(b.pool, b.tables, b.lens, 4))
    with pytest.raises(ERR, match="another pool"):
        a.prefill(plan=prefill_plan(b.pool, b.indptr, b.tables, b.lens, 4))


def test_a_plan_of_another_batch_with_the_same_totals_is_refused():
    b = Batch(5)
    # Same num_seqs, total_q, heads and causality; other lengths, other tables.
    other_lens = np.array([6, 39, 17], np.int32)
    other_indptr = qo_indptr([2, 5, 17])
    other_tables = np.where(b.tables >= 0, (b.tables + 1) % b.pool.num_blocks, -1).astype(np.int32)
    with pytest.raises(ERR, match="seq_lens is not the array the plan was made for"):
        b.decode(plan=decode_plan(b.pool, b.tables, other_lens, 4))
    with pytest.raises(ERR, match="block_tables is not"):
        b.decode(plan=decode_plan(b.pool, other_tables, b.lens, 4))
    with pytest.raises(ERR, match="qo_indptr is not"):
        b.prefill(plan=prefill_plan(b.pool, other_indptr, b.tables, b.lens, 4))
    with pytest.raises(ERR, match="seq_lens is not"):
        b.prefill(plan=prefill_plan(b.pool, b.indptr, b.tables, other_lens, 4))
    with pytest.raises(ERR, match="block_tables is not"):
        b.prefill(plan=prefill_plan(b.pool, b.indptr, other_tables, b.lens, 4))
    with pytest.raises(ERR, match="causal"):
        b.prefill(plan=prefill_plan(b.pool, b.indptr, b.tables, b.lens, 4, causal=False))


def test_the_plans_own_arguments_are_not_given_again():
    b = Batch(6)
    dplan = decode_plan(b.pool, b.tables, b.lens, 4)
    pplan = prefill_plan(b.pool, b.indptr, b.tables, b.lens, 4)
    for kw in ({"scale": 0.5}, {"num_splits": 2}, {"max_seq_len": 40}):
        with pytest.raises(ERR, match="the plan's own arguments"):
            b.decode(plan=dplan, **kw)
    for kw in ({"scale": 0.5}, {"num_splits": 2}):
        with pytest.raises(ERR, match="the plan's own arguments"):
            b.prefill(plan=pplan, **kw)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), np.float32("nan")])
def test_a_non_finite_scale_is_refused(scale):
    b = Batch(7)
    with pytest.raises(ERR, match="scale must be finite"):
        b.decode(scale=scale)
    with pytest.raises(ERR, match="scale must be finite"):
        b.prefill(scale=scale)
    with pytest.raises(ERR, match="scale must be finite"):
        decode_plan(b.pool, b.tables, b.lens, 4, scale=scale)


@pytest.mark.parametrize("scale", [True, False, np.bool_(True), "0.5", [0.5]])
def test_a_scale_of_the_wrong_type_is_a_type_error(scale):
    b = Batch(8)
    with pytest.raises(TypeError, match="scale must be a real number"):
        b.decode(scale=scale)
    with pytest.raises(TypeError, match="scale must be a real number"):
        b.prefill(scale=scale)


def test_integer_and_numpy_scales_are_taken():
    b = Batch(9)
    assert np.array_equal(b.decode(scale=np.float32(0.25)), b.decode(scale=0.25))
    assert np.array_equal(b.prefill(scale=1), b.prefill(scale=1.0))


@pytest.mark.parametrize("stream", [1, 0, "x"])
def test_a_stream_on_a_host_pool_is_refused_as_by_tables_sync(stream):
    b = Batch(10)
    tables = kvpool.BlockTables(b.pool, 2, 4)
    with pytest.raises(ERR, match="a stream was given, but the pool is on the host") as sync:
        tables.sync(stream)
    for call in (
        lambda: b.decode(stream=stream),
        lambda: b.prefill(stream=stream),
        lambda: decode_plan(b.pool, b.tables, b.lens, 4, stream=stream),
        lambda: prefill_plan(b.pool, b.indptr, b.tables, b.lens, 4, stream=stream),
        lambda: copy_blocks(b.pool, np.array([[0, 1]]), stream=stream),
        lambda: append_kv(
            b.q[:, :2], b.q[:, :2], b.pool, 0, np.array([0, 1, 2], np.int64), stream=stream
        ),
    ):
        with pytest.raises(ERR, match="a stream was given, but the pool is on the host"):
            call()
    assert sync.type is ERR


def test_a_host_plan_takes_no_workspace_and_rechecks_its_tables():
    b = Batch(11)
    with pytest.raises(ERR, match="no workspace"):
        b.decode(workspace=np.zeros(1 << 16, np.float32))
    plan = decode_plan(b.pool, b.tables, b.lens, 4)
    b.tables[0, 0] = 99  # the bound array changed after the plan: refused at run
    with pytest.raises(ERR, match="outside the pool"):
        plan.run(b.q, 0)


def test_run_checks_q_and_layer_against_the_plan():
    b = Batch(12)
    plan = decode_plan(b.pool, b.tables, b.lens, 4)
    with pytest.raises(ERR, match="q must be"):
        plan.run(b.q[:2], 0)
    with pytest.raises(ERR, match="q must be"):
        plan.run(np.zeros((3, 2, 64), np.float16), 0)
    for layer in (2, -1):
        with pytest.raises(ERR, match="layer"):
            plan.run(b.q, layer)
    with pytest.raises(ERR, match="num_q_heads"):
        decode_plan(b.pool, b.tables, b.lens, 3)


def test_parameter_blocks_are_filled_by_field_name():
    class Args(ctypes.Structure):
        _fields_ = [("a", ctypes.c_int32), ("b", ctypes.c_uint64)]

    args = fill_args(Args, b=7, a=-2)
    assert (args.a, args.b) == (-2, 7)
    with pytest.raises(TypeError, match=r"missing fields \['b'\]"):
        fill_args(Args, a=1)
    with pytest.raises(TypeError, match=r"unknown \['c'\]"):
        fill_args(Args, a=1, b=2, c=3)


def test_a_prefill_plan_says_whether_it_splits():
    b = Batch(13, lens=(130, 40, 17), qo=(2, 6, 17))
    assert not prefill_plan(b.pool, b.indptr, b.tables, b.lens, 4).split
    forced = prefill_plan(b.pool, b.indptr, b.tables, b.lens, 4, num_splits=2)
    assert forced.split and forced.num_splits == 2 and forced.work.split
