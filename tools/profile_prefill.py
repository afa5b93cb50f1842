"""One paged prefill launch to profile with Nsight Compute: fp16, Hq 32 / Hkv 8, D 128, page 16,
causal, on shuffled pages, the kernel forced by the first argument (sm80 or sm90); the batch by
the next three (sequences, new tokens each, cached prefix each; default 1 8192 0). Runs the
plan twice (the first compiles and loads the module), e.g.

    ncu --clock-control none -k regex:paged_prefill --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 tools/profile_prefill.py sm90
"""

import sys

import cupy as cp
import kvpool
import numpy as np
from kvpool.kernels import _tuning, prefill_plan

kernel = sys.argv[1] if len(sys.argv) > 1 else "sm90"
seqs, n, prefix = (int(a) for a in sys.argv[2:5]) if len(sys.argv) > 4 else (1, 8192, 0)
hq, hkv, d, bs = 32, 8, 128, 16
rng = np.random.default_rng(0)
per_seq = -(-(n + prefix) // bs)
pool = kvpool.Pool(kvpool.KvLayout(1, hkv, d, bs, "float16"), seqs * per_seq + 8, device="cuda")
for view in (pool.k_view(0), pool.v_view(0)):
    a = cp.asarray(view)
    a[...] = cp.asarray(rng.standard_normal(a.shape, dtype=np.float32)).astype(cp.float16)
ids = rng.permutation(pool.num_blocks)[: seqs * per_seq].astype(np.int32)
tables = cp.asarray(ids.reshape(seqs, per_seq))
indptr = np.arange(seqs + 1, dtype=np.int32) * n
lens = np.full(seqs, n + prefix, np.int32)
q = cp.asarray(rng.standard_normal((seqs * n, hq, d), dtype=np.float32)).astype(cp.float16)
with _tuning.override(prefill_kernel=kernel):
    plan = prefill_plan(pool, indptr, tables, lens, hq)
out = plan.run(q, 0)
plan.run(q, 0, out=out)
cp.cuda.Device().synchronize()
print(
    f"profiled {kernel}: {seqs} x {n} on {prefix}, sm90={plan.variant.sm90}, {plan.work.num_items} items"
)
