import multiprocessing as mp
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, "bench/routines")


def child(conn):
    import kvpool
    from kvpool.transfer.nixl_staging import StagingBuffer
    from transfer_nixl import _layout

    class FakeAgent:
        def register_memory(self, *a):
            return None

        def deregister_memory(self, *a):
            pass

    pool = kvpool.Pool(_layout(64 << 10), 4096, device="cuda")
    sb = StagingBuffer(pool, 4096, FakeAgent(), "VRAM", 0)
    ids = np.array([5], np.int32)
    sb.gather(ids)
    conn.send("ready")
    while True:
        while not conn.poll(0):
            pass
        m = conn.recv()
        if m == "stop":
            break
        t0 = time.perf_counter()
        sb.gather(ids)
        conn.send(time.perf_counter() - t0)


def run(a, parent_work):
    ts = []
    for _ in range(200):
        if parent_work is not None:
            parent_work()
        a.send("g")
        ts.append(a.recv())
    return statistics.median(ts) * 1e6


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=child, args=(b,), daemon=True)
    p.start()
    assert a.recv() == "ready"
    print(f"child gather, parent without CUDA: {run(a, None):.1f} us", flush=True)
    import cupy

    x = cupy.zeros(16, cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()
    print(f"child gather, parent context idle: {run(a, None):.1f} us", flush=True)

    def work():
        x.__iadd__(1)
        cupy.cuda.runtime.deviceSynchronize()

    print(f"child gather, parent kernel+sync before each: {run(a, work):.1f} us", flush=True)
    y = cupy.zeros(1 << 24, cupy.uint8)
    z = cupy.zeros(1 << 24, cupy.uint8)

    def copy():
        cupy.cuda.runtime.memcpyAsync(y.data.ptr, z.data.ptr, 1 << 16, 3, 0)
        cupy.cuda.runtime.deviceSynchronize()

    print(f"child gather, parent D2D copy+sync before each: {run(a, copy):.1f} us", flush=True)
    a.send("stop")
