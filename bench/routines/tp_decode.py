"""Tensor-parallel decode on two GPUs against one GPU, same run, large decode shapes.

fp16, 32 query / 8 KV heads, head_dim 128, block 16, shuffled blocks, one layer. One GPU: the
full pool on cuda:0. Two GPUs: a PoolGroup (4 KV heads and 16 query heads per rank), both
ranks' decodes launched back to back on their pool streams. Each setup's decode plans are made
once, outside the timing. Time per step: host wall time of R runs of them (after a warm-up),
both devices synchronised before and after, so the two setups are timed the same way. The TP
output is checked against the one-GPU output first (bit for bit with one split). Usage:

    python bench/kvbench.py --routine tp_decode [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from provenance import provenance
from timing import launches_wall_us

SHAPES = [(32, 4096), (128, 1024), (256, 2048), (64, 8192)]
HQ, HKV, D, BS = 32, 8, 128, 16
REPS = 50


def _fill(cupy, group, single):
    """Random K/V in every block of the one-GPU pool, and each rank's heads of it in the
    rank's shard (the tables allocate the same ids on both, so block b matches)."""
    num_blocks = group.num_blocks
    with cupy.cuda.Device(0):
        cupy.random.seed(1)
        k = cupy.asarray(single.k_view(0))
        v = cupy.asarray(single.v_view(0))
        k[...] = cupy.random.standard_normal(k.shape, dtype=cupy.float32).astype(cupy.float16)
        v[...] = cupy.random.standard_normal(v.shape, dtype=cupy.float32).astype(cupy.float16)
        cupy.cuda.Device(0).synchronize()
    for rank, pool in enumerate(group.pools):
        a, b = group.head_range(rank)
        with cupy.cuda.Device(rank):
            for view, full in ((pool.k_view(0), k), (pool.v_view(0), v)):
                dst = cupy.asarray(view)
                src = full[:num_blocks, :, a:b, :]
                dst[...] = cupy.asarray(src) if rank == 0 else cupy.asarray(cupy.asnumpy(src))
            cupy.cuda.Device(rank).synchronize()


def _time(cupy, launch, devices) -> float:
    """Microseconds per launch, every device in `devices` drained around the launches."""

    def drain():
        for d in devices:
            cupy.cuda.Device(d).synchronize()

    return launches_wall_us(launch, drain, REPS)


def run_shape(cupy, kvpool, batch, seq_len):
    rng = np.random.default_rng(0)
    layout = kvpool.KvLayout(1, HKV, D, BS)
    num_blocks = batch * seq_len // BS + 64
    group = kvpool.PoolGroup(layout, 2, num_blocks, devices="cuda")
    single = kvpool.Pool(layout, num_blocks, device="cuda:0")
    width = seq_len // BS
    max_seqs = max(batch, 64)  # the 64 shuffling requests below are live at once
    tables = group.tables(max_seqs, width)
    ref_tables = kvpool.BlockTables(single, max_seqs, width)
    for t in (tables, ref_tables):  # shuffle both free lists the same way
        for i in range(64):
            t.add(10_000 + i, BS)
        for i in np.random.default_rng(1).permutation(64):
            t.free(10_000 + int(i))
        for rid in range(batch):
            t.add(rid, seq_len)
    _fill(cupy, group, single)
    q = rng.standard_normal((batch, HQ, D)).astype(np.float16)
    per_rank = group.sync(tables)
    bt, sl = ref_tables.sync()
    with cupy.cuda.Device(0):
        q0 = cupy.asarray(q)
        out0 = cupy.empty_like(q0)
    qs, outs = [], []
    for rank in (0, 1):
        with cupy.cuda.Device(rank):
            qs.append(cupy.asarray(q[:, 16 * rank : 16 * (rank + 1)]))
            outs.append(cupy.empty_like(qs[-1]))

    def plans(num_splits=None):
        """The one-GPU decode plan and the ranks' plans, made once before their runs are timed
        (a serving step plans once and runs per layer)."""
        with cupy.cuda.Device(0):
            one_plan = kvpool.decode_plan(
                single,
                bt,
                sl,
                HQ,
                max_seq_len=seq_len,
                num_splits=num_splits,
                stream=single.stream,
            )
        rank_plans = []
        for rank, pool in enumerate(group.pools):
            with cupy.cuda.Device(rank):
                rank_plans.append(
                    kvpool.decode_plan(
                        pool,
                        *per_rank[rank],
                        qs[rank].shape[1],
                        max_seq_len=seq_len,
                        num_splits=num_splits,
                        stream=pool.stream,
                    )
                )
        return one_plan, rank_plans

    def one_gpu(plan):
        def launch():
            with cupy.cuda.Device(0):
                plan.run(q0, 0, out=out0)

        return launch

    def tensor_parallel(rank_plans):
        def launch():
            for rank, plan in enumerate(rank_plans):
                with cupy.cuda.Device(rank):
                    plan.run(qs[rank], 0, out=outs[rank])

        return launch

    unsplit_one, unsplit_tp = plans(1)
    one_gpu(unsplit_one)()
    tensor_parallel(unsplit_tp)()
    for d in (0, 1):
        cupy.cuda.Device(d).synchronize()
    got = np.concatenate([cupy.asnumpy(o) for o in outs], axis=1)
    equal = bool((got == cupy.asnumpy(out0)).all())
    one_plan, rank_plans = plans()
    one_us = _time(cupy, one_gpu(one_plan), [0])
    tp_us = _time(cupy, tensor_parallel(rank_plans), [0, 1])
    kv_bytes = batch * seq_len * 2 * HKV * D * 2
    return {
        "batch": batch,
        "seq_len": seq_len,
        "kv_mb": round(kv_bytes / 1e6),
        "one_gpu_us": round(one_us, 2),
        "tp2_us": round(tp_us, 2),
        "speedup": round(one_us / tp_us, 3),
        "tp_equals_one_gpu_bitwise_one_split": equal,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.environ.update(
        {
            "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1",
        }
    )
    import cupy
    import kvpool

    rows = []
    for batch, seq_len in SHAPES:
        row = run_shape(cupy, kvpool, batch, seq_len)
        print(json.dumps(row), flush=True)
        rows.append(row)
    doc = {
        "benchmark": "tp_decode",
        "provenance": provenance("bench/routines/tp_decode.py"),
        "gpus": [cupy.cuda.runtime.getDeviceProperties(d)["name"].decode() for d in (0, 1)],
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "method": f"host wall time of {REPS} launches, both devices synchronised around them",
        "shape": {"hq": HQ, "hkv": HKV, "head_dim": D, "block_size": BS, "dtype": "float16"},
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0 if all(r["tp_equals_one_gpu_bitwise_one_split"] for r in rows) else 1
