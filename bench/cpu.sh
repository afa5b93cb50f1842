#!/usr/bin/env bash
# Every CPU-only figure the READMEs quote, in one run at one clean commit, on a machine without
# a GPU (the host backend), from the repository root with the package installed
# (`pip install -e '.[test,bench]'` or `maturin develop --release`):
#     bash bench/vm_session.sh
# Writes into bench/results/<date>_<commit>_<machine>/ (bench/provenance.py names it):
#   simulate_sharegpt_llama-3-8b_host.json  paged vs contiguous at each reservation (sim_bench.py)
#   prefix_sim.json and its plots           prefix caching on vs off (prefix_sim_bench.py)
#   swap_sim_llama-3-8b.json                preemption by swap vs recompute (swap_sim_bench.py)
#   prefix_cache_host.json                  the prefix cache against a pure-Python one (prefix_bench.py)
#   pool_python.json                        alloc_many/free_many against a pure-Python pool (pool_bench.py)
#   vm_session.log                          every script's output, with its wall time
# The timed figures (wall times, microseconds) want a quiet machine: the script records the load
# average before each step, and refuses a dirty tree (a figure must name the code it measured).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "vm_session.sh: the working tree has changes; commit them first" >&2
  exit 2
fi
DIR=$(python3 -c 'import sys; sys.path.insert(0, "bench"); from provenance import run_dir; print(run_dir())')
mkdir -p "$DIR"
LOG="$DIR/vm_session.log"
: > "$LOG"

step() {  # step NAME COMMAND...
  local name=$1 start=$SECONDS
  shift
  echo "== $name (load average $(cut -d' ' -f1-3 /proc/loadavg)): $*" | tee -a "$LOG"
  "$@" 2>&1 | tee -a "$LOG"
  echo "== $name took $((SECONDS - start)) s" | tee -a "$LOG"
}

step sim python3 bench/sim_bench.py --out "$DIR/simulate_sharegpt_llama-3-8b_host.json"
step prefix_sim python3 bench/prefix_sim_bench.py --out-dir "$DIR"
step swap_sim python3 bench/swap_sim_bench.py --out "$DIR/swap_sim_llama-3-8b.json"
step prefix_cache python3 bench/prefix_bench.py --out "$DIR/prefix_cache_host.json"
step pool python3 bench/pool_bench.py --out "$DIR/pool_python.json"
echo "wrote $DIR" | tee -a "$LOG"
