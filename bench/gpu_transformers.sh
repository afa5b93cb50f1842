#!/usr/bin/env bash
# The transformers integration on the H200 box, from the repository root: its tests
# (bench/gpu_transformers_tests.sh) and then bench/generate_bench.py. Build the wheel here
# (`maturin build --release --locked -o dist`), then on the GPU machine, with dist/ copied
# there:  COMMIT=<sha> bash bench/gpu_transformers.sh
# torch and transformers come from the box. Results land in $OUT/transformers/.
set -u
bash bench/gpu_transformers_tests.sh  # the bench runs whatever the tests found
export PYTHONPATH=${SITE:-/tmp/kvpool-hf-site} PYTHONUNBUFFERED=1
R="$OUT/transformers"
timeout 140 python3 bench/generate_bench.py --out "$R/generate_h200.json" --commit "${COMMIT:-unknown}" 2>&1 \
  | tee "$R/bench.log" | tail -30
