#!/usr/bin/env bash
set -u
out=$1
mkdir -p /tmp/nixl /tmp/site "$out" && tar -xzf .whl-nixl/nixl_cu13_slim.tar.gz -C /tmp/nixl || exit 1
python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/nixl PYTHONUNBUFFERED=1
{ date -u; nvidia-smi -L; nproc; uptime; } > "$out/machine.txt" 2>&1
run() { name=$1; shift; s=$(date +%s); timeout "$@" > "$out/$name.log" 2>&1; echo "$name rc=$? $(( $(date +%s) - s )) s" >> "$out/machine.txt"; tail -1 "$out/$name.log"; }
run nixl_tests 120 python3 -m pytest -q -p no:cacheprovider -rA tests/test_nixl_gpu.py
run mla_tests 200 python3 -m pytest -q -p no:cacheprovider -rA tests/test_mla_gpu.py tests/test_mla_extend_gpu.py tests/test_mla_fp8_gpu.py
run mla_bench 60 python3 bench/kvbench.py --routine mla --out "$out" --name mla_smoke --fp8 --shapes 4x1024x16
uptime >> "$out/machine.txt"; cat "$out/machine.txt"
