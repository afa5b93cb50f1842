#!/usr/bin/env bash
# Every GPU test and GPU routine of the project on the CUDA machine it runs on, with the number
# of GPUs detected, into one results folder with provenance. From the repository root, with
# kvpool installed in the current Python environment (`maturin develop --release`, or the
# wheel `maturin build --release` writes) and CuPy; the comparisons with torch, FlashInfer and
# transformers run where those import, and are recorded as not run where they do not:
#     bash bench/gpu.sh [OUT_DIR]
# OUT_DIR defaults to bench/results/<date>_<commit>_<machine>/ (bench/provenance.py). STEPS picks
# and orders the steps (default: all of them; about half an hour on one H200); each step is
# stopped after STEP_TIMEOUT seconds (default 1200), and every name is checked before any runs:
#     STEPS="tests sanitize decode" bash bench/gpu.sh
#   tests      pytest -m gpu in groups, each a step of its own that STEPS may also name alone,
#              each with its error report: gpu_tests (decode and the rest; decode_errors.json),
#              prefill_tests (prefill_errors.json), fp8_tests (fp8_errors.json),
#              host_tier_tests, transformers_tests and transformers_cpu_tests
#              (transformers_gpu_report.json, when transformers imports), gpu2_tests
#              (pytest -m gpu2, two GPUs or more)
#   sanitize   compute-sanitizer memcheck and racecheck over tools/sanitize_kernels.py (decode,
#              append, copy) and tools/sanitize_prefill.py, memcheck over
#              tools/sanitize_host_tier.py (skipped without compute-sanitizer)
#   decode fp8 prefill fp8_prefill growable swap generate
#              the routine of that name (bench/kvbench.py), its JSON and log
#   pool tables sim
#              the routine with --device cuda (pool_cuda.json, tables_cuda.json, sim_cuda.json)
#   transfer tp_decode
#              the two-GPU routines (skipped with one GPU)
#   simulate_swap
#              `kvpool simulate --device cuda --cpu-kv-memory`: the scheduler preempting into a
#              pinned host tier over a CUDA pool completes and drains both tiers
# FlashInfer's JIT builds compile in the background while the tests run (fi_warm.log), when a
# step that compares with FlashInfer is asked for (FLASHINFER_CUDA_ARCH_LIST defaults to the
# first GPU's compute capability, with the "a" suffix on Hopper for its sm_90a kernels).
# Every step runs, a failing one included (each result names its own step); summary.txt has one
# line per step with its exit status (a skipped step says why), and the script exits non-zero
# when any step failed.
# Without git metadata in the checkout, give the commit measured: COMMIT=<sha> bash bench/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
[ -n "${COMMIT:-}" ] && export KVPOOL_COMMIT=$COMMIT
OUT=${1:-$(python3 -c 'import sys; sys.path.insert(0, "bench"); from provenance import run_dir; print(run_dir())')}
mkdir -p "$OUT"
NGPU=$(python3 -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())' 2> "$OUT/gpu.txt")
case $NGPU in
  '' | *[!0-9]* | 0) echo "gpu.sh: CuPy sees no CUDA device (see $OUT/gpu.txt)" >&2; exit 2 ;;
esac
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; echo "$NGPU GPUs, $(nproc) CPUs"
  python3 -c 'import sys; sys.path.insert(0, "bench"); import provenance; print("commit", provenance.commit())'
  date -u; } >> "$OUT/gpu.txt" 2>&1
STEPS=${STEPS:-"tests sanitize decode fp8 prefill fp8_prefill pool tables growable swap sim simulate_swap generate transfer tp_decode"}
TEST_STEPS="gpu_tests prefill_tests fp8_tests host_tier_tests transformers_tests gpu2_tests"
KNOWN=" $TEST_STEPS tests sanitize decode fp8 prefill fp8_prefill fp8_sweep pool tables growable swap sim simulate_swap generate transfer tp_decode "
for s in $STEPS; do  # a typo must not stop the run halfway
  case $KNOWN in *" $s "*) ;; *) echo "gpu.sh: unknown step '$s' (known:$KNOWN)" >&2; exit 2 ;; esac
done
expanded=""
for s in $STEPS; do if [ "$s" = tests ]; then expanded+=" $TEST_STEPS"; else expanded+=" $s"; fi; done
STEPS=$expanded
status=0

