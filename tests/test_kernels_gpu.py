"""The CUDA kernels against the float64 reference on a GPU (marker `gpu`).

Fresh random inputs per case, shuffled block tables with unused (-1) columns, ragged lengths
(1, mid-block ends, exact block ends, long ones that split), outputs poisoned with NaN before
each run and checked fully written, per (sequence, head) by tests/attention_check.py. Set
KVPOOL_ERROR_REPORT=path to dump the measured errors (the largest row error of each case).
"""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from attention_check import assert_attention_close
from attention_inputs import shuffled_tables
from gpu_fixtures import (
    NAN_BITS,
    SPIN_SOURCE,
    cp,
    cuda_pool,
    device_elems,
    error_report,
    poisoned,
)
from kvpool import reference
from kvpool.kernels import (
    _build,
    _tuning,
    append_kv,
    copy_blocks,
    paged_attention_decode,
    workspace_elems,
)

pytestmark = pytest.mark.gpu


DTYPES = ["float16", "bfloat16"]
ERRORS: dict[str, float] = {}

_error_report = error_report(ERRORS)


def _check_decode(pool, layer, q, tables, lens, out, label, pipeline=_build.TC, **kw):
    lay = pool.layout
    with _tuning.override(decode_pipeline=pipeline):  # the kernel: a test knob
        res = paged_attention_decode(
            q, pool, layer, cp.asarray(tables), cp.asarray(lens), out=out, **kw
        )
    assert res is out
    k = cp.asnumpy(cp.asarray(pool.k_view(layer)))
    v = cp.asnumpy(cp.asarray(pool.v_view(layer)))
    qh = cp.asnumpy(q)
    want = reference.paged_attention_decode(qh, k, v, tables, lens, lay.dtype, kw.get("scale"))
    ERRORS[label] = assert_attention_close(out, want, lay.dtype, label)


