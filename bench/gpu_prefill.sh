#!/usr/bin/env bash
# Paged prefill on the GPU box in one call, from the repository root, after the wheel is built
# here (`maturin build --release --locked -o dist`) and FlashInfer's wheels are in .whl/
# (optional: without them the bench reports FlashInfer "not run"), both copied to the GPU
# machine:   COMMIT=<sha> bash bench/gpu_prefill.sh
# Everything lands in $OUT/prefill/: the GPU test log and error report, the sanitizer logs, the
# bench JSON and log. Typically ~4 minutes; the timeouts keep the worst case under 10.
set -u
P="$OUT/prefill"
mkdir -p "$P"
python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl || exit 1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || echo "flashinfer install failed"
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
export CUDA_HOME=$(dirname $(dirname $(which nvcc))) FLASHINFER_CUDA_ARCH_LIST=9.0a
COMMIT=${COMMIT:-unknown}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo "commit $COMMIT"; date -u; } > "$P/gpu.txt"

# FlashInfer's JIT builds compile on the CPU while the GPU tests run.
timeout 420 python3 bench/fi_prefill_warm.py > "$P/fi_warm.log" 2>&1 &
WARM=$!

echo "== GPU tests (prefill)"
KVPOOL_ERROR_REPORT="$P/prefill_errors.json" timeout 180 python3 -m pytest -q -rs -m gpu \
  tests/test_prefill_gpu.py --durations=8 2>&1 | tee "$P/gpu_tests.log" | tail -25

echo "== compute-sanitizer memcheck + racecheck (small prefill)"
for tool in memcheck racecheck; do
  limit=$([ $tool = memcheck ] && echo 70 || echo 90)
  timeout $limit compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/sanitize_prefill_case.py \
    > "$P/sanitizer_$tool.log" 2>&1
  echo "$tool exit $?"; tail -2 "$P/sanitizer_$tool.log"
done

wait $WARM; tail -4 "$P/fi_warm.log"
echo "== bench"
timeout 170 python3 bench/prefill_bench.py "$P/prefill_h200.json" --commit "$COMMIT" 2>&1 | tee "$P/bench.log" | tail -15
