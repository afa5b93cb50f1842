#!/usr/bin/env bash
# Runs every loom model of rust/core/tests/loom.rs at each preemption bound in LOOM_BOUNDS
# (default "3", the soak bound the file documents), one model and bound at a time under a
# wall-clock cap, and writes one line per model and bound (completed / failed / did not finish
# within the cap, with seconds) to the file given. A model that does not finish at one bound is
# not run at the higher ones (more preemptions only add interleavings).
# Usage: [LOOM_BOUNDS="1 2 3"] [LOOM_BINARY=...] tools/loom_bounds.sh OUT_FILE [CAP_SECONDS (default 600)] [MODEL...]
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1
cap=${2:-600}
shift $(( $# >= 2 ? 2 : 1 ))
read -r -a bounds <<< "${LOOM_BOUNDS:-3}"
export RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom
# LOOM_BINARY: an already built test binary (skips the build, e.g. while another cargo runs).
binary=${LOOM_BINARY:-$(cargo test --locked -p kvpool-core --release --test loom --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable")][-1])')}
models=("$@")
if [ ${#models[@]} -eq 0 ]; then
    mapfile -t models < <("$binary" --list 2>/dev/null | sed -n 's/: test$//p')
fi
{
    echo "# loom models at LOOM_MAX_PREEMPTIONS in (${bounds[*]}), each capped at ${cap} s wall clock (nice 19)"
    echo "# commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- rust || echo -dirty), $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores shared with other jobs (load average $(cut -d' ' -f1-3 /proc/loadavg) at the start)"
} > "$out"
for model in "${models[@]}"; do
    for bound in "${bounds[@]}"; do
        start=$SECONDS
        LOOM_MAX_PREEMPTIONS=$bound timeout "$cap" nice -n 19 "$binary" --exact "$model" > /dev/null 2>&1
        rc=$?
        took=$((SECONDS - start))
        case $rc in
            0) outcome="completed" ;;
            124) outcome="did not finish within ${cap} s" ;;
            *) outcome="FAILED (exit $rc)" ;;
        esac
        echo "$model bound $bound: $outcome ($took s)" | tee -a "$out"
        [ $rc -eq 124 ] && break
    done
done
