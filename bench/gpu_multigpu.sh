#!/usr/bin/env bash
# Two-GPU checks and benchmarks in one call on the nvidia-h200-x2 box, run from the repository
# root after the wheel is installed and PYTHONPATH points at it (or with dist/*.whl carried:
# this script installs it). Results land in $OUT/multigpu/; copy them into bench/results/.
#   COMMIT=<sha> bash bench/gpu_multigpu.sh
# NVLink multicast stays off in this process and everything it starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
set -u
export PYTHONUNBUFFERED=1
if [ -z "${PYTHONPATH:-}" ] && ls dist/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
COMMIT=${COMMIT:-unknown}
R="$OUT/multigpu"
mkdir -p "$R"
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; nvidia-smi topo -m;
  echo "commit $COMMIT"; date -u; env | grep -E 'NVLS|MULTICAST'; } > "$R/gpu.txt" 2>&1
python3 -c 'import cupy, kvpool; from kvpool.transfer.nccl import load_nccl; n = load_nccl(); print("devices", cupy.cuda.runtime.getDeviceCount(), "nccl", n.get_version())' 2>&1 | tee -a "$R/gpu.txt"

echo "== gpu2 tests (TP decode vs one GPU; transfers of 1/7/64/1024 blocks between two processes; interrupted transfer)"
timeout 300 python3 -m pytest -q -rs -m gpu2 tests 2>&1 | tee "$R/gpu2_tests.log" | tail -15
echo "== single-GPU table-upload tests (the upload now keeps one uploader per device)"
timeout 200 python3 -m pytest -q -m gpu tests/test_tables_gpu.py 2>&1 | tee "$R/gpu_tests.log" | tail -5

echo "== transfer benchmark (Llama-3-8B blocks, 1..4096, vs NCCL contiguous and cudaMemcpyPeer)"
timeout 420 python3 bench/transfer_bench.py --out "$R/transfer_h200x2.json" --commit "$COMMIT" 2>&1 | tee "$R/transfer_bench.log" | tail -12
echo "== TP decode: two GPUs vs one"
timeout 240 python3 bench/tp_decode_bench.py --out "$R/tp_decode_h200x2.json" --commit "$COMMIT" 2>&1 | tee "$R/tp_decode_bench.log" | tail -6
