"""Sliding-window decode on the GPU: kvpool's window decode at 4k and 64k context against
FlashInfer's decode with `window_left` and against our full-attention decode, same run.

gpt-oss-120b's attention shape (bfloat16, 64 query heads over 8 KV heads of 64, 16-token pages,
window 128), 32 sequences per step. Per context length L:

- `kvpool_window_us`: our decode over window-relative tables (the last ceil(128/16) + 1 pages
  per sequence and `first_page`, as a window group's tables hold them);
- `kvpool_window_full_table_us`: the same over full-length tables whose entries before the
  window all name one dummy page (never read when the window is honoured);
- `flashinfer_window_us` / `flashinfer_tc_window_us`: FlashInfer 0.5.3's
  BatchDecodeWithPagedKVCacheWrapper (CUDA cores / tensor cores) with window_left = 127 over the
  same full-length page lists (FlashInfer's window_left w - 1 is our window w);
- `kvpool_full_us` / `flashinfer_full_us`: full attention over L real tokens per sequence (a
  separate pool), what a full-attention layer of the same model costs at that context.

A window layer's time should be flat in L. Every method is timed as CUDA-graph replays
(bench/timing.py), rotating over input sets (distinct pages) so that the bytes one pass touches
exceed the L2 several times. The window outputs of ours and FlashInfer's are compared
(max_abs_diff). Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import traceback

import cupy as cp
import kvpool
import numpy as np
import torch
from kvpool.kernels import decode_plan
from provenance import provenance
from timing import graph_us, rotations

HQ, HKV, D, BS, BATCH, WINDOW = 64, 8, 64, 16, 32, 128
DTYPE = "bfloat16"
CONTEXTS = (4096, 65536)


def paged_pool(num_blocks):
    """A one-layer pool and a torch view of its slab as FlashInfer's NHD cache."""
    lay = kvpool.KvLayout(1, HKV, D, BS, DTYPE)
    pool = kvpool.Pool(lay, num_blocks, device="cuda")
    st = lay.strides()
    slab = cp.ndarray(
        (num_blocks, 2, BS, HKV, D),
        dtype=cp.int16,
        memptr=cp.cuda.MemoryPointer(
            cp.cuda.UnownedMemory(pool.base_ptr, num_blocks * st["block"], pool), 0
        ),
    )
    cache = torch.from_dlpack(slab).view(torch.bfloat16)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(num_blocks)
    cache.copy_(torch.randn(cache.shape, device="cuda", generator=gen).to(torch.bfloat16))
    return pool, cache


def per_stream(make_plan, run):
    plans = {}

    def call(s):
        p = plans.get(s.cuda_stream)
        if p is None:
            p = plans[s.cuda_stream] = make_plan(s)
        run(p)

    return call


def fi_wrappers(flashinfer, tc, tables, lens, window_left):
    """One planned FlashInfer decode wrapper per rotation over these full-length tables."""
    nblk = -(-lens.astype(np.int64) // BS)
    indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(nblk)]).astype(np.int32)).cuda()
    last = torch.from_numpy((lens - (nblk - 1) * BS).astype(np.int32)).cuda()
    out = []
    for t in tables:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=tc
        )
        idx = torch.cat([t[i, : nblk[i]] for i in range(len(lens))])
        w.plan(
            indptr,
            idx,
            last,
            HQ,
            HKV,
            D,
            BS,
            window_left=window_left,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
        )
        out.append(w)
    return out


