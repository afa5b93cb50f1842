#!/usr/bin/env bash
# Host tier on the GPU box, self-checking: the GPU tests (with the scheduler swapping over a
# CUDA pool), compute-sanitizer memcheck on a swap case, the swap benchmark, and
# `kvpool simulate --device cuda --cpu-kv-memory` (completes and drains both tiers). Run from
# the repository root after installing the wheel and setting PYTHONPATH, e.g. with dist/ copied
# to the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl
#   PYTHONPATH=/tmp/site COMMIT=<sha> bash bench/gpu_hosttier.sh
# Writes into $OUT/hosttier/; prints one PASS/FAIL line per stage and exits non-zero when any
# fails. Expected: well under 5 minutes (tests ~40 s, sanitizer ~30 s, bench ~2 min, simulate ~1 min).
. "$(dirname "$0")/gpu_common.sh"
gpu_setup hosttier

timeout 240 python3 -m pytest -q -rs -m gpu tests/test_host_tier_gpu.py tests/test_host_tier_state.py \
    tests/test_swap_scheduler_gpu.py > "$D/gpu_tests.log" 2>&1
report tests $? "$(tail -1 "$D/gpu_tests.log")"

timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 python3 bench/sanitize_hosttier_case.py > "$D/sanitizer.log" 2>&1
report memcheck $? "$(grep -E 'ERROR SUMMARY|OK' "$D/sanitizer.log" | tail -2 | tr '\n' ' ')"

timeout 300 python3 bench/swap_bench.py --out "$D/swap_h200.json" --commit "$COMMIT" > "$D/bench.log" 2>&1
report bench $? "$(tail -4 "$D/bench.log" | tr '\n' ' ')"

# The scheduler preempting into a pinned host tier over a CUDA pool (completes, drains both tiers).
timeout 240 python3 -m kvpool simulate --device cuda --kv-memory 4GiB --cpu-kv-memory 16GiB --num-requests 500 \
    --no-progress --no-plot --out "$D/simulate_swap" > "$D/simulate_swap.log" 2>&1
report simulate_swap $? "$(grep 'host tier (' -A2 "$D/simulate_swap.log" | tr '\n' ' ')"
exit $status
