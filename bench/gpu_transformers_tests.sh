#!/usr/bin/env bash
# The transformers integration's tests on one H200, from the repository root, in under 5 minutes
# (no benchmark): the GPU tests (generation loop, KvpoolCache under model.generate, teacher-forced
# logits, CUDA graphs, DLPack views), the paged_metadata kernel against its reference (poisoned
# outputs, CUDA-graph replay), and the host-pool transformers tests. Build the wheel here
# (`maturin build --release --locked -o dist`), then on the GPU machine, with dist/ copied there:
#     COMMIT=<sha> bash bench/gpu_transformers_tests.sh
# torch and transformers come from the box. Logs and JSON land in $OUT/transformers/:
# gpu.txt, tests.log (pytest's summary last), transformers_gpu_report.json (measured errors,
# divergences with their diagnostics), summary.txt (one line per pytest run).
set -u
: "${OUT:?set OUT}"
SITE=${SITE:-/tmp/kvpool-hf-site}
if [ ! -d "$SITE/kvpool" ]; then
  python3 -m pip install -q --no-index --no-deps --target "$SITE" dist/*.whl || exit 1
fi
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1
COMMIT=${COMMIT:-unknown}
R="$OUT/transformers"
mkdir -p "$R"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo "commit $COMMIT"; date -u;
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } > "$R/gpu.txt" 2>&1
# A wheel built before the kernel existed would skip nothing and fail late: say so first.
python3 -c "import kvpool; assert 'paged_metadata.cu' in kvpool._core.kernel_sources()" \
  || { echo "stale wheel in dist/: rebuild it at this commit" | tee "$R/summary.txt"; exit 1; }
run() {  # run NAME LIMIT PYTEST-ARGS...: one pytest run, its summary line into summary.txt
  local name=$1 limit=$2
  shift 2
  KVPOOL_TRANSFORMERS_REPORT="$R/transformers_gpu_report.json" timeout "$limit" \
    python3 -m pytest -q -rs -p no:cacheprovider --durations=10 "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc: $(grep -E 'passed|failed|error' "$R/$name.log" | tail -1)" >> "$R/summary.txt"
}
run tests 170 tests/test_transformers_gpu.py tests/test_paged_metadata_gpu.py
run cpu_tests 110 tests/test_transformers_cpu.py tests/test_padded_batch.py tests/test_paged_metadata.py
cat "$R/summary.txt"