GROUPS = [(8, 8), (32, 8), (16, 2), (12, 2), (32, 1)]  # MHA, GQA 4, GQA 8, group 6, MQA 32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize(("hq", "hkv"), GROUPS)
def test_decode_matches_reference(dtype, d, bs, hq, hkv):
    rng = np.random.default_rng([d, bs, hq, hkv, len(dtype)])
    lens = np.array([1, bs - 1, bs, 3 * bs + 5, 137, 300], dtype=np.int32)
    rng.shuffle(lens)
    need = sum(-(-int(n) // bs) for n in lens)
    pool = cuda_pool(rng, hkv, d, bs, dtype, need + 40, 2)
    tables = shuffled_tables(rng, lens, bs, pool.num_blocks, extra=3)
    q = device_elems(rng, (len(lens), hq, d), dtype)
    label = f"decode[{dtype},d{d},bs{bs},hq{hq},hkv{hkv}]"
    _check_decode(pool, 1, q, tables, lens, poisoned(q.shape, dtype), label, max_seq_len=300)
    # The same inputs through a forced split (chunks of a few loop steps) and the LSE merge.
    _check_decode(
        pool,
        1,
        q,
        tables,
        lens,
        poisoned(q.shape, dtype),
        label + "split3",
        num_splits=3,
        max_seq_len=300,
    )
    if bs == 16:  # the other load path (cp.async stages vs registers), plain and split
        other = 1 - _build.PIPELINE
        _check_decode(
            pool,
            1,
            q,
            tables,
            lens,
            poisoned(q.shape, dtype),
            label + "other",
            max_seq_len=300,
            pipeline=other,
        )
        _check_decode(
            pool,
            1,
            q,
            tables,
            lens,
            poisoned(q.shape, dtype),
            label + "other_split3",
            num_splits=3,
            max_seq_len=300,
            pipeline=other,
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (8, 8), (32, 1)])
def test_decode_both_kernels_and_cached_calls(dtype, d, hq, hkv):
    """The CUDA-core kernel's cp.async path (pipeline=1) next to the default tensor-core one,
    and repeated calls with the same shapes but fresh arrays (the wrapper caches everything
    but the pointers): each call must read its own q, tables and lengths."""
    rng = np.random.default_rng([d, hq, hkv, len(dtype), 77])
    bs = 16
    pool = cuda_pool(rng, hkv, d, bs, dtype, 160, 1)
    for rep in range(2):
        lens = rng.integers(1, 400, size=5).astype(np.int32)
        tables = shuffled_tables(rng, lens, bs, pool.num_blocks, extra=3)
        q = device_elems(rng, (len(lens), hq, d), dtype)
        label = f"decode_paths[{dtype},d{d},hq{hq},hkv{hkv},rep{rep}]"
        top = int(lens.max())  # max_seq_len may not exceed the tables' width * block_size
        _check_decode(
            pool, 0, q, tables, lens, poisoned(q.shape, dtype), label + "tc", max_seq_len=top
        )
        _check_decode(
            pool,
            0,
            q,
            tables,
            lens,
            poisoned(q.shape, dtype),
            label + "tc_split5",
            max_seq_len=top,
            num_splits=5,
        )
        _check_decode(
            pool,
            0,
            q,
            tables,
            lens,
            poisoned(q.shape, dtype),
            label + "cc",
            max_seq_len=top,
            pipeline=1,
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_seqs", "max_len"), [(1, 20000), (3, 5000), (40, 700)])
def test_decode_long_contexts_auto_split(dtype, num_seqs, max_len):
    rng = np.random.default_rng([num_seqs, max_len, len(dtype)])
    bs, d, hq, hkv = 16, 128, 32, 8
    lens = rng.integers(1, max_len + 1, size=num_seqs).astype(np.int32)
    lens[0] = max_len
    need = sum(-(-int(n) // bs) for n in lens)
    pool = cuda_pool(rng, hkv, d, bs, dtype, need + 8, 1)
    tables = shuffled_tables(rng, lens, bs, pool.num_blocks, extra=3)
    q = device_elems(rng, (num_seqs, hq, d), dtype)
    label = f"decode_auto[{dtype},S{num_seqs},L{max_len}]"
    _check_decode(pool, 0, q, tables, lens, poisoned(q.shape, dtype), label, scale=0.05)
    _check_decode(
        pool, 0, q, tables, lens, poisoned(q.shape, dtype), label + "hint", max_seq_len=max_len
    )


def test_decode_takes_torch_tensors_and_streams():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    lens = np.array([33, 1, 250], dtype=np.int32)
    pool = cuda_pool(rng, 2, 128, 16, "bfloat16", 40, 1)
    tables = shuffled_tables(rng, lens, 16, pool.num_blocks, extra=3)
    q = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16)
    bt, sl = torch.from_numpy(tables).cuda(), torch.from_numpy(lens).cuda()
    outs = [poisoned((3, 8, 128), "bfloat16") for _ in range(2)]
    # The pool fill and the NaN poison ran on CuPy's stream, q and the copies on torch's; the
    # non-blocking stream `s` is ordered with neither: finish both before the calls.
    cp.cuda.Device().synchronize()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        paged_attention_decode(
            q.view(torch.int16), pool, 0, bt, sl, out=outs[0], stream=s, max_seq_len=int(lens.max())
        )
        # torch.bfloat16 itself (no __cuda_array_interface__ for it) through the torch reader
        paged_attention_decode(
            q, pool, 0, bt, sl, out=outs[1], stream=s, max_seq_len=int(lens.max()), num_splits=2
        )
    s.synchronize()
    qh = q.view(torch.int16).cpu().numpy().view(np.uint16)
    want = reference.paged_attention_decode(
        qh,
        cp.asnumpy(cp.asarray(pool.k_view(0))),
        cp.asnumpy(cp.asarray(pool.v_view(0))),
        tables,
        lens,
        "bfloat16",
    )
    for i, out in enumerate(outs):
        label = f"decode_torch_stream{i}"
        ERRORS[label] = assert_attention_close(out, want, "bfloat16", label)


def test_decode_rejects_bad_arguments():
    rng = np.random.default_rng(1)
    pool = cuda_pool(rng, 2, 64, 16, "float16", 8, 1)
    lens = cp.asarray(np.array([4], np.int32))
    tables = cp.zeros((1, 2), dtype=cp.int32)
    with pytest.raises(kvpool.InvalidArgumentError, match="dtype"):
        paged_attention_decode(cp.zeros((1, 2, 64), cp.float32), pool, 0, tables, lens)
    with pytest.raises(kvpool.InvalidArgumentError, match="device array"):
        paged_attention_decode(np.zeros((1, 2, 64), np.float16), pool, 0, tables, lens)
    with pytest.raises(kvpool.InvalidArgumentError, match="int32"):
        paged_attention_decode(
            cp.zeros((1, 2, 64), cp.float16), pool, 0, tables.astype(cp.int64), lens
        )
    with pytest.raises(kvpool.InvalidArgumentError, match="element type"):
        paged_attention_decode(cp.zeros((1, 2, 64), cp.uint16), pool, 0, tables, lens)
    bad = kvpool.Pool(kvpool.KvLayout(1, 2, 100, 16, "float16"), 4, device="cuda")
    with pytest.raises(kvpool.InvalidArgumentError, match="no decode kernel"):
        paged_attention_decode(cp.zeros((1, 2, 100), cp.float16), bad, 0, tables, lens)
    # head_dim 96 runs on the tensor-core kernel, not on the CUDA-core baseline.
    base = kvpool.Pool(kvpool.KvLayout(1, 2, 96, 16, "float16"), 4, device="cuda")
    with (
        pytest.raises(kvpool.InvalidArgumentError, match="CUDA-core baseline"),
        _tuning.override(decode_pipeline=1),
    ):
        paged_attention_decode(cp.zeros((1, 2, 96), cp.float16), base, 0, tables, lens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bs", [8, 32])
def test_append_kv_matches_reference(dtype, d, bs):
    rng = np.random.default_rng([d, bs, len(dtype), 9])
    pool = cuda_pool(rng, 4, d, bs, dtype, 24, 3)
    host = [
        (cp.asnumpy(cp.asarray(pool.k_view(i))), cp.asnumpy(cp.asarray(pool.v_view(i))))
        for i in range(3)
    ]
    n = 50
    slots = rng.permutation(pool.num_blocks * bs)[:n].astype(np.int64)
    slots[[3, 17]] = -1
    k = device_elems(rng, (n, 4, d), dtype)
    v = device_elems(rng, (n, 4, d), dtype)
    append_kv(k, v, pool, 2, cp.asarray(slots))
    reference.append_kv(cp.asnumpy(k), cp.asnumpy(v), host[2][0], host[2][1], slots)
    for i in range(3):
        assert np.array_equal(cp.asnumpy(cp.asarray(pool.k_view(i))), host[i][0])
        assert np.array_equal(cp.asnumpy(cp.asarray(pool.v_view(i))), host[i][1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_reference(dtype):
    rng = np.random.default_rng([len(dtype), 4])
    pool = cuda_pool(rng, 8, 128, 16, dtype, 64, 4)
    views = lambda: [
        cp.asnumpy(cp.asarray(f(i))) for i in range(4) for f in (pool.k_view, pool.v_view)
    ]
    host = views()
    perm = rng.permutation(64)
    pairs = np.stack([perm[:20], perm[20:40]], axis=1)
    copy_blocks(pool, pairs)
    reference.copy_blocks(host, pairs)
    for got, want in zip(views(), host, strict=True):
        assert np.array_equal(got, want)
    with pytest.raises(kvpool.InvalidArgumentError):
        copy_blocks(pool, np.array([[0, 64]]))


def test_decode_after_append_matches_reference():
    """End to end: append a prefill through slot mappings, then decode over it."""
    rng = np.random.default_rng(21)
    bs, d, hkv, hq = 16, 128, 4, 16
    lens = np.array([45, 16, 1], dtype=np.int32)
    pool = cuda_pool(rng, hkv, d, bs, "float16", 32, 2)
    tables = shuffled_tables(rng, lens, bs, pool.num_blocks, extra=3)
    slots = np.concatenate(
        [
            tables[i, np.arange(n) // bs].astype(np.int64) * bs + np.arange(n) % bs
            for i, n in enumerate(lens)
        ]
    )
    k = device_elems(rng, (len(slots), hkv, d), "float16")
    v = device_elems(rng, (len(slots), hkv, d), "float16")
    append_kv(k, v, pool, 1, cp.asarray(slots))
    q = device_elems(rng, (3, hq, d), "float16")
    _check_decode(pool, 1, q, tables, lens, poisoned(q.shape, "float16"), "append_then_decode")


def test_decode_rejects_tables_of_another_pool():
    rng = np.random.default_rng(30)
    pool_a = cuda_pool(rng, 2, 64, 16, "float16", 16, 1)
    pool_b = cuda_pool(rng, 2, 64, 16, "float16", 16, 1)
    tables = kvpool.BlockTables(pool_a, 4, 4)
    tables.add(0, 20)
    bt, sl = tables.sync()
    q = device_elems(rng, (1, 2, 64), "float16")
    out = poisoned(q.shape, "float16")
    cp.cuda.runtime.deviceSynchronize()
    with pytest.raises(kvpool.InvalidArgumentError, match="another pool"):
        paged_attention_decode(q, pool_b, 0, bt, sl, out=out, max_seq_len=20)
    with pytest.raises(kvpool.InvalidArgumentError, match="another pool"):
        paged_attention_decode(
            q, pool_b, 0, cp.zeros((1, 4), cp.int32), sl, out=out, max_seq_len=20
        )
    cp.cuda.runtime.deviceSynchronize()
    assert (out.view(cp.uint16) == NAN_BITS["float16"]).all(), "a kernel ran"
    # The same arrays with their own pool.
    assert paged_attention_decode(q, pool_a, 0, bt, sl, out=out, max_seq_len=20) is out
    cp.cuda.runtime.deviceSynchronize()
    assert not cp.isnan(out).any()


def test_decode_waits_for_the_stream_of_synced_tables():
    """BlockTables.sync queues the upload on the pool's stream and names it in the arrays'
    __cuda_array_interface__; a decode on another stream must wait for it on the device."""
    rng = np.random.default_rng(31)
    bs, d, hq, hkv = 16, 128, 8, 2
    pool = cuda_pool(rng, hkv, d, bs, "float16", 64, 1)
    tables = kvpool.BlockTables(pool, 4, 8)
    for rid, n in enumerate((37, 90, 5)):
        tables.add(rid, n)
    tables.sync()  # the first upload (and any allocation it makes) before the spin
    cp.cuda.runtime.deviceSynchronize()
    tables.append_tokens(1, 10)
    ids = tables.request_ids()
    host_bt, host_sl = tables.block_table(ids), tables.seq_lens(ids)
    q = device_elems(rng, (len(ids), hq, d), "float16")
    s = cp.cuda.Stream(non_blocking=True)
    # Warm up (compile, prepare) with the same shapes so the timed call below is quick.
    warm = poisoned(q.shape, "float16")
    paged_attention_decode(
        q,
        pool,
        0,
        cp.asarray(host_bt, dtype=cp.int32),
        cp.asarray(host_sl, dtype=cp.int32),
        out=warm,
        stream=s,
        max_seq_len=100,
    )
    out = poisoned(q.shape, "float16")
    cp.cuda.runtime.deviceSynchronize()
    pool_stream = cp.cuda.Stream.from_external(pool.stream)
    with pool_stream:
        cp.RawModule(code=SPIN_SOURCE).get_function("spin")((1,), (1,), (np.uint64(300_000_000),))
    bt, sl = tables.sync()  # queued behind the spin
    assert bt.__cuda_array_interface__["stream"] == pool_stream.ptr != s.ptr
    paged_attention_decode(q, pool, 0, bt, sl, out=out, stream=s, max_seq_len=100)
    assert not pool_stream.done, "the upload should still be queued behind the spin kernel"
    s.synchronize()
    want = reference.paged_attention_decode(
        cp.asnumpy(q),
        cp.asnumpy(cp.asarray(pool.k_view(0))),
        cp.asnumpy(cp.asarray(pool.v_view(0))),
        host_bt,
        host_sl,
        "float16",
    )
    label = "decode_waits_for_tables_stream"
    ERRORS[label] = assert_attention_close(out, want, "float16", label)
    cp.cuda.runtime.deviceSynchronize()


def test_decode_more_argument_errors_and_empty_batch():
    rng = np.random.default_rng(32)
    pool = cuda_pool(rng, 2, 64, 16, "float16", 8, 1)
    q = device_elems(rng, (1, 2, 64), "float16")
    tables = cp.asarray(np.array([[0, 1]], np.int32))
    lens = cp.asarray(np.array([20], np.int32))
    err = kvpool.InvalidArgumentError
    with pytest.raises(err, match="seq_lens"):
        paged_attention_decode(q, pool, 0, tables, np.array([20], np.int32), max_seq_len=20)
    for layer in (1, -1):
        with pytest.raises(err, match="layer"):
            paged_attention_decode(q, pool, layer, tables, lens, max_seq_len=20)
    for layer in (0.5, "0"):  # a wrong type: TypeError, as everywhere in the API
        with pytest.raises(TypeError, match="layer"):
            paged_attention_decode(q, pool, layer, tables, lens, max_seq_len=20)
    for out in (
        cp.zeros((1, 2, 32), cp.float16),
        cp.zeros((2, 2, 64), cp.float16),
        cp.zeros((1, 2, 64), cp.float32),
    ):
        with pytest.raises(err, match="out"):
            paged_attention_decode(q, pool, 0, tables, lens, out=out, max_seq_len=20)
    with pytest.raises(err, match="out"):
        paged_attention_decode(
            q, pool, 0, tables, lens, out=np.zeros((1, 2, 64), np.float16), max_seq_len=20
        )
    with pytest.raises(ValueError, match="decode_pipeline"), _tuning.override(decode_pipeline=7):
        pass
    with pytest.raises(err, match="exceeds"):  # 2 blocks of 16 tokens hold 32
        paged_attention_decode(q, pool, 0, tables, lens, max_seq_len=33)
    with pytest.raises(TypeError, match="max_seq_len"):  # a wrong type, not a wrong value
        paged_attention_decode(q, pool, 0, tables, lens, max_seq_len=20.0)
    wide = cp.asarray(np.array([[0, 1, 2, 3, 4, 5, 6, 7]], np.int32))
    for ws in (
        np.zeros(1 << 20, np.float32),
        cp.zeros(4, cp.float32),
        cp.zeros(1 << 20, cp.float16),
    ):
        with pytest.raises(err, match="workspace"):
            paged_attention_decode(
                q, pool, 0, wide, lens, max_seq_len=128, num_splits=2, workspace=ws
            )
    # Empty batch: an empty output, no pointer checks (CuPy's empty arrays have null pointers).
    e_q, e_bt = cp.empty((0, 2, 64), cp.float16), cp.empty((0, 2), cp.int32)
    e_sl = cp.empty((0,), cp.int32)
    res = paged_attention_decode(e_q, pool, 0, e_bt, e_sl)
    assert res.shape == (0, 2, 64)
    e_out = cp.empty((0, 2, 64), cp.float16)
    assert paged_attention_decode(e_q, pool, 0, e_bt, e_sl, out=e_out, max_seq_len=0) is e_out


def test_decode_forced_split_and_workspace_without_max_seq_len():
    """num_splits without max_seq_len reads the longest sequence (a forced split covers every
    token); a caller's workspace is used as is."""
    rng = np.random.default_rng(33)
    bs, d, hq, hkv = 16, 128, 8, 2
    lens = np.array([700, 3, 129], dtype=np.int32)
    need = sum(-(-int(n) // bs) for n in lens)
    pool = cuda_pool(rng, hkv, d, bs, "bfloat16", need + 4, 1)
    tables = shuffled_tables(rng, lens, bs, pool.num_blocks, extra=3)
    q = device_elems(rng, (3, hq, d), "bfloat16")
    _check_decode(
        pool, 0, q, tables, lens, poisoned(q.shape, "bfloat16"), "forced_split4", num_splits=4
    )
    ws = cp.empty(workspace_elems(3, hq, d, 4), cp.float32)
    _check_decode(
        pool,
        0,
        q,
        tables,
        lens,
        poisoned(q.shape, "bfloat16"),
        "forced_split4_ws",
        num_splits=4,
        max_seq_len=700,
        workspace=ws,
    )


def test_append_kv_argument_errors():
    rng = np.random.default_rng(34)
    pool = cuda_pool(rng, 2, 64, 16, "float16", 8, 1)
    k = device_elems(rng, (3, 2, 64), "float16")
    slots = cp.asarray(np.array([0, 5, 17], np.int64))
    err = kvpool.InvalidArgumentError
    for layer in (1, -1):
        with pytest.raises(err, match="layer"):
            append_kv(k, k, pool, layer, slots)
    with pytest.raises(TypeError, match="layer"):  # a wrong type
        append_kv(k, k, pool, 0.5, slots)
    with pytest.raises(err, match="element type"):
        append_kv(k.astype(cp.float32), k, pool, 0, slots)
    with pytest.raises(err, match="element type"):
        append_kv(k.view(cp.uint16), k, pool, 0, slots)
    with pytest.raises(err, match="device array"):
        append_kv(cp.asnumpy(k), k, pool, 0, slots)
    with pytest.raises(err, match="slot_mapping"):
        append_kv(k, k, pool, 0, cp.asnumpy(slots))
    with pytest.raises(err, match="int64"):
        append_kv(k, k, pool, 0, slots.astype(cp.int32))
    with pytest.raises(err, match="k and v"):
        append_kv(k, k[:2], pool, 0, slots)
    with pytest.raises(err, match="slot_mapping"):
        append_kv(k, k, pool, 0, slots[:2])
    before = cp.asnumpy(cp.asarray(pool.k_view(0)))
    append_kv(
        cp.empty((0, 2, 64), cp.float16),
        cp.empty((0, 2, 64), cp.float16),
        pool,
        0,
        cp.empty((0,), cp.int64),
    )
    assert np.array_equal(cp.asnumpy(cp.asarray(pool.k_view(0))), before)


def test_append_kv_takes_torch_bfloat16_and_streams():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(35)
    pool = cuda_pool(rng, 2, 64, 16, "bfloat16", 8, 1)
    host_k = cp.asnumpy(cp.asarray(pool.k_view(0)))
    host_v = cp.asnumpy(cp.asarray(pool.v_view(0)))
    k = torch.randn(5, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(5, 2, 64, device="cuda", dtype=torch.bfloat16)
    slots = np.array([0, 17, -1, 40, 127], np.int64)
    slots_t = torch.from_numpy(slots).cuda()
    cp.cuda.Device().synchronize()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    append_kv(k, v, pool, np.int64(0), slots_t, stream=s)
    s.synchronize()
    kh = k.view(torch.int16).cpu().numpy().view(host_k.dtype)
    vh = v.view(torch.int16).cpu().numpy().view(host_v.dtype)
    reference.append_kv(kh, vh, host_k, host_v, slots)
    assert np.array_equal(cp.asnumpy(cp.asarray(pool.k_view(0))), host_k)
    assert np.array_equal(cp.asnumpy(cp.asarray(pool.v_view(0))), host_v)
