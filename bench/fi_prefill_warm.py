"""Trigger FlashInfer's JIT builds of the paged prefill kernels prefill_bench.py times (fa2 and
fa3, fp16 and bf16, head_dim 128, causal), so they compile on the CPU while the GPU tests run."""

import flashinfer
import torch

HQ, HKV, D, BS = 32, 8, 128, 16
for tdt in (torch.float16, torch.bfloat16):
    cache = torch.randn(4, 2, BS, HKV, D, device="cuda").to(tdt)
    q = torch.randn(8, HQ, D, device="cuda").to(tdt)
    qo_indptr = torch.tensor([0, 4, 8], dtype=torch.int32, device="cuda")
    kv_indptr = torch.tensor([0, 2, 4], dtype=torch.int32, device="cuda")
    idx = torch.arange(4, dtype=torch.int32, device="cuda")
    last = torch.full((2,), BS, dtype=torch.int32, device="cuda")
    for backend in ("fa2", "fa3"):
        try:
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), "NHD", backend=backend
            )
            w.plan(
                qo_indptr,
                kv_indptr,
                idx,
                last,
                HQ,
                HKV,
                D,
                BS,
                causal=True,
                q_data_type=tdt,
                kv_data_type=tdt,
            )
            w.run(q, cache)
            torch.cuda.synchronize()
            print("warm", tdt, backend, flush=True)
        except Exception as e:
            print("warm failed", tdt, backend, type(e).__name__, str(e)[:200], flush=True)