# step NAME COMMAND...: the command's output in $OUT/NAME.log, one line in summary.txt.
step() {
  local name=$1 start=$SECONDS
  shift
  timeout "${STEP_TIMEOUT:-1200}" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "(stopped after STEP_TIMEOUT=${STEP_TIMEOUT:-1200} s)" >> "$OUT/$name.log"
  [ $rc -ne 0 ] && status=1
  echo "$name: exit $rc, $((SECONDS - start)) s: $(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-200)" |
    tee -a "$OUT/summary.txt"
}
has() { python3 -c "import $1" 2> /dev/null; }
skipped() { echo "$1: skipped ($2)" | tee -a "$OUT/summary.txt"; }
routine() {  # routine NAME [STEM] [ARGS...]: bench/kvbench.py --routine NAME into $OUT/STEM.json
  local name=$1 stem=${2:-$1}
  shift $(( $# >= 2 ? 2 : 1 ))
  step "$stem" python3 bench/kvbench.py --routine "$name" --out "$OUT" --name "$stem" "$@"
}
# A command, not a function: step runs it under timeout.
PYTEST="python3 -m pytest -q -rs -p no:cacheprovider"
sanitize() {  # sanitize NAME TOOL SCRIPT [ARGS...]
  step "$1_$2" compute-sanitizer --tool "$2" --error-exitcode 9 python3 "tools/$3" "${@:4}"
}

case " $STEPS " in *" decode "* | *" fp8 "* | *" prefill "* | *" fp8_prefill "*) WANTS_FI=1 ;; esac
if [ -n "${WANTS_FI:-}" ] && has flashinfer; then
  if NVCC=$(command -v nvcc); then export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}; fi
  if [ -z "${FLASHINFER_CUDA_ARCH_LIST:-}" ]; then
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2> /dev/null | head -1)
    [ -n "$cap" ] && export FLASHINFER_CUDA_ARCH_LIST="$cap$([ "$cap" = 9.0 ] && echo a)"
  fi
  timeout "${STEP_TIMEOUT:-1200}" python3 bench/kvbench.py --warm-flashinfer decode fp8 prefill \
    > "$OUT/fi_warm.log" 2>&1 &
  FI_PID=$!
  trap '[ -n "${FI_PID:-}" ] && kill "$FI_PID" 2> /dev/null' EXIT  # no orphan compiling on
fi
warmed() { if [ -n "${FI_PID:-}" ]; then wait "$FI_PID"; FI_PID=; fi; }

for s in $STEPS; do
  case $s in
  gpu_tests)
    KVPOOL_ERROR_REPORT="$OUT/decode_errors.json" step gpu_tests $PYTEST -m gpu tests \
      --ignore=tests/test_prefill_gpu.py --ignore=tests/test_fp8_gpu.py \
      --ignore=tests/test_host_tier_gpu.py --ignore=tests/test_transformers_gpu.py ;;
  prefill_tests)
    KVPOOL_ERROR_REPORT="$OUT/prefill_errors.json" step prefill_tests $PYTEST -m gpu \
      tests/test_prefill_gpu.py ;;
  fp8_tests)
    KVPOOL_FP8_REPORT="$OUT/fp8_errors.json" step fp8_tests $PYTEST -m gpu tests/test_fp8_gpu.py ;;
  host_tier_tests) step host_tier_tests $PYTEST -m gpu tests/test_host_tier_gpu.py ;;
  transformers_tests)
    if has transformers; then
      export KVPOOL_TRANSFORMERS_REPORT="$OUT/transformers_gpu_report.json"
      step transformers_tests $PYTEST -m gpu tests/test_transformers_gpu.py
      step transformers_cpu_tests $PYTEST tests/test_transformers_cpu.py \
        tests/test_padded_batch.py tests/test_paged_metadata.py
      unset KVPOOL_TRANSFORMERS_REPORT
    else
      skipped transformers_tests "transformers does not import"
    fi ;;
  gpu2_tests)
    if [ "$NGPU" -ge 2 ]; then step gpu2_tests $PYTEST -m gpu2 tests; else skipped gpu2_tests "one GPU"; fi ;;
  sanitize)
    if command -v compute-sanitizer > /dev/null; then
      sanitize decode memcheck sanitize_kernels.py
      sanitize decode racecheck sanitize_kernels.py --dtypes float16
      sanitize prefill memcheck sanitize_prefill.py
      sanitize prefill racecheck sanitize_prefill.py
      sanitize host_tier memcheck sanitize_host_tier.py
    else
      skipped sanitize "no compute-sanitizer on PATH"
    fi ;;
  decode | fp8 | prefill | fp8_prefill) warmed; routine "$s" ;;
  fp8_sweep | growable | swap) routine "$s" ;;
  generate) if has transformers; then routine generate; else skipped generate "transformers does not import"; fi ;;
  pool | tables) routine "$s" "${s}_cuda" --device cuda ;;
  sim) routine sim sim_cuda --device cuda --num-requests 2000 ;;
  simulate_swap)
    step simulate_swap python3 -m kvpool simulate --device cuda --kv-memory 4GiB \
      --cpu-kv-memory 16GiB --num-requests 500 --no-progress --no-plot --out "$OUT/simulate_swap" ;;
  transfer | tp_decode) if [ "$NGPU" -ge 2 ]; then routine "$s"; else skipped "$s" "one GPU"; fi ;;
  esac
done
# Every decode-style row measured, and our output agrees with each peer's.
for check in decode:kvpool_us fp8:kvpool_fp8_us; do
  json=$OUT/${check%%:*}.json
  [ -f "$json" ] || continue
  python3 - "$json" "${check#*:}" <<'PY' | tee -a "$OUT/summary.txt" || status=1
import json, sys
path, key = sys.argv[1:]
rows = json.load(open(path))["rows"]
bad = [r["shape"] for r in rows if "error" in r or not r.get(key)]
diff = [(r["shape"], k, r[k]) for r in rows for k in r if k.startswith("max_abs_diff") and not r[k] <= 0.05]
print(f"{path}: {len(rows)} rows, {len(bad)} failed {bad}, {len(diff)} output mismatches {diff}")
sys.exit(1 if bad or diff else 0)
PY
done
echo "wrote $OUT"
exit $status
