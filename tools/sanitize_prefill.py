"""A small prefill (mixed batch, causal and not, split and not, two block sizes) to run under
compute-sanitizer memcheck and racecheck: the Ampere kernel, and on compute capability 9.0 the
Hopper kernel too (_tuning's prefill_kernel forced to each), with cp.async and with TMA K/V
loads (prefill_tma; both block sizes here are TMA pages)."""

import cupy as cp
import kvpool
import numpy as np
from kvpool.kernels import _tuning, prefill_plan

rng = np.random.default_rng(0)
for dtype, d, bs in (("float16", 128, 16), ("bfloat16", 64, 8)):
    pool = kvpool.Pool(kvpool.KvLayout(1, 2, d, bs, dtype), 64, device="cuda")
    for view in (pool.k_view(0), pool.v_view(0)):
        a = cp.asarray(view)
        a[...] = cp.asarray(rng.integers(0, 0x3C00, size=a.shape, dtype=np.uint16)).view(a.dtype)
    qo = np.array([1, 70, 3, 17], dtype=np.int32)
    lens = np.array([1, 70, 150, 40], dtype=np.int32)
    indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    tables = np.full((4, 24), -1, dtype=np.int32)
    ids = rng.permutation(64)
    at = 0
    for i, n in enumerate(lens):
        nb = -(-int(n) // bs)
        tables[i, :nb] = ids[at : at + nb]
        at += nb
    q = cp.asarray(rng.integers(0, 0x3C00, size=(int(qo.sum()), 8, d), dtype=np.uint16))
    if dtype == "float16":
        q = q.view(cp.float16)
    device_tables = cp.asarray(tables)
    kernels = [("sm80", False)]
    if int(cp.cuda.Device().compute_capability) == 90:
        kernels += [("sm90", False), ("sm90", True)]  # cp.async and TMA K/V loads
    for kernel, tma in kernels:
        for causal in (True, False):
            for splits in (None, 1, 3):
                with _tuning.override(prefill_kernel=kernel, prefill_tma=tma):
                    plan = prefill_plan(
                        pool, indptr, device_tables, lens, 8, causal=causal, num_splits=splits
                    )
                plan.run(q, 0)
cp.cuda.Device().synchronize()
print("sanitize prefill case done")
