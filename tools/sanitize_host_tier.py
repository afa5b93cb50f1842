"""A small host-tier swap case for compute-sanitizer memcheck: fragmented requests swapped
out and back with each copy method, then a decode over them. Exits non-zero if the bytes do
not survive the round trip."""

from __future__ import annotations

import cupy as cp
import kvpool
import numpy as np

BS = 16
layout = kvpool.KvLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=BS)
for method in ("batch", "runs"):
    pool = kvpool.Pool(layout, 64, device="cuda")
    tables = kvpool.BlockTables(pool, 16, 16)
    tier = kvpool.HostTier(tables, 64, copy_method=method)
    for i, n in enumerate([3, 40, 17, 100]):
        tables.add(100 + i, BS)
        tables.add(i, n)
        tables.free(100 + i)
    ids = [0, 1, 2, 3]
    nbytes = pool.num_blocks * pool.block_bytes
    mem = cp.cuda.UnownedMemory(pool.base_ptr, nbytes, pool)
    slab = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
    slab[...] = cp.asarray(np.random.default_rng(0).integers(0, 64, nbytes, dtype=np.uint8))
    cp.cuda.runtime.deviceSynchronize()
    before = [cp.asnumpy(cp.asarray(pool.k_view(0))[cp.asarray(tables.blocks(r))]) for r in ids]
    tier.swap_out(ids)
    tier.wait()
    slab[...] = 0xA5
    cp.cuda.runtime.deviceSynchronize()
    tier.swap_in(ids)
    tier.wait()
    table, lens = tables.block_table(ids), tables.seq_lens(ids)
    q = cp.asarray(np.random.default_rng(1).standard_normal((4, 4, 64)).astype(np.float16))
    out = kvpool.paged_attention_decode(
        q,
        pool,
        0,
        cp.asarray(table),
        cp.asarray(lens),
        stream=cp.cuda.Stream.from_external(pool.stream),
    )
    cp.cuda.runtime.deviceSynchronize()
    after = [cp.asnumpy(cp.asarray(pool.k_view(0))[cp.asarray(tables.blocks(r))]) for r in ids]
    for b, a in zip(before, after):
        assert (b.view(np.uint16) == a.view(np.uint16)).all(), method
    assert not np.isnan(cp.asnumpy(out)).any()
    del tier
print("hosttier sanitize case OK")
