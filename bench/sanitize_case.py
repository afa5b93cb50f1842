"""Small decodes (plain, forced split through the fused merge, planned split), append and copy,
to run under compute-sanitizer memcheck and racecheck: page sizes 16, 2 (several blocks per
16-token tile) and 1, head dims 128, 80 (padded to 80, odd shared-memory row stride) and 40
(padded to 48), a ragged 3-head tile, both dtypes."""

import cupy as cp
import numpy as np

import kvpool
from kvpool.kernels import append_kv, copy_blocks, paged_attention_decode

rng = np.random.default_rng(0)
# (block_size, head_dim, num_kv_heads, num_q_heads, lengths)
CASES = [(16, 128, 2, 8, [1, 15, 17, 100]), (2, 80, 2, 6, [1, 2, 3, 130]),
         (1, 40, 1, 3, [1, 7, 600])]
for dtype in ("float16", "bfloat16"):
    for bs, d, hkv, hq, lens in CASES:
        lens = np.array(lens, dtype=np.int32)
        need = [-(-int(n) // bs) for n in lens]
        num_blocks = sum(need) + 1
        pool = kvpool.Pool(kvpool.KvLayout(2, hkv, d, bs, dtype), num_blocks, device="cuda")
        for layer in range(2):
            for view in (pool.k_view(layer), pool.v_view(layer)):
                a = cp.asarray(view)
                a[...] = cp.asarray(rng.integers(0, 0x3C00, size=a.shape, dtype=np.uint16)).view(
                    a.dtype)
        tables = np.full((len(lens), max(need) + 1), -1, dtype=np.int32)
        ids = rng.permutation(num_blocks)
        at = 0
        for i, n in enumerate(need):
            tables[i, :n] = ids[at:at + n]
            at += n
        q = cp.asarray(rng.integers(0, 0x3C00, size=(len(lens), hq, d), dtype=np.uint16))
        if dtype == "float16":
            q = q.view(cp.float16)
        for splits in (None, 1, 3):
            paged_attention_decode(q, pool, 1, cp.asarray(tables), cp.asarray(lens),
                                   num_splits=splits)
        if bs == 16:
            slots = cp.asarray(np.array([5, -1, 300, num_blocks * bs - 1], dtype=np.int64))
            kv = cp.asarray(rng.integers(0, 0x3C00, size=(4, hkv, d), dtype=np.uint16))
            if dtype == "float16":
                kv = kv.view(cp.float16)
            append_kv(kv, kv, pool, 0, slots)
            copy_blocks(pool, np.array([[0, 1], [2, 3]]))
cp.cuda.Device().synchronize()
print("sanitize case done")