def bench_context(ctx, flashinfer):
    row = {"context": ctx, "batch": BATCH, "window": WINDOW}
    lens = np.full(BATCH, ctx, np.int32)
    lens_t = torch.from_numpy(lens).cuda()
    # Window pool: per rotation and sequence the window's pages, distinct; page 0 is the dummy.
    live = -(-WINDOW // BS) + 1
    first = (ctx - WINDOW) // BS
    rot = rotations(BATCH * WINDOW * HKV * D * 2 * 2)
    pool, cache = paged_pool(1 + rot * BATCH * live)
    rng = np.random.default_rng(ctx)
    perm = 1 + rng.permutation(rot * BATCH * live).astype(np.int32)
    rel = [perm[r * BATCH * live : (r + 1) * BATCH * live].reshape(BATCH, live) for r in range(rot)]
    width = -(-ctx // BS)
    full = []
    for r in range(rot):
        t = np.zeros((BATCH, width), np.int32)  # the dummy page before the window
        t[:, first : first + live] = rel[r][:, : width - first]
        full.append(t)
    rel_t = [torch.from_numpy(t).cuda() for t in rel]
    full_t = [torch.from_numpy(t).cuda() for t in full]
    fp_t = torch.full((BATCH,), first, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(ctx + 1)
    qs = [torch.randn(BATCH, HQ, D, device="cuda", generator=gen).to(torch.bfloat16) for _ in rel]
    outs = [torch.empty_like(q) for q in qs]
    row["rotations"] = rot

    def ours(tables, first_page):
        def one(r):
            def make(s):
                return decode_plan(
                    pool,
                    tables[r],
                    lens_t,
                    HQ,
                    max_seq_len=ctx,
                    window=WINDOW,
                    first_page=first_page,
                    stream=s,
                )

            return per_stream(
                make, lambda p: p.run(qs[r].view(torch.int16), 0, out=outs[r].view(torch.int16))
            )

        return [one(r) for r in range(rot)]

    row["kvpool_window_us"] = graph_us(ours(rel_t, fp_t))
    plan0 = decode_plan(pool, rel_t[0], lens_t, HQ, max_seq_len=ctx, window=WINDOW, first_page=fp_t)
    row["kvpool_window_splits"] = plan0.num_splits
    plan0.run(qs[0].view(torch.int16), 0, out=outs[0].view(torch.int16))
    torch.cuda.synchronize()
    ours_out = outs[0].float().clone()
    row["kvpool_window_full_table_us"] = graph_us(ours(full_t, None))
    plan1 = decode_plan(pool, full_t[0], lens_t, HQ, max_seq_len=ctx, window=WINDOW)
    plan1.run(qs[0].view(torch.int16), 0, out=outs[0].view(torch.int16))
    torch.cuda.synchronize()
    row["max_abs_diff_full_vs_window_table"] = float((outs[0].float() - ours_out).abs().max())
    for name, tc in (("flashinfer", False), ("flashinfer_tc", True)) if flashinfer else ():
        try:
            ws = fi_wrappers(flashinfer, tc, full_t, lens, WINDOW - 1)
            fouts = [torch.empty_like(q) for q in qs]

            def fi(r, ws=ws, fouts=fouts):
                return lambda s: ws[r].run(qs[r], cache, out=fouts[r])

            row[f"{name}_window_us"] = graph_us([fi(r) for r in range(rot)])
            ws[0].run(qs[0], cache, out=fouts[0])
            torch.cuda.synchronize()
            row[f"max_abs_diff_vs_{name}_window"] = float((fouts[0].float() - ours_out).abs().max())
        except Exception as e:
            traceback.print_exc()
            row[f"{name}_window_error"] = f"{type(e).__name__}: {e}"[:300]
    pool = cache = None  # free the window pool before the full one
    torch.cuda.empty_cache()
    cp.get_default_memory_pool().free_all_blocks()

    # Full attention over the whole context (its own pool of real pages).
    frot = rotations(BATCH * ctx * HKV * D * 2 * 2)
    fpool, fcache = paged_pool(frot * BATCH * width)
    fperm = rng.permutation(frot * BATCH * width).astype(np.int32)
    ftabs = [
        torch.from_numpy(
            fperm[r * BATCH * width : (r + 1) * BATCH * width].reshape(BATCH, width)
        ).cuda()
        for r in range(frot)
    ]

    def full_ours(r):
        def make(s):
            return decode_plan(fpool, ftabs[r], lens_t, HQ, max_seq_len=ctx, stream=s)

        return per_stream(
            make, lambda p: p.run(qs[r].view(torch.int16), 0, out=outs[r].view(torch.int16))
        )

    row["full_rotations"] = frot
    row["kvpool_full_us"] = graph_us([full_ours(r) for r in range(frot)])
    if flashinfer:
        try:
            ws = fi_wrappers(flashinfer, False, ftabs, lens, -1)
            fouts = [torch.empty_like(q) for q in qs[:frot]]
            row["flashinfer_full_us"] = graph_us(
                [(lambda s, r=r: ws[r].run(qs[r], fcache, out=fouts[r])) for r in range(frot)]
            )
        except Exception as e:
            traceback.print_exc()
            row["flashinfer_full_error"] = f"{type(e).__name__}: {e}"[:300]
    fpool = fcache = None
    torch.cuda.empty_cache()
    cp.get_default_memory_pool().free_all_blocks()
    fis = [row.get(k) for k in ("flashinfer_window_us", "flashinfer_tc_window_us") if row.get(k)]
    row["window_speedup_vs_best_flashinfer"] = (
        round(min(fis) / row["kvpool_window_us"], 3) if fis else None
    )
    row["window_vs_full_attention"] = round(row["kvpool_window_us"] / row["kvpool_full_us"], 4)
    return row


def warm():
    """Build FlashInfer's decode modules this routine times (JIT), on tiny inputs: run it while
    other work uses the GPU, so that the timed run finds them cached."""
    import flashinfer

    lens = np.full(2, 40, np.int32)
    _, cache = paged_pool(8)
    tables = [torch.arange(6, dtype=torch.int32, device="cuda").reshape(2, 3)]
    q = torch.randn(2, HQ, D, device="cuda").to(torch.bfloat16)
    for tc, wl in ((False, WINDOW - 1), (True, WINDOW - 1), (False, -1)):
        try:
            fi_wrappers(flashinfer, tc, tables, lens, wl)[0].run(q, cache)
            torch.cuda.synchronize()
            print("warm", tc, wl, flush=True)
        except Exception as e:
            print("refused", tc, wl, f"{type(e).__name__}: {e}"[:300], flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    out = ap.parse_args(argv).out
    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    result = {
        "provenance": provenance("bench/routines/window.py"),
        "shape": dict(dtype=DTYPE, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS),
        "timing": "median of 20 CUDA-graph replays of >= 8 calls rotating over R input sets",
        "flashinfer": getattr(flashinfer, "__version__", None),
        "rows": [],
    }
    for ctx in CONTEXTS:
        try:
            row = bench_context(ctx, flashinfer)
        except Exception as e:
            traceback.print_exc()
            row = {"context": ctx, "error": f"{type(e).__name__}: {e}"[:300]}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    rows = [r for r in result["rows"] if "kvpool_window_us" in r]
    if len(rows) == 2:
        result["window_time_64k_over_4k"] = round(
            rows[1]["kvpool_window_us"] / rows[0]["kvpool_window_us"], 3
        )
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    return 0
