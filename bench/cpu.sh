#!/usr/bin/env bash
# Every CPU-only routine, in one run at one clean commit, on any machine (no GPU needed: the
# host backend), from the repository root with kvpool installed in the current Python
# environment, plots included (`maturin develop --release --extras sim`):
#     bash bench/cpu.sh
# Writes into bench/results/<date>_<commit>_<machine>/ (bench/provenance.py names it):
#   sim.json                   the paged scheduler vs contiguous reservation, 10,000 requests
#   prefix_sim.json and plots  the scheduler with prefix caching on vs off
#   swap_sim.json              preemption by swap vs recompute into a host tier
#   hybrid_sim.json and plots  hybrid models' KV pages vs all full attention and uniform pages
#   prefix.json                the prefix cache vs a pure-Python one
#   pool.json                  alloc_many/free_many vs a pure-Python pool
#   free_list.json             the Rust free list vs a mutex (criterion; needs cargo)
#   cpu.log                    every routine's output, with the load average before it and its
#                              wall time
# The timed figures (wall times, microseconds) want a quiet machine: the load average before each
# step is recorded, and a dirty tree is refused (a figure must name the code it measured).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "cpu.sh: the working tree has changes; commit them first" >&2
  exit 2
fi
DIR=$(python3 -c 'import sys; sys.path.insert(0, "bench"); from provenance import run_dir; print(run_dir())')
LOG="$DIR/cpu.log"
: > "$LOG"

routine() {  # routine NAME [ARGS...]
  local name=$1 start=$SECONDS
  echo "== $name (load average $(cut -d' ' -f1-3 /proc/loadavg)): $*" | tee -a "$LOG"
  python3 bench/kvbench.py --routine "$@" --out "$DIR" 2>&1 | tee -a "$LOG"
  echo "== $name took $((SECONDS - start)) s" | tee -a "$LOG"
}

routine sim
routine prefix_sim
routine swap_sim
routine hybrid_sim
routine prefix
routine pool
if command -v cargo > /dev/null; then
  routine free_list
else
  echo "== free_list: skipped (no cargo on PATH)" | tee -a "$LOG"
fi
echo "wrote $DIR" | tee -a "$LOG"
