# The preamble the self-checking GPU scripts share (bench/gpu_decode.sh, gpu_fp8.sh,
# gpu_hosttier.sh); sourced, not run. `gpu_setup NAME` makes $D=$OUT/NAME, records the GPU,
# driver and commit in $D/gpu.txt and defines:
#   report STAGE EXIT DETAIL   one PASS/FAIL line per stage (and into $D/summary.txt); any
#                              failure sets status=1, which the script exits with
#   start_flashinfer_warmup SCRIPT
#                              when FlashInfer imports: its JIT settings, and SCRIPT started in
#                              the background (log $D/fi_warm.log) so that FlashInfer compiles
#                              on the CPU while the tests use the GPU; have_fi=1, FI_PID its pid
#   check_rows JSON TIME_KEY   exit 1 unless every row of a decode-style bench JSON has TIME_KEY
#                              and no max_abs_diff* against a peer above 0.05
set -u
export PYTHONUNBUFFERED=1
COMMIT=${COMMIT:-unknown}
status=0
have_fi=0

gpu_setup() {
  D="${OUT:?set OUT}/$1"
  mkdir -p "$D"
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo "commit $COMMIT"; date -u; } > "$D/gpu.txt"
}

report() {  # stage, exit code, detail
  if [ "$2" -eq 0 ]; then echo "PASS $1 $3"; else echo "FAIL $1 (exit $2) $3"; status=1; fi
  echo "$1 exit $2 $3" >> "$D/summary.txt"
}

start_flashinfer_warmup() {
  python3 -c "import flashinfer" 2>/dev/null || return 0
  have_fi=1
  NVCC=$(command -v nvcc || true)
  [ -n "$NVCC" ] && export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
  export FLASHINFER_CUDA_ARCH_LIST=9.0a
  python3 "$1" > "$D/fi_warm.log" 2>&1 &
  FI_PID=$!
}

check_rows() {
  python3 - "$1" "$2" <<'PY'
import json, sys
rows, key = json.load(open(sys.argv[1]))["rows"], sys.argv[2]
bad = [r["shape"] for r in rows if "error" in r or not r.get(key)]
diff = [(r["shape"], k, r[k]) for r in rows for k in r if k.startswith("max_abs_diff") and not r[k] <= 0.05]
print(f"{len(rows)} rows, {len(bad)} without {key} {bad}, {len(diff)} output mismatches {diff}")
sys.exit(1 if bad or diff else 0)
PY
}
