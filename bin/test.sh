#!/usr/bin/env bash
# Installs kvpool with its test dependencies into ./.venv and runs every test that needs no
# GPU: Rust unit/property/stress tests, loom model checks, the stub check and pytest.
# GPU tests (marker `gpu`) skip themselves here; run them on a GPU machine with
# bench/gpu_all.sh (see bench/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q '.[test]'

echo "== cargo test (kvpool-core)"
cargo test --locked -p kvpool-core

echo "== loom model checks of the free list (CI bounds; the soak run is in rust/core/tests/loom.rs)"
loom_start=$SECONDS
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom LOOM_MAX_PREEMPTIONS=2 \
    cargo test --locked -p kvpool-core --release --test loom -- --skip three_threads_share_three_blocks \
    --skip growth_does_not_inflate_the_high_water_of_a_cached_alloc
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom LOOM_MAX_PREEMPTIONS=1 \
    cargo test --locked -p kvpool-core --release --test loom -- --exact growth_does_not_inflate_the_high_water_of_a_cached_alloc
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom LOOM_MAX_PREEMPTIONS=0 \
    cargo test --locked -p kvpool-core --release --test loom -- --exact three_threads_share_three_blocks
echo "loom took $((SECONDS - loom_start)) s"

echo "== ruff (pyflakes rules: an undefined name in a GPU-only test fails here, not on the GPU)"
ruff check --select F tests python bench

echo "== pytest"
python -m pytest -q tests
