#!/usr/bin/env bash
# fp8 KV cache on the GPU box, self-checking: the fp8 GPU tests (quantizing append bit for bit,
# fp8 decode against the float64 reference on the dequantized cache, end-to-end error against
# the unquantized cache), then the fp8 decode benchmark (ours fp8 vs ours fp16 vs FlashInfer
# fp8). Run from the repository root after installing the wheel (and, when present, the
# FlashInfer wheels) and setting PYTHONPATH, e.g. through the device tool with carry
# ["dist", ".whl"]:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl $(ls .whl/*.whl 2>/dev/null)
#   PYTHONPATH=/tmp/site COMMIT=<sha> bash bench/gpu_fp8.sh
# Writes into $OUT/fp8/; prints one PASS/FAIL line per stage; exits non-zero when one fails.
# Expected: ~2 min tests (mostly NVRTC compiles of the fp8 modules), ~2 min bench.
set -u
D="${OUT:?set OUT}/fp8"
mkdir -p "$D"
export PYTHONUNBUFFERED=1
COMMIT=${COMMIT:-unknown}
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
  python3 bench/fi_fp8_warm.py > "$D/fi_warm.log" 2>&1 &
  FI_PID=$!
fi

KVPOOL_FP8_REPORT="$D/fp8_errors.json" timeout 300 python3 -m pytest -q -rs -m gpu \
  tests/test_fp8_gpu.py > "$D/gpu_tests.log" 2>&1
report tests $? "$(tail -1 "$D/gpu_tests.log")"

[ $have_fi = 1 ] && { wait "$FI_PID"; echo "flashinfer fp8 warm-up: $(tr '\n' ';' < "$D/fi_warm.log" | cut -c1-300)"; }

KVPOOL_COMMIT=$COMMIT timeout 240 python3 bench/fp8_bench.py "$D/fp8_h200.json" \
  > "$D/bench.log" 2>&1
rc=$?
python3 - "$D/fp8_h200.json" >> "$D/bench.log" 2>&1 <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
bad = [r["shape"] for r in rows if "error" in r or not r.get("kvpool_fp8_us")]
diff = [(r["shape"], k, r[k]) for r in rows for k in r if k.startswith("max_abs_diff") and not r[k] <= 0.05]
print(f"{len(rows)} rows, {len(bad)} without an fp8 time {bad}, {len(diff)} output mismatches {diff}")
sys.exit(1 if bad or diff else 0)
PY
chk=$?
[ $rc -eq 0 ] && rc=$chk
report bench $rc "$(tail -1 "$D/bench.log")"
tail -12 "$D/bench.log" | head -11
exit $status
