"""The Hopper prefill kernel against the Ampere one on a few shapes (needs compute capability
9.0): per case the relative L2 difference of the outputs, and where it is large, which query
rows (in 16-row warp slices of the 128-row tile) and which 64-column blocks of the head carry
it, to tell a fragment-layout slip from a masking one. Prints one line per case; exit status 1
when any case differs by more than 1e-2."""

import sys

import cupy as cp
import kvpool
import numpy as np
from kvpool.kernels import _tuning, prefill_plan

CASES = [  # (dtype, head_dim, Hq, Hkv, qo_lens, prefixes, causal)
    ("float16", 128, 8, 8, [128], [0], False),
    ("float16", 128, 8, 8, [128], [0], True),
    ("float16", 128, 32, 8, [300, 1, 77], [0, 500, 64], True),
    ("bfloat16", 128, 32, 8, [256], [1000], True),
    ("float16", 64, 16, 2, [200], [37], True),
    ("bfloat16", 256, 8, 8, [150], [10], False),
]


def run(kernel, pool, indptr, tables, lens, hq, q, causal, tma=False):
    with _tuning.override(prefill_kernel=kernel, prefill_tma=tma):
        plan = prefill_plan(pool, indptr, tables, lens, hq, causal=causal)
    return plan.run(q, 0), plan


def main() -> int:
    rng = np.random.default_rng(0)
    bad = 0
    for dtype, d, hq, hkv, qo, pre, causal in CASES:
        bs = 16
        lens = np.array(qo) + np.array(pre)
        nblk = int(sum(-(-n // bs) for n in lens)) + 4
        pool = kvpool.Pool(kvpool.KvLayout(1, hkv, d, bs, dtype), nblk, device="cuda")
        for view in (pool.k_view(0), pool.v_view(0)):
            a = cp.asarray(view)
            a[...] = cp.asarray(rng.standard_normal(a.shape, dtype=np.float32)).astype(cp.float16)
            if dtype == "bfloat16":  # bf16 bits of the same values
                f = cp.asarray(rng.standard_normal(a.shape, dtype=np.float32))
                a[...] = (f.view(cp.uint32) >> 16).astype(cp.uint16).view(a.dtype)
        ids = rng.permutation(nblk)
        width = max(-(-int(n) // bs) for n in lens)
        tables = np.full((len(lens), width), -1, np.int32)
        at = 0
        for i, n in enumerate(lens):
            k = -(-int(n) // bs)
            tables[i, :k] = ids[at : at + k]
            at += k
        indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
        tq = int(indptr[-1])
        qf = cp.asarray(rng.standard_normal((tq, hq, d), dtype=np.float32))
        q = (
            qf.astype(cp.float16)
            if dtype == "float16"
            else ((qf.view(cp.uint32) >> 16).astype(cp.uint16))
        )
        dt = cp.asarray(tables)
        ref, _ = run("sm80", pool, indptr, dt, lens.astype(np.int32), hq, q, causal)
        for tma in (False, True):
            got, plan = run("sm90", pool, indptr, dt, lens.astype(np.int32), hq, q, causal, tma)
            bad += _report(dtype, d, hq, hkv, qo, pre, causal, ref, got, plan)
    return 1 if bad else 0


def _report(dtype, d, hq, hkv, qo, pre, causal, ref, got, plan) -> int:
    """Prints the case's line; 1 when it differs by more than 1e-2, else 0."""

    def f64(x):
        if dtype == "bfloat16":
            return cp.asnumpy((x.astype(cp.uint32) << 16).view(cp.float32)).astype(np.float64)
        return cp.asnumpy(x).astype(np.float64)

    r, g = f64(ref), f64(got)
    err = np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)
    line = (
        f"{dtype} D{d} Hq{hq}/Hkv{hkv} qo{qo} prefix{pre} causal={causal} "
        f"sm90={plan.variant.sm90} tma={plan.variant.tma} splits={plan.num_splits}: "
        f"rel {err:.2e}"
    )
    bad = 0
    if not np.isfinite(err) or err > 1e-2:
        bad = 1
        diff = np.abs(g - r)
        tok_err = np.nanmax(diff, axis=(1, 2))
        col_err = [float(np.nanmax(diff[..., c : c + 64])) for c in range(0, d, 64)]
        line += f"\n   worst tokens {np.argsort(-np.nan_to_num(tok_err, nan=1e9))[:8].tolist()}"
        line += f" nan {int(np.isnan(g).sum())}; by 64-col block {np.round(col_err, 3).tolist()}"
        line += f"\n   first rows sm90 {g[0, 0, :4].round(3).tolist()} sm80 {r[0, 0, :4].round(3).tolist()}"
    print(line, flush=True)
    return bad


if __name__ == "__main__":
    sys.exit(main())
