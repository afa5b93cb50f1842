#!/usr/bin/env bash
# One device call on an H200 box without NIXL installed: the NIXL tests (tests/test_nixl_gpu.py:
# CUDA pools device to device; the descriptor and host-transfer tests beside them) and the
# transfer_nixl benchmark, GPU then host, up to 8 GiB pools. NIXL comes from the slim bundle
# tools/nixl_slim_bundle.py makes (12 MB, carried with the tree). UCX_PROTO_INFO=y has UCX print
# which transport each transfer took (in the logs).
#
#   bash bench/nixl_gpu.sh BUNDLE.tar.gz OUT_DIR COMMIT
#
# NIXL_BENCH_MEMORY (both | host | cuda) and NIXL_BENCH_QUICK=1 shorten it for a check on a
# machine without a GPU.
set -u
bundle=$1 out=$2 commit=$3
memory=${NIXL_BENCH_MEMORY:-both}
quick=${NIXL_BENCH_QUICK:+--quick}
mkdir -p /tmp/nixl "$out" && tar -xzf "$bundle" -C /tmp/nixl || exit 1
export PYTHONPATH=$PWD/python:/tmp/nixl${PYTHONPATH:+:$PYTHONPATH}
export KVPOOL_CUDA_DIR=$PWD/cuda PYTHONUNBUFFERED=1
{
    date -u
    nvidia-smi -L
    nproc
    uptime
    python3 -c "import nixl_cu13; print('nixl from', nixl_cu13.__file__)"
} > "$out/machine.txt" 2>&1
UCX_PROTO_INFO=y timeout 110 python3 -m pytest -q -p no:cacheprovider -s -rA \
    tests/test_nixl_gpu.py tests/test_nixl_descriptors.py tests/test_nixl_transfer.py \
    > "$out/gpu_tests.log" 2>&1
echo "tests rc=$?" >> "$out/machine.txt"
UCX_PROTO_INFO=y timeout 200 python3 bench/kvbench.py --routine transfer_nixl --memory "$memory" \
    --max-bytes 8589934592 --commit "$commit" --out "$out/results" $quick > "$out/bench.log" 2>&1
echo "bench rc=$?" >> "$out/machine.txt"
uptime >> "$out/machine.txt"
cat "$out/machine.txt"
grep -E "passed|failed|skipped|error|PASSED|FAILED|SKIPPED|ERROR" "$out/gpu_tests.log" | tail -30
grep -E "^(cuda|host) " "$out/bench.log" | grep -v " done$" | tail -90
