#!/usr/bin/env bash
# fp8 KV cache on the GPU box, self-checking: the fp8 GPU tests (quantizing append bit for bit,
# fp8 decode and prefill against the float64 reference on the dequantized cache, end-to-end
# error against the unquantized cache), then the fp8 decode benchmark (ours fp8 vs ours fp16 vs
# FlashInfer fp8, both modes) and the fp8 prefill rows (ours fp8 vs ours fp16). Run from the
# repository root after installing the wheel (and, when present, the FlashInfer wheels) and
# setting PYTHONPATH, e.g. with dist/ and .whl/ copied to the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl $(ls .whl/*.whl 2>/dev/null)
#   PYTHONPATH=/tmp/site COMMIT=<sha> bash bench/gpu_fp8.sh
# Writes into $OUT/fp8/ (and all of it as $OUT/fp8.tar.gz); prints one PASS/FAIL line per stage
# and the decode targets; exits non-zero when a stage fails.
# Expected: ~2.5 min tests (mostly NVRTC compiles of the fp8 modules), ~2 min decode bench,
# ~30 s prefill rows.
. "$(dirname "$0")/gpu_common.sh"
gpu_setup fp8
start_flashinfer_warmup bench/fi_fp8_warm.py

KVPOOL_FP8_REPORT="$D/fp8_errors.json" timeout 220 python3 -m pytest -q -rs -m gpu \
  tests/test_fp8_gpu.py > "$D/gpu_tests.log" 2>&1
report tests $? "$(tail -1 "$D/gpu_tests.log")"

[ $have_fi = 1 ] && { wait "$FI_PID"; echo "flashinfer fp8 warm-up: $(tr '\n' ';' < "$D/fi_warm.log" | cut -c1-300)"; }

KVPOOL_COMMIT=$COMMIT timeout 200 python3 bench/fp8_bench.py "$D/fp8_h200.json" \
  > "$D/bench.log" 2>&1
rc=$?
check_rows "$D/fp8_h200.json" kvpool_fp8_us >> "$D/bench.log" 2>&1
chk=$?
python3 - "$D/fp8_h200.json" >> "$D/bench.log" 2>&1 <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if "error" not in r and r.get("kvpool_fp8_us")]
big = [r for r in rows if r["kv_bytes_fp8"] >= 256e6]
fi = [r for r in rows if r.get("fp8_speedup_vs_best_flashinfer_fp8")]
print("targets: x our fp16 on large shapes (>= 1.8): "
      + " ".join(f"{r['shape']}={r['fp8_speedup_vs_our_fp16']}" for r in big)
      + " | x best FlashInfer fp8 (>= 1.0): "
      + " ".join(f"{r['shape']}={r['fp8_speedup_vs_best_flashinfer_fp8']}" for r in fi))
PY
[ $rc -eq 0 ] && rc=$chk
report bench $rc "$(tail -2 "$D/bench.log" | head -1)"
tail -13 "$D/bench.log" | head -11
tail -1 "$D/bench.log"

KVPOOL_COMMIT=$COMMIT timeout 90 python3 bench/fp8_prefill_bench.py "$D/fp8_prefill_h200.json" \
  > "$D/prefill_bench.log" 2>&1
report prefill_bench $? "$(tail -1 "$D/prefill_bench.log")"
python3 - "$D/fp8_prefill_h200.json" <<'PY' 2>/dev/null
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f"prefill {r['shape']}: fp16 {r.get('kvpool_fp16_us')} us, fp8 {r.get('kvpool_fp8_us')} us, "
          f"x{r.get('fp8_speedup_vs_our_fp16')}, max |fp8 - fp16| {r.get('max_abs_diff_fp8_vs_fp16')}")
PY
tar -czf "$OUT/fp8.tar.gz" -C "$OUT" fp8
exit $status
