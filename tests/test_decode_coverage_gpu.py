"""The tensor-core decode over its whole supported set, against the float64 reference (GPU).

Sampled cross product, every output (sequence, query head) checked on its own by
tests/attention_check.py (relative L2 per row, per-dtype bounds): every head_dim (multiples of 8 in 32..256) at one block size, every block size (1..256)
at one head_dim, group sizes 1..8, a ragged 17 (two head tiles of 9 and 8), 12 and MQA, in both
dtypes; ragged lengths with 1, block-end and capacity-end lengths; pools with no spare block
(so the tables use block 0 and the pool's last block); forced splits through the fused merge,
also back to back and under CUDA-graph replays (the merge counters must come back to zero).
Outputs are poisoned with NaN before every call. A mutation case shows the check fails on the
kernel's real output against a reference that misses one token.
"""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from attention_check import as_float64, assert_attention_close, decode_reference_without_token
from attention_inputs import random_elems
from gpu_fixtures import NAN_BITS, cp, cuda_pool, poisoned, to_device
from kvpool import reference
from kvpool.kernels import _build, decode_plan, paged_attention_decode, workspace_elems

pytestmark = pytest.mark.gpu


def _pool(rng, hkv, d, bs, dtype, num_blocks):
    """A one-layer CUDA pool filled with N(0, 1) elements; returns (pool, k host, v host)."""
    pool = cuda_pool(rng, hkv, d, bs, dtype, num_blocks, 1)
    return pool, cp.asnumpy(cp.asarray(pool.k_view(0))), cp.asnumpy(cp.asarray(pool.v_view(0)))


