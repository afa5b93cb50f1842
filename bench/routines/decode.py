"""Paged decode attention on the GPU: kvpool against torch SDPA and FlashInfer, same run.

Per shape: a 1-layer pool (its block layout is FlashInfer's NHD paged cache, so FlashInfer
reads the very same pages), shuffled block tables, uniform or ragged lengths (SDPA, which has no
paged or ragged decode, runs only on uniform ones), R rotations of inputs so that the bytes
touched per timing pass exceed the L2 several times (timing.rotations). Every method is timed as CUDA-graph
replays of R calls (medians over replays, after warm-up); kvpool is also timed eagerly (Python
wrapper included). kvpool's plans are made once per rotation before the timed calls, like
FlashInfer's plan, and the timed call is the per-layer run (DecodePlan.run). The read ceiling
is measured in the same run with bench/routines/ceiling.cu.

For the small shapes the split count is swept (`kvpool_split_sweep_us`, the same kernel with
num_splits forced) so that the plan can be set from measurements.

Writes JSON (--out) with one row per shape; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import traceback
from pathlib import Path

import cupy as cp
import kvpool
import numpy as np
import torch
import torch.nn.functional as F
from kvpool.kernels import _build, _tuning, decode_plan, paged_attention_decode, workspace_elems
from provenance import provenance
from timing import HOST_BATCH_CALLS, HOST_BATCHES, eager_us, graph_us, host_us, rotations
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = Path(__file__).resolve().parent

GRID = [
    (1, 32768),
    (1, 4096),
    (16, 512),
    (8, 8192),
    (32, 4096),
    (64, 2048),
    (128, 1024),
    (256, 2048),
    (64, 8192),
]
HQ, HKV, BS = 32, 8, 16
# (dtype, head_dim, (batch, seq_len), options): hq (query heads, Hkv 8), bs (block size),
# ragged (lengths uniform in 1..seq_len, seeded; seq_len is then the longest possible).
VARIANTS = [
    ("bfloat16", 128, (1, 32768), {}),
    ("bfloat16", 128, (32, 4096), {}),
    ("float16", 64, (1, 4096), {}),
    ("float16", 64, (32, 4096), {}),
    ("float16", 256, (1, 4096), {}),
    ("float16", 256, (32, 4096), {}),
    ("float16", 128, (32, 4096), {"hq": 8}),  # MHA (Hq = Hkv = 8): group 1
    ("float16", 80, (32, 4096), {}),
    ("float16", 96, (32, 4096), {}),
    ("float16", 112, (32, 4096), {}),
    ("float16", 192, (32, 4096), {}),
    ("float16", 80, (1, 4096), {}),
    ("float16", 128, (16, 512), {"bs": 1}),
    ("float16", 128, (32, 4096), {"bs": 64}),
    ("float16", 128, (32, 4096), {"bs": 128}),
    ("float16", 128, (1, 4096), {"bs": 128}),
    ("float16", 128, (32, 4096), {"hq": 64}),
    ("float16", 128, (1, 4096), {"hq": 64}),
    ("bfloat16", 128, (32, 4096), {"hq": 64}),
    ("float16", 128, (32, 8192), {"ragged": True}),
    ("float16", 128, (16, 1024), {"ragged": True}),
    ("bfloat16", 128, (64, 2048), {"ragged": True, "hq": 64}),
]


def cases():
    """(dtype, head_dim, (batch, seq_len), options) of every row, in the order measured."""
    return [("float16", 128, s, {}) for s in GRID] + VARIANTS


def flashinfer_configs():
    """The (dtype, head_dim, num_q_heads, block_size) FlashInfer is asked for, each once."""
    seen = {(dt, d, o.get("hq", HQ), o.get("bs", BS)): None for dt, d, _, o in cases()}
    return list(seen)


SWEEP_SPLITS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def measure_ceiling():
    mod = cp.RawModule(code=(HERE / "ceiling.cu").read_text(), options=("-std=c++17",))
    k = mod.get_function("read_ceiling")
    nbytes = 8 << 30
    buf = cp.empty(nbytes // 4, dtype=cp.uint32)
    buf[...] = cp.arange(buf.size, dtype=cp.uint32)
    sink = cp.zeros(1, dtype=cp.uint32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    best, sweep = 0.0, {}
    for blocks_per_sm in (2, 4, 8, 16):
        for threads in (256, 512, 1024):
            grid = sms * blocks_per_sm
            args = (buf, np.uint64(nbytes // 16), sink)
            k((grid,), (threads,), args)
            cp.cuda.Device().synchronize()
            ts = []
            for _ in range(5):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record()
                k((grid,), (threads,), args)
                b.record()
                b.synchronize()
                ts.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
            tbs = nbytes / statistics.median(ts) / 1e12
            sweep[f"{grid}x{threads}"] = round(tbs, 4)
            best = max(best, tbs)
    del buf
    x = torch.empty(1 << 31, dtype=torch.float16, device="cuda").normal_()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    x.sum()
    a.record()
    for _ in range(5):
        x.sum()
    b.record()
    b.synchronize()
    torch_sum = x.numel() * 2 * 5 / (a.elapsed_time(b) * 1e-3) / 1e12
    del x
    cp.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()
    return best, sweep, torch_sum


def paged_pool(dtype, num_blocks, bs, d):
    """A one-layer CUDA pool of 16-bit K/V and a torch view of its slab as FlashInfer's NHD
    paged cache [num_blocks, 2, bs, Hkv, d] (no copy: FlashInfer reads our very pages)."""
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    lay = kvpool.KvLayout(1, HKV, d, bs, dtype)
    pool = kvpool.Pool(lay, num_blocks, device="cuda")
    st = lay.strides()
    assert st["block"] == 2 * bs * HKV * d * 2 and st["kv"] == bs * HKV * d * 2
    slab = cp.ndarray(
        (num_blocks, 2, bs, HKV, d),
        dtype=cp.uint16,
        memptr=cp.cuda.MemoryPointer(
            cp.cuda.UnownedMemory(pool.base_ptr, num_blocks * st["block"], pool), 0
        ),
    )
    return pool, torch.from_dlpack(slab.view(cp.int16)).view(tdt)


def random_elems(shape, dtype, gen):
    t = torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float32)
    return t.to(torch.bfloat16 if dtype == "bfloat16" else torch.float16)


FLASHINFER_HEAD_DIMS = (64, 128, 256)


def per_stream_plan(make_plan, run):
    """A timing call (given the stream) that runs `run(plan)`, the plan made by
    `make_plan(stream)` on the call's first use of that stream (a plan is bound to its stream):
    every timing function calls each call once, untimed, before it times, so no plan is made
    inside the timed region."""
    plans = {}

    def call(s):
        plan = plans.get(s.cuda_stream)
        if plan is None:
            plan = plans[s.cuda_stream] = make_plan(s)
        run(plan)

    return call


def bench_flashinfer(row, name, tc, flashinfer, plan, qs, cache, ours_out0):
    """FlashInfer's decode in one mode (`tc`: tensor cores) on the same pages as ours: one
    wrapper per rotation, each planned by `plan(wrapper, r)`; times and the largest difference
    from our output go into `row` under `name`."""
    rot = len(qs)
    wrappers = []
    for r in range(rot):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=tc
        )
        plan(w, r)
        wrappers.append(w)
    fouts = [torch.empty_like(q) for q in qs]

    def fi(r):
        def call(s):
            wrappers[r].run(qs[r], cache, out=fouts[r])

        return call

    try:
        row[f"{name}_host_us"] = host_us(fi(0))
        row[f"{name}_us"] = graph_us([fi(r) for r in range(rot)])
        row[f"{name}_timing"] = "graph"
    except Exception as e:
        row[f"{name}_us"] = eager_us([fi(r) for r in range(rot)])
        row[f"{name}_timing"] = f"eager ({type(e).__name__})"
    torch.cuda.synchronize()
    wrappers[0].run(qs[0], cache, out=fouts[0])
    row[f"max_abs_diff_vs_{name}"] = float((fouts[0].float() - ours_out0).abs().max())


def bench_shape(dtype, d, batch, seq_len, ceiling, do_sweep, hq=HQ, bs=BS, ragged=False):
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    rng = np.random.default_rng(batch * 31 + seq_len + bs)
    lens = (rng.integers(1, seq_len + 1, size=batch) if ragged else np.full(batch, seq_len)).astype(
        np.int32
    )
    kv_bytes = int(lens.sum()) * HKV * d * 2 * 2
    rot = rotations(kv_bytes)
    blocks_per_seq = -(-seq_len // bs)  # table width; a ragged row uses a prefix of its row
    num_blocks = rot * batch * blocks_per_seq
    pool, cache = paged_pool(dtype, num_blocks, bs, d)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(batch * 7919 + seq_len + d)
    cache.copy_(random_elems(cache.shape, dtype, gen))
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = [
        perm[r * batch * blocks_per_seq : (r + 1) * batch * blocks_per_seq].reshape(
            batch, blocks_per_seq
        )
        for r in range(rot)
    ]
    tables_t = [torch.from_numpy(t).cuda() for t in tables]
    lens_t = torch.from_numpy(lens).cuda()
    qs = [random_elems((batch, hq, d), dtype, gen) for _ in range(rot)]
    outs = [torch.empty_like(q) for q in qs]
    # kvpool takes bfloat16 as any 2-byte integer array (CuPy has no bfloat16 dtype).
    as_arg = (lambda t: t.view(torch.int16)) if dtype == "bfloat16" else (lambda t: t)
    group = hq // HKV
    # The split the library's default plan chooses for this shape (reported, not timed).
    split = decode_plan(pool, tables_t[0], lens_t, hq, max_seq_len=seq_len).kv_split
    ws = cp.empty(
        workspace_elems(batch, hq, d, max(split.num_splits, max(SWEEP_SPLITS))), dtype=cp.float32
    )
    row = {
        "shape": f"{batch}x{seq_len}" + ("r" if ragged else ""),
        "batch": batch,
        "seq_len": seq_len,
        "ragged": ragged,
        "mean_len": float(lens.mean()),
        "dtype": dtype,
        "head_dim": d,
        "num_q_heads": hq,
        "num_kv_heads": HKV,
        "block_size": bs,
        "kv_bytes": kv_bytes,
        "rotations": rot,
        "num_splits": split.num_splits,
        "chunk_tokens": split.chunk_tokens,
    }

    def ours(r, splits=None, pipeline=_build.TC):
        def make_plan(s):
            with _tuning.override(decode_pipeline=pipeline):
                return decode_plan(
                    pool,
                    tables_t[r],
                    lens_t,
                    hq,
                    max_seq_len=seq_len,
                    num_splits=splits,
                    stream=s,
                    workspace=ws,
                )

        return per_stream_plan(
            make_plan, lambda plan: plan.run(as_arg(qs[r]), 0, out=as_arg(outs[r]))
        )

    row["kvpool_kernel"] = "tensor cores (paged_decode_tc)"
    row["kvpool_us"] = graph_us([ours(r) for r in range(rot)])
    row["kvpool_repeat_us"] = graph_us([ours(r) for r in range(rot)])  # noise check
    # The CUDA-core kernel of v2 (cp.async stages), same run, same data, where it runs.
    if d in _build.HEAD_DIMS and bs in _build.BLOCK_SIZES and group <= 8:
        row["kvpool_cuda_core_us"] = graph_us(
            [ours(r, pipeline=_build.PIPELINE) for r in range(rot)]
        )
    row["kvpool_eager_us"] = eager_us([ours(r) for r in range(rot)])
    # Host time per call of the Python wrapper (eager, no sync): a plan's run, and the plain
    # one-call form (default stream; it makes a plan, and a split workspace when it splits, on
    # every call; max_seq_len still given: without it the plan must read seq_lens back, a
    # device sync).
    row["kvpool_host_us"] = host_us(ours(0))

    def plain(s):
        paged_attention_decode(
            as_arg(qs[0]), pool, 0, tables_t[0], lens_t, out=as_arg(outs[0]), max_seq_len=seq_len
        )

    row["kvpool_host_plain_us"] = host_us(plain)
    if do_sweep:
        row["kvpool_split_sweep_us"] = {
            str(n): round(graph_us([ours(r, n) for r in range(rot)]), 2)
            for n in SWEEP_SPLITS
            if n <= max(1, seq_len // 64)
        }
    torch.cuda.synchronize()
    ours_out0 = outs[0].float().clone()

    # SDPA on contiguous K/V gathered from the same pages (so outputs are comparable).
    def contiguous(r, kv):
        pages = cache[tables_t[r].long(), kv]  # [B, blocks, bs, HKV, D]
        return (
            pages.reshape(batch, blocks_per_seq * bs, HKV, d)[:, :seq_len]
            .transpose(1, 2)
            .contiguous()
        )

    ks = [contiguous(r, 0) for r in range(rot)] if not ragged else []
    vs = [contiguous(r, 1) for r in range(rot)] if not ragged else []
    q4 = [q.unsqueeze(2) for q in qs]
    if ragged:
        row["sdpa_note"] = "SDPA has no ragged decode without padding: not run"
    for name, backend in (
        ()
        if ragged
        else (
            ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
            ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
        )
    ):

        def sdpa(r, backend=backend):
            def call(s):
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q4[r], ks[r], vs[r], enable_gqa=True)

            return call

        try:
            row[f"{name}_us"] = graph_us([sdpa(r) for r in range(rot)])
            if name == "sdpa_cudnn":
                with sdpa_kernel([backend]):
                    ref = F.scaled_dot_product_attention(q4[0], ks[0], vs[0], enable_gqa=True)
                row["max_abs_diff_vs_sdpa"] = float(
                    (ref.squeeze(2).float() - ours_out0).abs().max()
                )
        except Exception as e:  # a backend may refuse a shape
            row[f"{name}_us"] = None
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    ks.clear()  # free the contiguous copies before FlashInfer
    vs.clear()
    torch.cuda.empty_cache()

    try:
        import flashinfer
    except ImportError as e:
        flashinfer = None
        row["flashinfer_error"] = f"{type(e).__name__}: {e}"[:300]
    if flashinfer is not None and d not in FLASHINFER_HEAD_DIMS:
        # Asked anyway, FlashInfer 0.5.3 fails inside a graph capture and then faults on the
        # device (seen on the H200 at head_dim 80), which poisons every later row of the run.
        flashinfer = None
        row["flashinfer_error"] = (
            f"FlashInfer 0.5.3 decode supports head_dim {FLASHINFER_HEAD_DIMS}"
        )
    nblk = -(-lens.astype(np.int64) // bs)
    indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(nblk)]).astype(np.int32)).cuda()
    last = torch.from_numpy((lens - (nblk - 1) * bs).astype(np.int32)).cuda()

    def plan(wrapper, r):
        indices = torch.cat([tables_t[r][i, : nblk[i]] for i in range(batch)])
        wrapper.plan(indptr, indices, last, hq, HKV, d, bs, q_data_type=tdt, kv_data_type=tdt)

    for name, tc in (("flashinfer", False), ("flashinfer_tc", True)) if flashinfer else ():
        try:  # each mode on its own: one may refuse a head_dim or page size the other takes
            bench_flashinfer(row, name, tc, flashinfer, plan, qs, cache, ours_out0)
        except Exception as e:
            row[f"{name}_us"] = None
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            traceback.print_exc()
    for key in (
        "kvpool",
        "kvpool_cuda_core",
        "sdpa_cudnn",
        "sdpa_flash",
        "flashinfer",
        "flashinfer_tc",
    ):
        us = row.get(f"{key}_us")
        row[f"{key}_frac"] = None if not us else round(kv_bytes / (us * 1e-6) / 1e12 / ceiling, 4)
    peers = [
        row.get(k)
        for k in ("sdpa_cudnn_us", "sdpa_flash_us", "flashinfer_us", "flashinfer_tc_us")
        if row.get(k)
    ]
    row["best_peer_us"] = min(peers) if peers else None
    row["speedup_vs_best_peer"] = (
        round(row["best_peer_us"] / row["kvpool_us"], 3) if peers else None
    )
    fis = [row.get(k) for k in ("flashinfer_us", "flashinfer_tc_us") if row.get(k)]
    row["speedup_vs_best_flashinfer"] = round(min(fis) / row["kvpool_us"], 3) if fis else None
    torch.cuda.empty_cache()
    cp.get_default_memory_pool().free_all_blocks()
    return row


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON to write")
    out_path = ap.parse_args(argv).out
    ceiling, sweep, torch_sum = measure_ceiling()
    print(f"ceiling {ceiling:.3f} TB/s (torch sum {torch_sum:.3f})", flush=True)
    result = {
        "provenance": provenance("bench/routines/decode.py"),
        "ceiling_tb_s": round(ceiling, 4),
        "ceiling_sweep_tb_s": sweep,
        "torch_sum_tb_s": round(torch_sum, 4),
        "timing": "median of 20 CUDA-graph replays of >= 8 calls rotating over R input sets",
        "host_timing": f"*_host_us: median over {HOST_BATCHES} batches of {HOST_BATCH_CALLS} eager calls",
        "torch": torch.__version__,
        "cupy": cp.__version__,
        "rows": [],
    }
    for dtype, d, (b, l), opts in cases():
        try:
            row = bench_shape(dtype, d, b, l, ceiling, do_sweep=b * l <= 32768, **opts)
        except Exception as e:
            traceback.print_exc()
            row = {
                "shape": f"{b}x{l}",
                "dtype": dtype,
                "head_dim": d,
                **opts,
                "error": f"{type(e).__name__}: {e}"[:300],
            }
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    hdr = f"{'shape':>9} {'dt':>4} {'D':>3} {'Hq':>3} {'bs':>3} {'ours':>7} {'v2cc':>7} {'cudnn':>7} {'flash':>7} {'FI':>7} {'FItc':>7} {'frac':>5} {'xFI':>5} {'xbest':>5} {'host':>5} {'FIhst':>5}"
    print(hdr)
    for r in result["rows"]:
        f = lambda k, r=r: f"{r[k]:7.1f}" if r.get(k) else "      -"
        print(
            f"{r['shape']:>9} {r['dtype'][:4]:>4} {r['head_dim']:>3} {r.get('num_q_heads', 0):>3} "
            f"{r.get('block_size', 0):>3} "
            f"{f('kvpool_us')} {f('kvpool_cuda_core_us')} {f('sdpa_cudnn_us')} "
            f"{f('sdpa_flash_us')} {f('flashinfer_us')} {f('flashinfer_tc_us')} "
            f"{r.get('kvpool_frac') or 0:5.2f} {r.get('speedup_vs_best_flashinfer') or 0:5.2f} "
            f"{r.get('speedup_vs_best_peer') or 0:5.2f} {r.get('kvpool_host_us') or 0:5.1f} "
            f"{r.get('flashinfer_tc_host_us') or 0:5.1f}"
        )
