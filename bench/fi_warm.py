"""Trigger FlashInfer's JIT builds for every decode configuration decode_bench.py times, so that
they can compile (on the CPU) while the GPU tests run; the bench then finds them cached."""

import torch

import flashinfer

HKV, BS = 8, 16
CONFIGS = [("float16", 128, 32), ("bfloat16", 128, 32), ("float16", 64, 32),
           ("float16", 256, 32), ("float16", 128, 8)]
for dtype, d, hq in CONFIGS:
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    cache = torch.randn(4, 2, BS, HKV, d, device="cuda").to(tdt)
    q = torch.randn(2, hq, d, device="cuda").to(tdt)
    indptr = torch.tensor([0, 2, 4], dtype=torch.int32, device="cuda")
    idx = torch.arange(4, dtype=torch.int32, device="cuda")
    last = torch.full((2,), BS, dtype=torch.int32, device="cuda")
    for tc in (False, True):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(16 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=tc)
        w.plan(indptr, idx, last, hq, HKV, d, BS, q_data_type=tdt, kv_data_type=tdt)
        w.run(q, cache)
        torch.cuda.synchronize()
        print("warm", dtype, d, hq, tc, flush=True)
