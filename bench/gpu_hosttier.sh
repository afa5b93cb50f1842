#!/usr/bin/env bash
# Host tier on the GPU box, self-checking: the GPU tests, compute-sanitizer memcheck on a swap
# case, and the swap benchmark. Run from the repository root after installing the wheel and
# setting PYTHONPATH, e.g. with dist/ copied to the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl
#   PYTHONPATH=/tmp/site COMMIT=<sha> bash bench/gpu_hosttier.sh
# Writes into $OUT/hosttier/; prints one PASS/FAIL line per stage and exits non-zero when any
# fails. Expected: well under 4 minutes (tests ~30 s, sanitizer ~30 s, bench ~2 min).
. "$(dirname "$0")/gpu_common.sh"
gpu_setup hosttier

timeout 240 python3 -m pytest -q -rs -m gpu tests/test_host_tier_gpu.py tests/test_host_tier_state.py > "$D/gpu_tests.log" 2>&1
report tests $? "$(tail -1 "$D/gpu_tests.log")"

timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 python3 bench/sanitize_hosttier_case.py > "$D/sanitizer.log" 2>&1
report memcheck $? "$(grep -E 'ERROR SUMMARY|OK' "$D/sanitizer.log" | tail -2 | tr '\n' ' ')"

timeout 300 python3 bench/swap_bench.py --out "$D/swap_h200.json" --commit "$COMMIT" > "$D/bench.log" 2>&1
report bench $? "$(tail -4 "$D/bench.log" | tr '\n' ' ')"
exit $status
