#!/usr/bin/env bash
# On the box: bash .gpurun/integ/run.sh  (carry [".gpurun/integ"])
set -u
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site
cd repo
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
git_commit=$(cat COMMIT); echo "commit $git_commit" | tee -a "$OUT/gpu.txt"
timeout 230 python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
  tests/test_pool_gpu.py tests/test_pool_memory_modes.py tests/test_tables_gpu.py tests/test_hybrid_gpu.py \
  tests/test_hybrid.py tests/test_host_tier_gpu.py tests/test_growable_gpu.py tests/test_hardening_core_gpu.py \
  tests/test_torch_native_gpu.py tests/test_kernel_plans_gpu.py tests/test_paged_metadata_gpu.py \
  tests/test_swap_scheduler_gpu.py 2>&1 | tail -25 | tee "$OUT/core_gpu_tests.txt"
timeout 230 python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
  tests/test_kernels_gpu.py tests/test_prefill_gpu.py tests/test_decode_coverage_gpu.py 2>&1 | tail -25 | tee "$OUT/kernel_gpu_tests.txt"
