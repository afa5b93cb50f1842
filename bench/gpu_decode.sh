#!/usr/bin/env bash
# Decode kernel v4 on the GPU box, self-checking: GPU tests (coverage + kernel tests), the decode
# benchmark against SDPA and FlashInfer, compute-sanitizer memcheck and racecheck on
# bench/sanitize_case.py. Run from the repository root after installing the wheel (and, when
# present, the FlashInfer wheels) and setting PYTHONPATH, e.g. with dist/ and .whl/
# copied to the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl $(ls .whl/*.whl 2>/dev/null)
#   PYTHONPATH=/tmp/site COMMIT=<sha> bash bench/gpu_decode.sh [tests] [bench] [sanitize]
# (no stage named: all three). Writes into $OUT/decode/; prints one PASS/FAIL line per stage and
# exits non-zero when any stage fails. Expected: ~3 min tests, ~4 min bench, ~1 min sanitizers;
# under a 10-minute limit per call run `tests sanitize` and `bench` as two calls.
. "$(dirname "$0")/gpu_common.sh"
gpu_setup decode
STAGES=${*:-tests bench sanitize}
start_flashinfer_warmup bench/fi_warm.py  # FlashInfer compiles on the CPU while the tests run

case " $STAGES " in *" tests "*)
  KVPOOL_ERROR_REPORT="$D/decode_errors.json" timeout 540 python3 -m pytest -q -rs -m gpu \
    tests/test_decode_coverage_gpu.py tests/test_kernels_gpu.py > "$D/gpu_tests.log" 2>&1
  report tests $? "$(tail -1 "$D/gpu_tests.log")"
esac

[ $have_fi = 1 ] && { wait "$FI_PID"; echo "flashinfer warm-up: $(grep -c '^warm' "$D/fi_warm.log") warm, $(grep -c '^refused' "$D/fi_warm.log") refused"; }

case " $STAGES " in *" bench "*)
  KVPOOL_COMMIT=$COMMIT timeout 540 python3 bench/decode_bench.py "$D/decode_h200_v4.json" \
    > "$D/bench.log" 2>&1
  rc=$?
  # Every row measured (no "error" key) and our output agrees with each peer's.
  check_rows "$D/decode_h200_v4.json" kvpool_us >> "$D/bench.log" 2>&1
  chk=$?
  [ $rc -eq 0 ] && rc=$chk
  report bench $rc "$(tail -1 "$D/bench.log")"
esac

case " $STAGES " in *" sanitize "*)
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/sanitize_case.py \
      > "$D/$tool.log" 2>&1
    report $tool $? "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$D/$tool.log" | tail -1)"
  done
esac
exit $status
