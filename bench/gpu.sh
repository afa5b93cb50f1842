#!/usr/bin/env bash
# The one script for a GPU run: GPU tests, GPU benchmarks, compute-sanitizer over every kernel.
#
# Build the wheel first (`maturin build --release --locked -o dist`), then on the GPU machine,
# from the repository root, with dist/ beside it:
#     COMMIT=<sha> OUT=<dir> [NAME=house] [STAGES="tests bench sanitize decode"] bash bench/gpu_all.sh
# Stages (run in the order given; pick with STAGES; about 6 minutes for all four):
#   tests     pytest -m gpu tests (decode errors per case in decode_errors.json)
#   bench     pool, tables and growable benchmarks (JSON each)
#   sanitize  compute-sanitizer memcheck (float16 and bfloat16) and racecheck (float16) over
#             bench/sanitize_case.py: every kernel family at its default head dims and block
#             sizes (padded widths, pages smaller than a tile)
#   decode    the decode benchmark against SDPA and FlashInfer (stopped after 150 s; its JSON
#             is written row by row, so a stop keeps the rows measured)
# Other areas' scripts run as stages too (not in the default list; each takes minutes):
#   decode_v4 bench/gpu_decode.sh, prefill bench/gpu_prefill.sh, transformers
#   bench/gpu_transformers.sh, fp8 bench/gpu_fp8.sh; their files land in the same tarball (decode/, prefill/, ...).
# FlashInfer wheels in .whl/ (carried beside dist/) are installed when present.
# Everything lands in $OUT/$NAME/: summary.txt (the tail of every stage and its exit status)
# and results.tar.gz (every log and JSON); unpack the latter into bench/results/<run>/.
# A failing stage stops the run (the later stages would measure broken code); the exit
# status is the failing stage's.
set -uo pipefail

: "${OUT:?set OUT to the output folder}"
NAME=${NAME:-house}
STAGES=${STAGES:-"tests bench sanitize decode"}
export KVPOOL_COMMIT=${COMMIT:-unknown} PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
DEST="$OUT/$NAME"
mkdir -p "$DEST"
SUMMARY="$DEST/summary.txt"

pack() {
  tar -C "$WORK" -czf "$DEST/results.tar.gz" .
  echo "packed $(tar -tzf "$DEST/results.tar.gz" | grep -vc '/$') files into $DEST/results.tar.gz" >> "$SUMMARY"
}
trap pack EXIT

note() { echo "$*" | tee -a "$SUMMARY"; }

# run NAME LOG COMMAND...: the command's output to $WORK/LOG, its tail to the summary.
run() {
  local name=$1 log=$2
  shift 2
  local start=$SECONDS
  "$@" > "$WORK/$log" 2>&1
  local status=$?
  note "== $name: exit $status, $((SECONDS - start)) s ($log)"
  tail -n 12 "$WORK/$log" | tee -a "$SUMMARY"
  return $status
}

stage_tests() {
  KVPOOL_ERROR_REPORT="$WORK/decode_errors.json" \
    run "pytest -m gpu" gpu_tests.log python3 -m pytest -q -rs -m gpu tests
}

stage_bench() {
  run "pool_bench (CUDA pool vs cudaMalloc, CuPy pool, torch caching allocator)" pool_bench.log \
    python3 bench/pool_bench.py --device cuda --repeat 5 --min-time 0.1 --out "$WORK/pool_cuda.json" &&
  run "tables_bench (ours vs incremental NumPy + pinned async upload vs rebuild)" tables_bench.log \
    python3 bench/tables_bench.py --device cuda --out "$WORK/tables_cuda.json" &&
  run "growable_bench (VMM growth vs allocate-copy-free)" growable_bench.log \
    python3 bench/growable_bench.py --out "$WORK/growable_h200.json"
}

stage_sanitize() {
  local status=0
  run "compute-sanitizer memcheck" sanitizer_memcheck.log \
    timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 bench/sanitize_case.py ||
    status=$?
  run "compute-sanitizer racecheck" sanitizer_racecheck.log \
    timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 python3 bench/sanitize_case.py \
    --dtypes float16 || status=$?
  return $status
}

stage_decode_v4() {
  OUT="$WORK" run "bench/gpu_decode.sh" gpu_decode.log bash bench/gpu_decode.sh
}

stage_prefill() {
  OUT="$WORK" run "bench/gpu_prefill.sh" gpu_prefill.log bash bench/gpu_prefill.sh
}

stage_fp8() {
  OUT="$WORK" run "bench/gpu_fp8.sh" gpu_fp8.log bash bench/gpu_fp8.sh
}

stage_transformers() {
  OUT="$WORK" run "bench/gpu_transformers.sh" gpu_transformers.log bash bench/gpu_transformers.sh
}

stage_decode() {
  run "decode_bench (vs SDPA and FlashInfer when installed)" decode_bench.log \
    timeout 150 python3 bench/decode_bench.py "$WORK/decode_h200.json"
  local status=$?
  [ $status -eq 124 ] && { note "decode_bench stopped at 150 s: partial rows kept"; return 0; }
  return $status
}

SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" dist/*.whl $(ls .whl/*.whl 2>/dev/null) ||
  { note "wheel install failed"; exit 1; }
if NVCC=$(command -v nvcc); then  # FlashInfer's JIT, when its wheels were carried
  export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")} FLASHINFER_CUDA_ARCH_LIST=9.0a
fi
export PYTHONPATH="$SITE"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo "commit $KVPOOL_COMMIT"; date -u; } > "$WORK/gpu.txt"
cat "$WORK/gpu.txt" > "$SUMMARY"

for stage in $STAGES; do
  if ! declare -F "stage_$stage" > /dev/null; then
    note "unknown stage '$stage' (known: tests bench sanitize decode decode_v4 prefill transformers fp8)"
    exit 2
  fi
  "stage_$stage"
  status=$?
  if [ $status -ne 0 ]; then
    note "stage $stage failed (exit $status): stopping"
    exit $status
  fi
done
note "all stages passed: $STAGES"
