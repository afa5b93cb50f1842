#!/usr/bin/env bash
# The second device call after bench/nixl_gpu.sh, whose benchmark ran past its 200 s: UCX had
# no CUDA IPC there (VRAM READs went through tcp/lo at 0.4 GB/s), so the GPU's 2 MiB blocks are
# measured up to 64 (128 MiB per pool) and the host up to 2 GiB per pool; tools/nixl_cuda_probe.py
# logs why UCX left cuda_ipc out.
#
#   bash bench/nixl_gpu_rest.sh BUNDLE.tar.gz OUT_DIR COMMIT
set -u
bundle=$1 out=$2 commit=$3
mkdir -p /tmp/nixl "$out/results" && tar -xzf "$bundle" -C /tmp/nixl || exit 1
export PYTHONPATH=$PWD/python:/tmp/nixl${PYTHONPATH:+:$PYTHONPATH}
export KVPOOL_CUDA_DIR=$PWD/cuda PYTHONUNBUFFERED=1
{ date -u; nproc; uptime; ls /dev | grep -i nvidia; } > "$out/machine_rest.txt" 2>&1
UCX_PROTO_INFO=y UCX_LOG_LEVEL=debug timeout 25 python3 tools/nixl_cuda_probe.py \
    > "$out/probe_full.log" 2>&1
echo "probe rc=$?" >> "$out/machine_rest.txt"
grep -iE "cuda_ipc|probe READ|software emulation|cuda_copy/cuda|tcp/lo" "$out/probe_full.log" \
    | head -300 > "$out/cuda_probe.log"
rm -f "$out/probe_full.log"
UCX_PROTO_INFO=y timeout 45 python3 bench/kvbench.py --routine transfer_nixl --memory host \
    --max-bytes 2147483648 --commit "$commit" --out "$out/results" --name transfer_nixl_host \
    > "$out/bench_host.log" 2>&1
echo "bench host rc=$?" >> "$out/machine_rest.txt"
UCX_PROTO_INFO=y timeout 30 python3 bench/kvbench.py --routine transfer_nixl --memory cuda \
    --blocks 2MiB --max-bytes 134217728 --commit "$commit" --out "$out/results" \
    --name transfer_nixl_cuda_2MiB > "$out/bench_cuda_2MiB.log" 2>&1
echo "bench cuda 2MiB rc=$?" >> "$out/machine_rest.txt"
uptime >> "$out/machine_rest.txt"
cat "$out/machine_rest.txt"
grep "probe READ" "$out/cuda_probe.log"
grep -E "^(cuda|host) " "$out"/bench_*.log | grep -v " done$" | tail -60
