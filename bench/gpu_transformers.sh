#!/usr/bin/env bash
# The transformers integration on the H200 box, from the repository root: its GPU tests, the
# host-pool (CPU) transformers tests, and bench/generate_bench.py. Build the wheel here
# (`maturin build --release --locked -o dist`), then on the GPU machine, with dist/ copied
# there:  COMMIT=<sha> bash bench/gpu_transformers.sh
# torch and transformers come from the box. Results land in $OUT/transformers/.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
COMMIT=${COMMIT:-unknown}
R="$OUT/transformers"
mkdir -p "$R"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo "commit $COMMIT"; date -u;
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } > "$R/gpu.txt"
# Under 270 s in all (bench/gpu_session.sh gives this script 280 s): the tests, then the bench,
# which writes its JSON after every row, so a cut leaves the rows done so far.
KVPOOL_TRANSFORMERS_REPORT="$R/transformers_gpu_report.json" timeout 130 \
  python3 -m pytest -q -rs -p no:cacheprovider --durations=10 tests/test_transformers_gpu.py \
  tests/test_transformers_cpu.py 2>&1 | tee "$R/tests.log" | tail -25
timeout 140 python3 bench/generate_bench.py --out "$R/generate_h200.json" --commit "$COMMIT" 2>&1 \
  | tee "$R/bench.log" | tail -30
