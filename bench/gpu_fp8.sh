#!/usr/bin/env bash
# fp8 KV cache on the GPU box, self-checking: the fp8 GPU tests (quantizing append bit for bit,
# fp8 decode against the float64 reference on the dequantized cache, end-to-end error against
# the unquantized cache), then the fp8 decode benchmark (ours fp8 vs ours fp16 vs FlashInfer
# fp8). Run from the repository root after installing the wheel (and, when present, the
# FlashInfer wheels) and setting PYTHONPATH, e.g. with dist/ and .whl/ copied to
# the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl $(ls .whl/*.whl 2>/dev/null)
#   PYTHONPATH=/tmp/site COMMIT=<sha> bash bench/gpu_fp8.sh
# Writes into $OUT/fp8/; prints one PASS/FAIL line per stage; exits non-zero when one fails.
# Expected: ~2 min tests (mostly NVRTC compiles of the fp8 modules), ~2 min bench.
. "$(dirname "$0")/gpu_common.sh"
gpu_setup fp8
start_flashinfer_warmup bench/fi_fp8_warm.py

KVPOOL_FP8_REPORT="$D/fp8_errors.json" timeout 300 python3 -m pytest -q -rs -m gpu \
  tests/test_fp8_gpu.py > "$D/gpu_tests.log" 2>&1
report tests $? "$(tail -1 "$D/gpu_tests.log")"

[ $have_fi = 1 ] && { wait "$FI_PID"; echo "flashinfer fp8 warm-up: $(tr '\n' ';' < "$D/fi_warm.log" | cut -c1-300)"; }

KVPOOL_COMMIT=$COMMIT timeout 240 python3 bench/fp8_bench.py "$D/fp8_h200.json" \
  > "$D/bench.log" 2>&1
rc=$?
check_rows "$D/fp8_h200.json" kvpool_fp8_us >> "$D/bench.log" 2>&1
chk=$?
[ $rc -eq 0 ] && rc=$chk
report bench $rc "$(tail -1 "$D/bench.log")"
tail -12 "$D/bench.log" | head -11
exit $status
