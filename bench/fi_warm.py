"""Trigger FlashInfer's JIT builds for every decode configuration decode_bench.py times, so that
they can compile (on the CPU) while the GPU tests run; the bench then finds them cached. A
configuration FlashInfer refuses is reported and skipped (the bench records the same refusal)."""

import flashinfer
import torch

HKV = 8
# (dtype, head_dim, num_q_heads, block_size)
CONFIGS = [
    ("float16", 128, 32, 16),
    ("bfloat16", 128, 32, 16),
    ("float16", 64, 32, 16),
    ("float16", 256, 32, 16),
    ("float16", 128, 8, 16),
    ("float16", 80, 32, 16),
    ("float16", 96, 32, 16),
    ("float16", 112, 32, 16),
    ("float16", 192, 32, 16),
    ("float16", 128, 32, 1),
    ("float16", 128, 32, 64),
    ("float16", 128, 32, 128),
    ("float16", 128, 64, 16),
    ("bfloat16", 128, 64, 16),
]
for dtype, d, hq, bs in CONFIGS:
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    cache = torch.randn(4, 2, bs, HKV, d, device="cuda").to(tdt)
    q = torch.randn(2, hq, d, device="cuda").to(tdt)
    indptr = torch.tensor([0, 2, 4], dtype=torch.int32, device="cuda")
    idx = torch.arange(4, dtype=torch.int32, device="cuda")
    last = torch.full((2,), bs, dtype=torch.int32, device="cuda")
    for tc in (False, True):
        try:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                torch.empty(16 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=tc
            )
            w.plan(indptr, idx, last, hq, HKV, d, bs, q_data_type=tdt, kv_data_type=tdt)
            w.run(q, cache)
            torch.cuda.synchronize()
            print("warm", dtype, d, hq, bs, tc, flush=True)
        except Exception as e:
            print("refused", dtype, d, hq, bs, tc, f"{type(e).__name__}: {e}"[:200], flush=True)
