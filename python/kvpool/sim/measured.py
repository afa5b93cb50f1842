"""Measured decode attention on a CUDA pool (optional: needs CuPy and kvpool.kernels).

For every sampled decode step, the probe runs kvpool.kernels.paged_attention_decode once per
layer over the step's real block table and seq_lens (random queries, random KV), timed with
CUDA events. Only the attention kernels are measured; weights, MLPs and sampling are not run,
so "measured decode tokens/s" is attention-only. Anything missing makes `make_probe` return
None and a reason, and the report then says every time is modelled.

Compilation (NVRTC) and the kernels' per-shape preparation are kept out of the timings: the
constructor runs the kernel once on a tiny input (which also checks that a kernel variant exists
for the pool's layout, so an unsupported one falls back to the model before any run starts), and
every new (num_seqs, table width) shape gets one untimed call before its first timed one. Should
the kernel still fail during a run, the probe stops measuring and records the error.
"""

from __future__ import annotations

import functools

import numpy as np

import kvpool
from kvpool.kernels import KvScales, paged_attention_decode


class DecodeProbe:
    def __init__(self, pool: kvpool.Pool, num_q_heads: int, every: int = 10) -> None:
        import cupy  # optional (kvpool[cuda12] or [cuda13]): make_probe falls back without it

        self.cp = cupy
        self.decode = paged_attention_decode
        if pool.layout.elem_bytes == 1:  # an fp8 cache: the kernel reads its (unit) scales
            self.decode = functools.partial(paged_attention_decode, scales=KvScales(pool))
        self.pool = pool
        self.num_q_heads = num_q_heads
        self.every = max(1, every)
        self.calls = 0
        self.seconds = 0.0  # measured kernel time of the sampled steps
        self.tokens = 0  # decode tokens of the sampled steps
        self.steps = 0
        self.error: str | None = None  # set when the kernel failed mid-run; no timing after that
        self._start = cupy.cuda.Event()
        self._stop = cupy.cuda.Event()
        self._shapes: set[tuple[int, int]] = set()  # (num_seqs, table width) already prepared
        self._fill_random()
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile the kernels (untimed) on a tiny input; raises if the layout has no variant."""
        cp = self.cp
        layout = self.pool.layout
        nblk = max(1, min(self.pool.num_blocks, 256))
        bt = cp.arange(nblk, dtype=cp.int32).reshape(1, nblk)
        sl = cp.full((1,), nblk * layout.block_size, dtype=cp.int32)
        q = cp.zeros((1, self.num_q_heads, layout.head_dim), dtype=cp.float16)
        out = cp.empty_like(q)
        max_len = nblk * layout.block_size
        self.decode(q, self.pool, 0, bt, sl, out=out, max_seq_len=max_len)
        if nblk > 1:  # the split-KV path has a second (merge) kernel
            self.decode(q, self.pool, 0, bt, sl, out=out, max_seq_len=max_len, num_splits=2)
        cp.cuda.get_current_stream().synchronize()

    def _run_layers(self, q, bt, sl, out, max_len: int) -> None:
        for layer in range(self.pool.layout.num_layers):
            self.decode(q, self.pool, layer, bt, sl, out=out, max_seq_len=max_len)

    def _fill_random(self) -> None:
        cp = self.cp
        nbytes = self.pool.num_blocks * self.pool.block_bytes
        mem = cp.cuda.UnownedMemory(self.pool.base_ptr, nbytes, self.pool)
        kv = cp.ndarray((nbytes // 2,), dtype=cp.float16, memptr=cp.cuda.MemoryPointer(mem, 0))
        chunk = 1 << 28
        for i in range(0, kv.size, chunk):
            n = min(chunk, kv.size - i)
            kv[i : i + n] = cp.random.standard_normal(n, dtype=cp.float32).astype(cp.float16)

    def __call__(self, block_table: np.ndarray, seq_lens: np.ndarray) -> None:
        """Run and time one decode step (every `every`-th call) over host table / lengths."""
        self.calls += 1
        if self.error is not None or (self.calls - 1) % self.every or len(seq_lens) == 0:
            return
        try:
            self._measure(block_table, seq_lens)
        except Exception as e:  # e.g. a kernel limit the warm-up did not reach: stop measuring
            self.error = f"{type(e).__name__}: {e}"

    def _measure(self, block_table: np.ndarray, seq_lens: np.ndarray) -> None:
        cp = self.cp
        layout = self.pool.layout
        bt = cp.asarray(block_table, dtype=cp.int32)
        sl = cp.asarray(seq_lens, dtype=cp.int32)
        q = cp.random.standard_normal(
            (len(seq_lens), self.num_q_heads, layout.head_dim), dtype=cp.float32
        )
        q = q.astype(cp.float16)
        out = cp.empty_like(q)
        max_len = int(seq_lens.max())
        shape = (int(bt.shape[0]), int(bt.shape[1]))
        if shape not in self._shapes:  # untimed: per-shape preparation (and any compile)
            self._run_layers(q, bt, sl, out, max_len)
            self._shapes.add(shape)
        self._start.record()
        self._run_layers(q, bt, sl, out, max_len)
        self._stop.record()
        self._stop.synchronize()
        self.seconds += cp.cuda.get_elapsed_time(self._start, self._stop) / 1e3
        self.tokens += len(seq_lens)
        self.steps += 1

    def summary(self) -> dict[str, float | int | str | None]:
        return {
            "kind": "measured",
            "what": "paged_attention_decode over all layers, CUDA events, sampled steps",
            "sample_every_steps": self.every,
            "sampled_steps": self.steps,
            "decode_tokens": self.tokens,
            "attention_s": self.seconds,
            "decode_tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else 0.0,
            "error": self.error,  # None, or why measuring stopped (times after it are modelled)
        }


def make_probe(pool: kvpool.Pool, num_q_heads: int, every: int) -> tuple[DecodeProbe | None, str]:
    """A probe for a CUDA pool, or (None, why not)."""
    if pool.device == "host" or str(pool.device).startswith("host"):
        return None, "host pool: step time is modelled"
    try:  # the constructor compiles and runs the kernel once, so an unsupported layout ends here
        return DecodeProbe(pool, num_q_heads, every), "measured"
    except Exception as e:  # CuPy missing, broken CUDA setup, no kernel variant: use the model
        return (
            None,
            f"cannot run the decode kernels ({type(e).__name__}: {e}); step time is modelled",
        )
