#!/bin/bash
# One device call for the Hopper prefill (cuda/paged_prefill_sm90.cu), run from a copy of the
# tree (/work/main/.gpurun/<branch>/, beside a copy of the base commit's tree in BASE_TREE when
# set), everything under $OUT. In order, each step within what is left of BUDGET_S seconds:
#   1. tools/compare_prefill_kernels.py (sm90 with cp.async and with TMA loads against sm80: a
#      smoke test; a failure stops here after a short run of the GPU suite, to see which fail)
#   2. tests/test_prefill_sm90_tma_gpu.py (the whole prefill suite, Hopper kernel, TMA loads),
#   3. beside it, compute-sanitizer memcheck and racecheck of tools/sanitize_prefill.py
#   4. bench/kvbench.py --routine prefill --grid issue26 --quick: ours (default, forced sm80,
#      forced sm90 with cp.async and with TMA), FlashInfer 0.5.3 fa2 / fa3, SDPA flash /
#      cuDNN, dense matmul, same run
#   5. the base tree's kernels on the same grid, ours only (A/B of the Hopper kernel)
#   6. tests/test_prefill_sm90_gpu.py (the suite with cp.async loads) and
#      tests/test_prefill_gpu.py (the default plans)
# STEPS (default "compare tma_tests sanitize bench base tests") picks which run, so one
# session can split them over calls.
# The step logs come back as logs.tgz, the run's summary as log (renamed run.log when committed).
# Usage (device): COMMIT=abc1234 BASE_TREE=../hopper_base bash bench/prefill_sm90_gpu.sh
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
BUDGET_S=${BUDGET_S:-400}
START=$SECONDS
export KVPOOL_CUDA_DIR=$ROOT/cuda PYTHONPATH=$ROOT/python PYTHONUNBUFFERED=1
export KVPOOL_COMMIT=${COMMIT:-unknown}
STEPS=" ${STEPS:-compare tma_tests sanitize bench base tests} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
left() { echo $((BUDGET_S - (SECONDS - START))); }
step() {  # step NAME TIMEOUT CMD...: runs CMD under the smaller of TIMEOUT and what is left
    local name=$1 t=$2; shift 2
    local l; l=$(left)
    if [ "$l" -lt 15 ]; then echo "== $name: skipped (budget spent)" | tee -a "$OUT/log"; return 99; fi
    [ "$t" -gt "$l" ] && t=$l
    echo "== $name (timeout ${t}s, at $((SECONDS - START))s)" | tee -a "$OUT/log"
    timeout "$t" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -4 "$OUT/$name.log" | tee -a "$OUT/log"
    echo "== $name rc=$rc at $((SECONDS - START))s" | tee -a "$OUT/log"
    return $rc
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv; date -u; echo "commit $KVPOOL_COMMIT"; } > "$OUT/gpu.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$ROOT"/../../.whl/*.whl 2>&1 | tail -2
export CUDA_HOME=$(dirname "$(dirname "$(which nvcc)")") FLASHINFER_CUDA_ARCH_LIST=9.0a

if want compare && ! step compare 60 python3 tools/compare_prefill_kernels.py; then
    step prefill_sm90_tma_tests 40 python3 -m pytest -q -p no:cacheprovider -m gpu --maxfail=5 tests/test_prefill_sm90_tma_gpu.py
    (cd "$OUT" && tar -czf logs.tgz ./*.log && rm -f ./*.log)
    exit 1
fi
# The TMA suite and the sanitizers check, they time nothing: side by side on the GPU.
want tma_tests && step prefill_sm90_tma_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_prefill_sm90_tma_gpu.py &
want sanitize && step prefill_memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize_prefill.py
want sanitize && step prefill_racecheck 90 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 1 python3 tools/sanitize_prefill.py
wait
want bench && PYTHONPATH=$ROOT/python:/tmp/site step prefill_bench 300 python3 bench/kvbench.py --routine prefill --out "$OUT" --name prefill_h200 --commit "$KVPOOL_COMMIT" --grid issue26 --quick
if want base && [ -n "${BASE_TREE:-}" ]; then  # the base tree's library and kernels, this tree's bench
    BASE=$(cd "$BASE_TREE" && pwd)
    KVPOOL_CUDA_DIR=$BASE/cuda PYTHONPATH=$BASE/python step prefill_base_bench 90 python3 bench/kvbench.py --routine prefill --out "$OUT" --name prefill_base_h200 --commit "${BASE_COMMIT:-base}" --grid issue26 --quick --kvpool-only
fi
want tests && step prefill_sm90_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_prefill_sm90_gpu.py
want tests && step prefill_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_prefill_gpu.py
echo "== done at $((SECONDS - START))s" | tee -a "$OUT/log"
# Only a few files come back from a device call: the step logs travel as one archive.
(cd "$OUT" && tar -czf logs.tgz ./*.log && rm -f ./*.log)
