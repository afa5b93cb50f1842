#!/usr/bin/env bash
# Decode kernel v4 on the GPU box, self-checking: GPU tests (coverage + kernel tests), the decode
# benchmark against SDPA and FlashInfer, compute-sanitizer memcheck and racecheck on
# bench/sanitize_case.py. Run from the repository root after installing the wheel (and, when
# present, the FlashInfer wheels) and setting PYTHONPATH, e.g. through the device tool with
# carry ["dist", ".whl"]:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl $(ls .whl/*.whl 2>/dev/null)
#   PYTHONPATH=/tmp/site COMMIT=<sha> bash bench/gpu_decode.sh [tests] [bench] [sanitize]
# (no stage named: all three). Writes into $OUT/decode/; prints one PASS/FAIL line per stage and
# exits non-zero when any stage fails. Expected: ~3 min tests, ~4 min bench, ~1 min sanitizers;
# under a 10-minute limit per call run `tests sanitize` and `bench` as two calls.
set -u
D="${OUT:?set OUT}/decode"
mkdir -p "$D"
export PYTHONUNBUFFERED=1
COMMIT=${COMMIT:-unknown}
STAGES=${*:-tests bench sanitize}
status=0
report() {  # stage, exit code, detail
  if [ "$2" -eq 0 ]; then echo "PASS $1 $3"; else echo "FAIL $1 (exit $2) $3"; status=1; fi
  echo "$1 exit $2 $3" >> "$D/summary.txt"
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo "commit $COMMIT"; date -u; } > "$D/gpu.txt"

have_fi=0
if python3 -c "import flashinfer" 2>/dev/null; then
  have_fi=1
  NVCC=$(command -v nvcc || true)
  [ -n "$NVCC" ] && export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
  export FLASHINFER_CUDA_ARCH_LIST=9.0a
  # FlashInfer's JIT builds run on the CPU while the tests use the GPU.
  python3 bench/fi_warm.py > "$D/fi_warm.log" 2>&1 &
  FI_PID=$!
fi

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
  python3 - "$D/decode_h200_v4.json" >> "$D/bench.log" 2>&1 <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
bad = [r["shape"] for r in rows if "error" in r or not r.get("kvpool_us")]
diff = [(r["shape"], k, r[k]) for r in rows for k in r if k.startswith("max_abs_diff") and r[k] > 0.05]
print(f"{len(rows)} rows, {len(bad)} without a kvpool time {bad}, {len(diff)} output mismatches {diff}")
sys.exit(1 if bad or diff else 0)
PY
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
