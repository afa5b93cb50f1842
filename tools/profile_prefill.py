"""One paged prefill launch to profile with Nsight Compute: fp16, Hq 32 / Hkv 8, D 128, page 16,
causal, one sequence of 8192 new tokens on shuffled pages, the kernel forced by the first
argument (sm80 or sm90). Runs the plan twice (the first compiles and loads the module), e.g.

    ncu --clock-control none -k regex:paged_prefill --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 tools/profile_prefill.py sm90
"""

import sys

import cupy as cp
import kvpool
import numpy as np
from kvpool.kernels import _tuning, prefill_plan

kernel = sys.argv[1] if len(sys.argv) > 1 else "sm90"
hq, hkv, d, bs, n = 32, 8, 128, 16, 8192
rng = np.random.default_rng(0)
pool = kvpool.Pool(kvpool.KvLayout(1, hkv, d, bs, "float16"), n // bs + 8, device="cuda")
for view in (pool.k_view(0), pool.v_view(0)):
    a = cp.asarray(view)
    a[...] = cp.asarray(rng.standard_normal(a.shape, dtype=np.float32)).astype(cp.float16)
tables = cp.asarray(rng.permutation(pool.num_blocks)[: n // bs].astype(np.int32)[None])
q = cp.asarray(rng.standard_normal((n, hq, d), dtype=np.float32)).astype(cp.float16)
with _tuning.override(prefill_kernel=kernel):
    plan = prefill_plan(pool, np.array([0, n]), tables, np.array([n]), hq)
out = plan.run(q, 0)
plan.run(q, 0, out=out)
cp.cuda.Device().synchronize()
print(f"profiled {kernel}: sm90={plan.variant.sm90}, {plan.work.num_items} items")
