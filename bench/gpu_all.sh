#!/usr/bin/env bash
# Every GPU test and GPU benchmark in one call on the H200 box (see ../shared/GPU.md): build the
# wheel here (`maturin build --release --locked -o dist`), then through the device tool with
# carry ["dist"]:  COMMIT=<sha> bash bench/gpu_all.sh
# Results land in $OUT; copy them into bench/results/.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
COMMIT=${COMMIT:-unknown}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo "commit $COMMIT"; date -u; } > "$OUT/gpu.txt"

python3 -m pytest -q -rs -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -15

{
  echo "== pool: CUDA block alloc+free vs cudaMalloc/cudaFree"
  python3 bench/pool_bench.py --device cuda --out "$OUT/pool_cuda.json" --extension-note "release wheel $COMMIT"
  echo "== tables: append_tokens_many + sync vs NumPy rebuild + cupy.asarray"
  python3 bench/tables_bench.py --device cuda --out "$OUT/tables_cuda.json" --commit "$COMMIT"
  echo "== growable: VMM growth vs allocate-copy-free"
  python3 bench/growable_bench.py --out "$OUT/growable_h200.json"
  echo "== simulate --device cuda (measured decode attention)"
  python3 bench/sim_bench.py --device cuda --num-requests 2000 && cp bench/results/simulate_*_cuda.json "$OUT/"
} 2>&1 | tee "$OUT/bench.log" | grep -vE '^\s*$' | tail -40

echo "== compute-sanitizer memcheck over the table-upload tests"
timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu tests/test_tables_gpu.py \
  > "$OUT/sanitizer_tables.log" 2>&1; echo "sanitizer exit $?"; tail -3 "$OUT/sanitizer_tables.log"
