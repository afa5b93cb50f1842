#!/usr/bin/env bash
# The free-list benchmarks on the 16-core H200 host, ours against the baselines in the same run:
#  - the criterion grid of rust/core/benches/free_list.rs (1, 2, 4, 8, 16 threads x 1, 16, 256
#    blocks per call, against a Mutex<Vec<u32>> with the same checks), from a binary built on
#    the development machine and copied along (bench/bin/ is ignored by git):
#        cargo bench -p kvpool-core --bench free_list --no-run
#        cp <the executable it names> bench/bin/free_list_bench
#  - the Python 16-block alloc_many/free_many round trip against the pure-Python pool with the
#    same checks (bench/pool_bench.py), from the release wheel in dist/
#    (maturin build --release --locked -o dist).
# On the GPU host, with bench/bin/ and dist/ copied into the checkout:
#     COMMIT=<sha> bash bench/run_free_list_h200.sh
# Writes $OUT/free_list_h200.json and $OUT/pool_python_h200.json (copy them into bench/results/).
# About 2 minutes for the grid, 1 for the Python cases.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
COMMIT=${COMMIT:-unknown}
MACHINE="$(nproc)-CPU $(lscpu | sed -n 's/^Model name: *//p' | head -1), H200 host"

export CRITERION_HOME=/tmp/kvpool-criterion
rm -rf "$CRITERION_HOME"
timeout 420 bench/bin/free_list_bench --bench --warm-up-time 1 --measurement-time 2 2>&1 \
    | grep -E '^(single|batch)|time:' > "$OUT/free_list_criterion.log" || true
python3 bench/collect_criterion.py --criterion-dir "$CRITERION_HOME" --machine "$MACHINE" \
    --commit "$COMMIT" --out "$OUT/free_list_h200.json"

python3 -m pip install -q --no-index --no-deps --target /tmp/kvpool-site dist/*.whl
PYTHONPATH=/tmp/kvpool-site python3 bench/pool_bench.py --out "$OUT/pool_python_h200.json" --commit "$COMMIT"
