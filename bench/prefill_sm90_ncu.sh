#!/bin/bash
# Nsight Compute on the Hopper prefill (one device call, everything under $OUT), each run within
# what is left of BUDGET_S seconds: (1) sections on 1 x 8192 causal (the shape profiled at
# 172d750), (2) per-SASS-instruction warp-stall samples on the same launch (CSV: which
# instructions the warps wait at), (3) sections on 256 x 128 and (4) on 32 x 512 on 1536.
# Usage (device): BUDGET_S=95 bash bench/prefill_sm90_ncu.sh
set -u
cd "$(dirname "$0")/.."
export KVPOOL_CUDA_DIR=$PWD/cuda PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
BUDGET_S=${BUDGET_S:-95}
START=$SECONDS
NCU="ncu --clock-control none -k regex:paged_prefill_sm90 --launch-skip 1 --launch-count 1"
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy"
go() {  # go NAME TIMEOUT CMD...
    local name=$1 t=$2 l=$((BUDGET_S - (SECONDS - START))); shift 2
    [ "$l" -lt 10 ] && { echo "== $name skipped" | tee -a "$OUT/log"; return; }
    [ "$t" -gt "$l" ] && t=$l
    timeout "$t" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name rc=$? at $((SECONDS - START))s" | tee -a "$OUT/log"
}
go ncu_8k 40 $NCU $SECTIONS python3 tools/profile_prefill.py sm90 1 8192 0
go ncu_8k_sass 40 $NCU --section SourceCounters --section WarpStateStats --page source --csv --print-source sass python3 tools/profile_prefill.py sm90 1 8192 0
go ncu_256x128 25 $NCU $SECTIONS python3 tools/profile_prefill.py sm90 256 128 0
go ncu_32x512 25 $NCU $SECTIONS python3 tools/profile_prefill.py sm90 32 512 1536
grep -h "Duration\|Compute (SM) Throughput\|Issue Slots Busy\|Warp Cycles Per Issued\|stalled\|represents about" "$OUT"/ncu_8k.log "$OUT"/ncu_256x128.log "$OUT"/ncu_32x512.log | head -40
