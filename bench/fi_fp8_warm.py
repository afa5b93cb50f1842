"""Trigger FlashInfer's JIT builds of the fp8 decode fp8_bench.py times (fp16 queries, e4m3
cache, Hq 32, Hkv 8, D 128, page 16, both modes), so they compile on the CPU while the GPU
tests run."""

import flashinfer
import torch

HKV, HQ, D, BS = 8, 32, 128, 16
cache = torch.randn(4, 2, BS, HKV, D, device="cuda").to(torch.float8_e4m3fn)
q = torch.randn(2, HQ, D, device="cuda").half()
indptr = torch.tensor([0, 2, 4], dtype=torch.int32, device="cuda")
idx = torch.arange(4, dtype=torch.int32, device="cuda")
last = torch.full((2,), BS, dtype=torch.int32, device="cuda")
for tc in (False, True):
    try:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(16 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=tc
        )
        w.plan(
            indptr,
            idx,
            last,
            HQ,
            HKV,
            D,
            BS,
            q_data_type=torch.float16,
            kv_data_type=torch.float8_e4m3fn,
        )
        w.run(q, cache, k_scale=0.5, v_scale=0.5)
        torch.cuda.synchronize()
        print("warm fp8 tc" if tc else "warm fp8", flush=True)
    except Exception as e:
        print("refused fp8", tc, f"{type(e).__name__}: {e}"[:300], flush=True)
