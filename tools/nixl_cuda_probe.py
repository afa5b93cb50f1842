"""Which UCX transport NIXL takes for a VRAM -> VRAM READ on this machine, and why not CUDA IPC:
two agents in one process READ 64 MiB of one GPU's memory
into another buffer of it, byte-exact, and print the state. Run it with
``UCX_PROTO_INFO=y`` (the transport chosen) and ``UCX_LOG_LEVEL=debug`` (cuda_ipc's reasons),
e.g. ``UCX_LOG_LEVEL=debug python3 tools/nixl_cuda_probe.py 2>&1 | grep -i cuda_ipc``."""

from __future__ import annotations

import sys
import time

import cupy
import numpy as np
from kvpool.transfer.nixl_transport import load_nixl

N = 64 << 20


def main() -> int:
    nixl = load_nixl()
    src = cupy.random.randint(0, 256, N, dtype=cupy.uint8)
    dst = cupy.zeros(N, cupy.uint8)
    cupy.cuda.runtime.deviceSynchronize()
    a = nixl.nixl_agent("probe-a", nixl.nixl_agent_config(backends=["UCX"]))
    b = nixl.nixl_agent("probe-b", nixl.nixl_agent_config(backends=["UCX"]))
    a.register_memory([(dst.data.ptr, N, 0, "")], "VRAM")
    b.register_memory([(src.data.ptr, N, 0, "")], "VRAM")
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    local = np.array([[dst.data.ptr, N, 0]], np.uint64)
    remote = np.array([[src.data.ptr, N, 0]], np.uint64)
    for attempt in range(2):
        handle = a.initialize_xfer(
            "READ", a.get_xfer_descs(local, "VRAM"), a.get_xfer_descs(remote, "VRAM"), "probe-b"
        )
        t0 = time.perf_counter()
        state = a.transfer(handle)
        while state == "PROC":
            state = a.check_xfer_state(handle)
        elapsed = time.perf_counter() - t0
        a.release_xfer_handle(handle)
        same = bool(cupy.array_equal(src, dst))
        print(f"probe READ {attempt}: {state}, {N / elapsed / 1e9:.2f} GB/s, byte-exact {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