def _tight_tables(rng, lens, bs, extra_cols=0):
    """Tables that use every block of a pool of exactly sum(ceil(len / bs)) blocks (block 0 and
    the last block included), shuffled; `extra_cols` unused (-1) columns."""
    need = [-(-int(n) // bs) for n in lens]
    ids = rng.permutation(sum(need)).astype(np.int32)
    tables = np.full((len(lens), max(need) + extra_cols), -1, dtype=np.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[at : at + n]
        at += n
    return tables, sum(need)


class Case:
    """One pool + tables + q; `check` runs the kernel (any keyword arguments) and compares."""

    def __init__(self, seed, dtype, d, bs, hq, hkv, lens, extra_cols=0):
        rng = np.random.default_rng(seed)
        self.dtype, self.lens = dtype, np.asarray(lens, np.int32)
        self.tables, nblk = _tight_tables(rng, self.lens, bs, extra_cols)
        self.pool, self.k, self.v = _pool(rng, hkv, d, bs, dtype, nblk)
        self.q_host = random_elems(rng, (len(lens), hq, d), dtype)
        self.q = to_device(self.q_host, dtype)
        self.bt, self.sl = cp.asarray(self.tables), cp.asarray(self.lens)
        self.want = reference.paged_attention_decode(
            self.q_host, self.k, self.v, self.tables, self.lens, dtype
        )

    def run(self, **kw):
        out = poisoned(self.q.shape, self.dtype)
        res = paged_attention_decode(self.q, self.pool, 0, self.bt, self.sl, out=out, **kw)
        assert res is out
        return as_float64(out, self.dtype)

    def check(self, label, **kw):
        assert_attention_close(self.run(**kw), self.want, self.dtype, label)


def _ragged(bs, cap_blocks):
    """1, a block end, one before and one past it, a mid-block end, and the capacity end of
    the tables (their width is the longest length's block count)."""
    lens = {1, bs, bs + 1, 2 * bs + max(1, bs // 2) - 1}
    if bs > 1:
        lens.add(bs - 1)
    cap_blocks = max(cap_blocks, -(-max(lens) // bs))
    return sorted(lens | {cap_blocks * bs})


HEAD_DIM_CASES = [("float16", d) for d in _build.TC_HEAD_DIMS] + [
    ("bfloat16", d) for d in (40, 72, 120, 200, 256)
]


@pytest.mark.parametrize(("dtype", "d"), HEAD_DIM_CASES)
def test_every_head_dim(dtype, d):
    lens = _ragged(16, 12)  # 1, 15, 16, 17, 39, 192
    case = Case([d, len(dtype), 1], dtype, d, 16, 8, 2, lens)
    case.check(f"head_dim[{dtype},d{d}]", max_seq_len=max(lens))
    case.check(f"head_dim[{dtype},d{d}]split3", max_seq_len=max(lens), num_splits=3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bs", _build.TC_BLOCK_SIZES)
def test_every_block_size(dtype, bs):
    cap_blocks = max(2, 600 // bs)  # a capacity-end length of >= 256 tokens
    lens = _ragged(bs, cap_blocks)
    case = Case([bs, len(dtype), 2], dtype, 128, bs, 8, 2, lens)
    top = max(lens)
    case.check(f"block_size[{dtype},bs{bs}]", max_seq_len=top)
    case.check(f"block_size[{dtype},bs{bs}]split4", max_seq_len=top, num_splits=4)


GROUPS = [(g, 2) for g in range(1, 9)] + [(12, 1), (17, 1), (32, 1)]  # group, hkv


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(("group", "hkv"), GROUPS)
def test_every_group(dtype, group, hkv):
    d = 80 if group % 2 else 128  # odd groups also run a padded-free non-power-of-two head dim
    lens = [1, 7, 16, 33, 150]
    case = Case([group, hkv, len(dtype), 3], dtype, d, 16, group * hkv, hkv, lens)
    case.check(f"group[{dtype},g{group},hkv{hkv},d{d}]", max_seq_len=150)
    case.check(f"group[{dtype},g{group},hkv{hkv},d{d}]split2", max_seq_len=150, num_splits=2)


def test_auto_split_small_pages_and_long_context():
    """The planned (not forced) split of a long single sequence over 1-token pages."""
    case = Case(41, "bfloat16", 96, 1, 16, 2, [5000])
    case.check("auto_split_bs1", max_seq_len=5000)
    case.check("auto_split_bs1_read_len")  # max_seq_len read from the device


def test_fused_merge_counters_reset_between_calls_and_graph_replays():
    """Back-to-back split calls with different grids on one stream, each with its own plan;
    then one plan run twice per replay of a captured graph with new q in place (its merge
    counters must be zero again after every launch), and the plan's own workspace and a
    caller's."""
    a = Case(50, "float16", 128, 16, 32, 8, [300, 1, 77])
    b = Case(51, "float16", 64, 8, 8, 1, [1000, 513, 16, 2, 999])
    for rep in range(2):
        a.check(f"seq_a{rep}", max_seq_len=300, num_splits=5)
        b.check(f"seq_b{rep}", max_seq_len=1000, num_splits=9)
        b.check(f"seq_b_auto{rep}", max_seq_len=1000)
    s = cp.cuda.Stream(non_blocking=True)
    for ws in (None, cp.empty(workspace_elems(5, 8, 64, 9), cp.float32)):
        out = poisoned(b.q.shape, "float16")
        with s:
            plan = decode_plan(b.pool, b.bt, b.sl, 8, max_seq_len=1000, num_splits=9, workspace=ws)
            # 9 forced splits of 1000 tokens, each rounded up to whole loop steps: 8 of 128
            assert plan.split and plan.counters is not None
            plan.run(b.q, 0, out=out)  # warm-up: compile, prepare the launch block
            s.synchronize()
            s.begin_capture()
            plan.run(b.q, 0, out=out)
            plan.run(b.q, 0, out=out)  # the same counters twice in one graph
            graph = s.end_capture()
        rng = np.random.default_rng(52)
        for rep in range(3):
            q_host = random_elems(rng, b.q.shape, "float16")
            b.q[...] = cp.asarray(q_host)
            out.view(cp.uint16)[...] = NAN_BITS["float16"]
            s.synchronize()
            cp.cuda.Device().synchronize()
            graph.launch(s)
            s.synchronize()
            want = reference.paged_attention_decode(q_host, b.k, b.v, b.tables, b.lens, "float16")
            label = f"graph_replay{rep}{'_ws' if ws is not None else ''}"
            assert_attention_close(as_float64(out, "float16"), want, "float16", label)
            # Every merging CTA reset its counter: the plan's counters are zero again.
            assert int(cp.count_nonzero(plan.counters)) == 0, "merge counters left non-zero"


def test_the_check_fails_on_a_one_token_error():
    """Mutation: the kernel's output against a reference in which one sequence misses one token
    (its last, or one at a block boundary) must be refused, with 1-token pages and 16-token ones,
    through the fused merge too."""
    for dtype in ("float16", "bfloat16"):
        for bs in (1, 16):
            case = Case([60, bs], dtype, 128, bs, 8, 2, [3, 17, 40, 200])
            for kw in ({"max_seq_len": 200}, {"max_seq_len": 200, "num_splits": 3}):
                got = case.run(**kw)
                assert_attention_close(got, case.want, dtype, f"unmutated {kw}")
                for seq, token in ((0, 2), (1, 16), (2, 15)):
                    mutated = decode_reference_without_token(
                        case.q_host, case.k, case.v, case.tables, case.lens, dtype, seq, token
                    )
                    with pytest.raises(AssertionError, match="exceed"):
                        assert_attention_close(got, mutated, dtype, f"mutated seq {seq}")


@pytest.mark.parametrize(
    ("d", "bs", "dtype"),
    [
        (36, 16, "float16"),
        (264, 16, "float16"),
        (128, 512, "float16"),
        (128, 24, "bfloat16"),
        (16, 16, "float16"),
    ],
)
def test_unsupported_shapes_fail_before_any_launch(d, bs, dtype):
    try:
        layout = kvpool.KvLayout(1, 2, d, bs, dtype)
    except kvpool.KvError:
        pytest.skip("the layout itself refuses this shape")
    pool = kvpool.Pool(layout, 4, device="cuda")
    q = poisoned((1, 4, d), dtype)
    out = poisoned((1, 4, d), dtype)
    bt = cp.zeros((1, 4), cp.int32)
    sl = cp.ones((1,), cp.int32)
    with pytest.raises(kvpool.InvalidArgumentError, match="supported: .*multiple of 8 in 32..256"):
        paged_attention_decode(q, pool, 0, bt, sl, out=out, max_seq_len=1)
    cp.cuda.Device().synchronize()
    assert (out.view(cp.uint16) == NAN_BITS[dtype]).all(), "a kernel ran"
