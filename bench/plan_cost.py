"""Wall time per decode_plan + run on one layer, with and without max_seq_len (32 x 300 tokens,
bf16, Hq 32, Hkv 8, D 128, page 16): the cost of the device read-back that omitting it costs."""

import json
import sys
import time

import kvpool
import numpy as np
import torch

lay = kvpool.KvLayout(1, 8, 128, 16, "bfloat16")
pool = kvpool.Pool(lay, 32 * 20 + 8, device="cuda")
tables = kvpool.BlockTables(pool, 32, 20)
for i in range(32):
    tables.add(i, 300)
bt, sl = tables.sync()
q = torch.randn(32, 32, 128, dtype=torch.bfloat16, device="cuda")
out = torch.empty_like(q)


def once(bound):
    plan = kvpool.decode_plan(pool, bt, sl, 32, max_seq_len=bound)
    plan.run(q, 0, out=out)


rows = {}
for name, bound in (("with_max_seq_len", 320), ("without_max_seq_len", None)):
    for _ in range(50):
        once(bound)
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        for _ in range(100):
            once(bound)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / 100)
    rows[name] = {"median_us": 1e6 * float(np.median(times)), "min_us": 1e6 * min(times)}
rows["shape"] = (
    "32 seqs x 300 tokens, bf16, Hq 32, Hkv 8, D 128, block 16; plan + one run per call, 20 x 100 calls"
)
rows["gpu"] = torch.cuda.get_device_name()
with open(sys.argv[1], "w") as f:
    json.dump(rows, f, indent=1)
print(json.dumps(rows))
