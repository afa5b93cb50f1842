#!/usr/bin/env bash
# On the box: bash .gpurun/hy-kern/run.sh  (carry [".gpurun/hy-kern", ".whl"])
set -u
ROOT=$PWD
cd "$ROOT/.gpurun/hy-kern"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$ROOT"/.whl/*.whl 2>&1 | grep -v WARNING
export KVPOOL_CUDA_DIR=$PWD/cuda PYTHONPATH=$PWD/python:$PWD/tests:/tmp/site PYTHONUNBUFFERED=1
C=$(cat COMMIT)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "commit $C"; date -u; } | tee "$OUT/log"
(cd bench && timeout 200 python3 -c "from routines import window; window.warm()") > "$OUT/fi_warm.log" 2>&1 &
P=(-q -rs -p no:cacheprovider -m gpu)
KVPOOL_ERROR_REPORT=$OUT/window_errors.json timeout 220 python3 -m pytest "${P[@]}" tests/test_window_gpu.py > "$OUT/window_tests.log" 2>&1 &
timeout 220 python3 -m pytest "${P[@]}" tests/test_kernels_gpu.py > /tmp/t1.log 2>&1 &
timeout 220 python3 -m pytest "${P[@]}" tests/test_prefill_gpu.py > /tmp/t2.log 2>&1 &
timeout 220 python3 -m pytest "${P[@]}" tests/test_decode_coverage_gpu.py tests/test_kernel_plans_gpu.py > /tmp/t3.log 2>&1 &
timeout 220 python3 -m pytest "${P[@]}" tests/test_fp8_gpu.py > /tmp/t4.log 2>&1 &
wait
date -u >> "$OUT/log"
for f in /tmp/t1.log /tmp/t2.log /tmp/t3.log /tmp/t4.log; do echo "== $f"; tail -40 $f; done > "$OUT/other_tests.log"
tail -3 "$OUT/window_tests.log" /tmp/t*.log >> "$OUT/log"
cd bench && timeout 110 python3 kvbench.py --routine window --out "$OUT" --name window --commit "$C" > "$OUT/bench.log" 2>&1
echo "bench rc $?" >> "$OUT/log"; date -u >> "$OUT/log"
tail -4 "$OUT/bench.log" >> "$OUT/log"
