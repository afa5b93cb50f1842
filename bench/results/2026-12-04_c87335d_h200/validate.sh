#!/usr/bin/env bash
# the validation call: NIXL GPU tests, the CUDA-graph tests of both runners, MLA fp8
set -u
out=$1
mkdir -p /tmp/nixl /tmp/site && tar -xzf .whl-nixl/nixl_cu13_slim.tar.gz -C /tmp/nixl || exit 1
python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/nixl PYTHONUNBUFFERED=1
{ date -u; nvidia-smi -L; nproc; uptime; git log -1 --format=%h 2>/dev/null; python3 -c "import kvpool, nixl_cu13; print(kvpool.__file__, nixl_cu13.__file__)"; } > "$out/machine.txt" 2>&1
run() { name=$1; shift; s=$(date +%s); timeout "$@" > "$out/$name.log" 2>&1; echo "$name rc=$? $(( $(date +%s) - s )) s" >> "$out/machine.txt"; tail -1 "$out/$name.log"; }
run nixl_tests 150 python3 -m pytest -q -p no:cacheprovider -rA tests/test_nixl_gpu.py tests/test_nixl_staging.py tests/test_nixl_descriptors.py
run graph_tests 200 python3 -m pytest -q -p no:cacheprovider -rA -k "graph" tests/test_transformers_gpu.py tests/test_hybrid_models_gpu.py
run mla_fp8_tests 120 python3 -m pytest -q -p no:cacheprovider -rA tests/test_mla_fp8_gpu.py
uptime >> "$out/machine.txt"; cat "$out/machine.txt"
