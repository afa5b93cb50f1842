#!/usr/bin/env bash
# Builds kvpool's manylinux_2_17 x86_64 wheel (tools/build_wheels.sh), installs it with the
# test and transformers extras into ./.venv and runs every test that needs no GPU: formatting,
# Rust unit/property/stress tests, clippy, loom model checks, ruff, mypy and pytest (with the
# stub check) against the installed wheel, not the source tree.
# GPU tests (marker `gpu`) skip themselves here; run them on a GPU machine with
# bench/gpu.sh (see bench/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip

echo "== wheel (tools/build_wheels.sh: release build, manylinux_2_17 x86_64, auditwheel check)"
wheel_start=$SECONDS
rm -rf target/ci-dist
bash tools/build_wheels.sh -o target/ci-dist x86_64
wheel=$(ls target/ci-dist/kvpool-*_x86_64.whl)
echo "the wheel took $((SECONDS - wheel_start)) s"

echo "== install $(basename "$wheel") with its test and transformers extras"
# The transformers extra is PyPI's torch, whose Linux wheel brings its CUDA libraries (about
# 4.5 GB installed; about a minute from pip's cache): tests/test_transformers_cpu.py needs torch
# but no GPU, and tests/test_install.py fails if it is missing rather than letting it skip.
install_start=$SECONDS
python -m pip install -q "$wheel[test,transformers]"
# This build, even over an installed one of the same version (a rerun in the same .venv).
python -m pip install -q --force-reinstall --no-deps "$wheel"
echo "the install took $((SECONDS - install_start)) s"

echo "== formatting (rustfmt.toml, [tool.ruff] in pyproject.toml)"
cargo fmt --all -- --check
ruff format --check tests python bench tools

echo "== cargo test (kvpool-core)"
cargo test --locked -p kvpool-core

echo "== clippy (every crate and target, warnings are errors)"
if cargo clippy --version > /dev/null 2>&1; then
  cargo clippy --locked --workspace --all-targets -q -- -D warnings
else
  echo "clippy is not installed here (rustup component add clippy): skipped"
fi

echo "== loom model checks of the free list (CI bounds; the soak run is tools/loom_bounds.sh)"
# Each model at the highest preemption bound that finishes in about a minute on a 2-core machine
# (rust/core/src/free_list.md has the times per bound): 3, except two. The three-thread model
# runs at 2 (about 8 minutes, the longest step here; bound 2 is the lowest at which it catches
# a refusal made while the ids were in another thread's hands). The growth model runs at 5:
# its bug pattern (the growth parking a depot id in the middle of the sample) is the fifth
# preemption loom's search reaches, and it takes seconds there.
loom_start=$SECONDS
loom_ran=""
loom() {  # bound, model names (each run alone, exact)
  local bound=$1
  shift
  for model in "$@"; do
    loom_ran="$loom_ran $model"
    RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom LOOM_MAX_PREEMPTIONS=$bound \
        cargo test --locked -p kvpool-core --release --test loom -q -- --exact "$model"
  done
}
loom 5 growth_does_not_inflate_the_high_water_of_a_cached_alloc
loom 3 a_count_during_a_refill_does_not_miss_the_moving_ids alloc_races_free \
    concurrent_double_free_has_one_winner failed_batch_free_undo_keeps_the_list_consistent \
    failed_share_undo_handles_repeated_ids share_races_free shrink_races_alloc_and_free \
    batch_steals_from_another_threads_cache ids_cached_by_an_exited_thread_come_back \
    alloc_many_is_all_or_nothing_under_contention \
    neighbours_in_one_word_free_and_alloc_at_once failed_batch_free_across_words_undoes_its_runs \
    tagged_head_defeats_aba tagged_head_defeats_aba_for_chains
loom 2 three_threads_share_three_blocks
# Every model in rust/core/tests/loom.rs runs at some bound: a new model missing from the lists
# above fails here instead of never running.
for model in $(RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
    cargo test --locked -p kvpool-core --release --test loom -q -- --list 2>/dev/null | sed -n 's/: test$//p'); do
  case " $loom_ran " in *" $model "*) ;; *) echo "loom model $model is not in bin/test.sh's lists"; exit 1 ;; esac
done
echo "loom took $((SECONDS - loom_start)) s"

echo "== ruff (rules in pyproject.toml: an undefined name in a GPU-only test fails here, not on the GPU)"
ruff check tests python bench tools

echo "== mypy (python/kvpool; settings in pyproject.toml)"
mypy

echo "== pytest (against the installed wheel: tests/test_install.py checks that it is)"
KVPOOL_TEST_WHEEL=1 python -m pytest -q tests
