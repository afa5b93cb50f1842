#!/usr/bin/env bash
# One device call on an H200 box without NIXL installed: CUDA pools over NIXL with the owner in
# another process, so that UCX can move GPU memory by CUDA IPC. NixlTransport sets
# UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y for a CUDA pool's agent unless it is set (UCX's `auto` turns
# cuda_ipc GET off without NVLink); the second benchmark sets `auto` to show what that costs.
# The first has the staged case beside the scattered one (the transport's staging buffers).
# NIXL comes from the slim bundle (tools/nixl_slim_bundle.py), kvpool from the wheel in dist/.
#
#   bash bench/nixl_gpu_ipc.sh BUNDLE.tar.gz OUT_DIR COMMIT
set -u
bundle=$1 out=$2 commit=$3
mkdir -p /tmp/nixl /tmp/site "$out/results" && tar -xzf "$bundle" -C /tmp/nixl || exit 1
python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/nixl${PYTHONPATH:+:$PYTHONPATH}
export KVPOOL_CUDA_DIR=$PWD/cuda PYTHONUNBUFFERED=1
{
    date -u
    nvidia-smi -L
    nproc
    uptime
    python3 -c "import kvpool, nixl_cu13; print('kvpool from', kvpool.__file__); print('nixl from', nixl_cu13.__file__)"
} > "$out/machine.txt" 2>&1
UCX_PROTO_INFO=y timeout 200 python3 -m pytest -q -p no:cacheprovider -s -rA \
    tests/test_nixl_gpu.py tests/test_nixl_descriptors.py tests/test_nixl_staging.py \
    > "$out/gpu_tests.log" 2>&1
echo "tests rc=$?" >> "$out/machine.txt"
UCX_PROTO_INFO=y timeout 240 python3 bench/kvbench.py --routine transfer_nixl --memory cuda \
    --owner process --max-bytes 8589934592 --commit "$commit" --out "$out/results" \
    --name transfer_nixl_cuda_ipc > "$out/bench_ipc.log" 2>&1
echo "bench ipc rc=$?" >> "$out/machine.txt"
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto UCX_PROTO_INFO=y timeout 60 python3 bench/kvbench.py \
    --routine transfer_nixl --memory cuda --owner process --quick --blocks 64KiB 2MiB \
    --max-bytes 134217728 --commit "$commit" --out "$out/results" \
    --name transfer_nixl_cuda_auto > "$out/bench_auto.log" 2>&1
echo "bench auto rc=$?" >> "$out/machine.txt"
uptime >> "$out/machine.txt"
cat "$out/machine.txt"
grep -E "passed|failed|skipped|error|PASSED|FAILED|SKIPPED|ERROR" "$out/gpu_tests.log" | tail -30
for log in "$out"/bench_*.log; do
    echo "== $log: transports"; grep -oE "(cuda_ipc|cuda_copy|tcp/lo|cma)[^|]*\|" "$log" | sort | uniq -c | head
    grep -E "^(cuda|host) " "$log" | grep -v " done$" | tail -70
done
