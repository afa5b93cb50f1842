"""A small decode (plain and split), append and copy, to run under compute-sanitizer memcheck."""

import cupy as cp
import numpy as np

import kvpool
from kvpool.kernels import append_kv, copy_blocks, paged_attention_decode

rng = np.random.default_rng(0)
for dtype in ("float16", "bfloat16"):
    pool = kvpool.Pool(kvpool.KvLayout(2, 2, 128, 16, dtype), 24, device="cuda")
    for layer in range(2):
        for view in (pool.k_view(layer), pool.v_view(layer)):
            a = cp.asarray(view)
            a[...] = cp.asarray(rng.integers(0, 0x3C00, size=a.shape, dtype=np.uint16)).view(a.dtype)
    lens = np.array([1, 15, 17, 100], dtype=np.int32)
    tables = np.full((4, 9), -1, dtype=np.int32)
    ids = rng.permutation(24)
    at = 0
    for i, n in enumerate(lens):
        nb = -(-n // 16)
        tables[i, :nb] = ids[at:at + nb]
        at += nb
    q = cp.asarray(rng.integers(0, 0x3C00, size=(4, 8, 128), dtype=np.uint16))
    if dtype == "float16":
        q = q.view(cp.float16)
    for splits in (None, 1, 3):
        out = paged_attention_decode(q, pool, 1, cp.asarray(tables), cp.asarray(lens),
                                     num_splits=splits)
    slots = cp.asarray(np.array([5, -1, 300, 383], dtype=np.int64))
    kv = cp.asarray(rng.integers(0, 0x3C00, size=(4, 2, 128), dtype=np.uint16))
    if dtype == "float16":
        kv = kv.view(cp.float16)
    append_kv(kv, kv, pool, 0, slots)
    copy_blocks(pool, np.array([[0, 1], [2, 3]]))
cp.cuda.Device().synchronize()
print("sanitize case done")
