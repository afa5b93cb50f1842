#!/usr/bin/env bash
# Every GPU check and benchmark of the project in two calls of under 10 minutes on a two-GPU box
# (nvidia-h200-x2), from the repository root, with dist/ (the release wheel), .whl/ (FlashInfer,
# optional) and bench/bin/ (the criterion free-list binary) carried:
#     COMMIT=<sha> PART=1 bash bench/gpu_session.sh     # then PART=2
# Give the sha literally (the commit the wheel was built at, tree clean): a checkout copied to
# the GPU machine may carry git metadata older than its files, so `git rev-parse` there can name
# an earlier commit.
# Independent work runs in lanes at the same time; a benchmark never shares its GPU with other
# work (tests and sanitizers may share one):
#   part 1  GPU 0: decode benchmark, then prefill benchmark
#           GPU 1: every single-GPU test but the transformers ones, then the fp8, host tier,
#                  pool, tables and growable scripts (each its tests, then its benchmark); at the
#                  start, beside the tests, compute-sanitizer memcheck and racecheck over the
#                  decode, append, copy and prefill kernels
#           CPU 16-31: the free-list criterion grid and the Python round trip
#           (scripts include the scheduler simulation with --device cuda, 2,000 requests)
#   part 2  both:  two-GPU tests, KV transfer and tensor-parallel decode benchmarks (alone),
#           then the transformers tests and generation benchmark
# On one GPU, PART=1a, 1b, 1f and 2t do part 1's work and the transformers half of part 2 in four
# calls (the free-list grid alone, so that its 16 threads have the host's cores; the two-GPU work
# needs the two-GPU box).
# Each step has its own time limit (a part stays under 9.5 minutes); every log and JSON goes into
# $OUT/session_part<N>.tar.gz (unpack into bench/results/<run>/) and the last line of each step's
# output into $OUT/summary_part<N>.txt.
set -u
: "${OUT:?set OUT}" "${PART:?set PART to 1 or 2 (two GPUs), or 1a, 1b, 1f, 2t (one GPU)}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export COMMIT=${COMMIT:-unknown} KVPOOL_COMMIT=${COMMIT:-unknown} PYTHONUNBUFFERED=1
WORK=/tmp/kvpool-session/part$PART
SUMMARY="$OUT/summary_part$PART.txt"
mkdir -p "$WORK"

SITE=/tmp/kvpool-session-site  # not the folder bench/run_free_list_h200.sh installs into
if [ ! -d "$SITE/kvpool" ]; then
  python3 -m pip install -q --no-index --no-deps --target "$SITE" dist/*.whl $(ls .whl/*.whl 2>/dev/null) \
    > "$WORK/pip.log" 2>&1 || { echo "wheel install failed" >> "$SUMMARY"; exit 1; }
fi
export PYTHONPATH=$SITE
NVCC=$(command -v nvcc) && export CUDA_HOME=$(dirname "$(dirname "$NVCC")") FLASHINFER_CUDA_ARCH_LIST=9.0a
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; nproc; echo "commit $COMMIT"; date -u; } \
  > "$WORK/gpu.txt" 2>&1

# step NAME LIMIT COMMAND...: runs the command with its output in $WORK/NAME.log; one line to the summary.
step() {
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  OUT="$WORK" timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc, $((SECONDS - start)) s: $(grep -v '^\s*$' "$WORK/$name.log" | tail -1 | cut -c1-200)" >> "$SUMMARY"
}

on_gpu() { CUDA_VISIBLE_DEVICES=$1 "${@:2}"; }

# The lanes, each given the GPU it runs on (the free-list lane: the CPUs it is pinned to).
bench_lane() {  # the decode and prefill benchmarks
  on_gpu "$1" step decode_bench 330 bash bench/gpu_decode.sh bench
  on_gpu "$1" step prefill_bench 200 python3 bench/prefill_bench.py "$WORK/prefill_h200.json" \
    --commit "$COMMIT"
}
test_lane() {  # every single-GPU test but the transformers and fp8 ones (gpu_fp8.sh runs those)
  KVPOOL_ERROR_REPORT="$WORK/decode_errors.json" on_gpu "$1" step gpu_tests 200 \
    python3 -m pytest -q -rs -m gpu tests --ignore=tests/test_prefill_gpu.py \
    --ignore=tests/test_transformers_gpu.py --ignore=tests/test_fp8_gpu.py --durations=15
  KVPOOL_ERROR_REPORT="$WORK/prefill_errors.json" on_gpu "$1" step prefill_tests 90 \
    python3 -m pytest -q -rs -m gpu tests/test_prefill_gpu.py
}
scripts_lane() {  # fp8, host tier, pool, tables and growable: each its tests, then its benchmark
  on_gpu "$1" step fp8 200 bash bench/gpu_fp8.sh
  on_gpu "$1" step hosttier 150 bash bench/gpu_hosttier.sh
  on_gpu "$1" step pool_bench 30 python3 bench/pool_bench.py --device cuda --repeat 5 --min-time 0.1 \
    --out "$WORK/pool_cuda.json" --commit "$COMMIT"
  on_gpu "$1" step tables_bench 25 python3 bench/tables_bench.py --device cuda --out "$WORK/tables_cuda.json" \
    --commit "$COMMIT"
  on_gpu "$1" step growable_bench 25 python3 bench/growable_bench.py --out "$WORK/growable_h200.json"
  on_gpu "$1" step sim_cuda 60 python3 bench/sim_bench.py --device cuda --num-requests 2000 \
    --out "$WORK/simulate_sharegpt_llama-3-8b_cuda.json" --commit "$COMMIT"
}
sanitizer_lane() {
  sanitize() { on_gpu "$GPU" step "$1_$2" "$3" compute-sanitizer --tool "$2" --error-exitcode 9 \
    python3 "bench/$4" "${@:5}"; }
  local GPU=$1
  sanitize decode memcheck 110 sanitize_case.py
  sanitize decode racecheck 110 sanitize_case.py --dtypes float16
  sanitize prefill memcheck 80 sanitize_prefill_case.py
  sanitize prefill racecheck 100 sanitize_prefill_case.py
}
free_list_lane() {
  local PIN
  PIN=$(command -v taskset > /dev/null && echo "taskset -c $1")
  step free_list 330 $PIN bash bench/run_free_list_h200.sh
}

part1() {
  bench_lane 0 &
  ( test_lane 1; scripts_lane 1 ) &
  sanitizer_lane 1 &
  free_list_lane 16-31 &
  wait
}

part2() {
  step multigpu 250 bash bench/gpu_multigpu.sh
  on_gpu 0 step transformers 330 bash bench/gpu_transformers.sh
}

# One GPU (nvidia-h200) instead of two: the same work in three calls, benchmarks alone on the GPU.
part1a() {  # the decode and prefill benchmarks
  bench_lane 0
}

part1f() {  # the free-list grid and the Python round trip, alone on the host's every core
  free_list_lane "0-$(($(nproc) - 1))"
}

part1b() {  # the tests with the sanitizers beside them, then the other scripts
  test_lane 0 &
  sanitizer_lane 0 &
  wait
  scripts_lane 0
}

part2t() {  # the transformers tests and generation benchmark
  on_gpu 0 step transformers 330 bash bench/gpu_transformers.sh
}

pack() { tar -C "$WORK" -czf "$OUT/session_part$PART.tar.gz" . ; }
trap pack EXIT
"part$PART"
cat "$SUMMARY"
