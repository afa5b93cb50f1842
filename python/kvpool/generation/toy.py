"""A tiny NumPy transformer whose every layer keeps its K/V in a host kvpool pool.

Small enough for CI, real enough to test a generation loop: K/V are written with
kvpool.append_kv at the step's slots, decode tokens attend through the block table with a
kvpool.decode_plan made once per step and run per layer, and prefill chunks attend causally
over their cached prefix read back from the pool, so a wrong slot, table or length changes
the tokens it emits.
"""

from __future__ import annotations

import numpy as np

from kvpool._core import Pool
from kvpool.generation.batch import StepBatch
from kvpool.generation.sampling import sample
from kvpool.kernels import append_kv, decode_plan


class ToyModel:
    """A ModelRunner over a float32 host pool (num_q_heads = group * the pool's kv heads)."""

    def __init__(self, pool: Pool, vocab_size: int = 97, group: int = 2, seed: int = 0) -> None:
        lay = pool.layout
        if lay.dtype != "float32":
            raise ValueError("ToyModel needs a float32 host pool")
        self.pool, self.vocab_size, self.group = pool, vocab_size, group
        self.hkv, self.d = lay.num_kv_heads, lay.head_dim
        self.hq = self.hkv * group
        width = self.hq * self.d
        rng = np.random.default_rng(seed)
        w = lambda *s: rng.standard_normal(s) / np.sqrt(s[0])
        self.embed = rng.standard_normal((vocab_size, width))
        self.layers = [
            (
                w(width, width),
                w(width, self.hkv * self.d),
                w(width, self.hkv * self.d),
                w(width, width),
            )
            for _ in range(lay.num_layers)
        ]
        self.unembed = w(width, vocab_size)
        self.rope = rng.standard_normal(self.d)  # position enters K through a phase

    def _kv(self, h, positions, wk, wv):
        k = (h @ wk).reshape(-1, self.hkv, self.d) * np.cos(
            positions[:, None, None] * self.rope / 64
        )
        return k.astype(np.float32), (h @ wv).reshape(-1, self.hkv, self.d).astype(np.float32)

    def _prefill_attention(self, q, layer, batch: StepBatch) -> np.ndarray:
        out = np.zeros_like(q)
        bs = self.pool.layout.block_size
        kc, vc = np.asarray(self.pool.k_view(layer)), np.asarray(self.pool.v_view(layer))
        ptr = batch.prefill_qo_indptr
        for i in range(batch.num_prefill):
            total = int(batch.prefill_seq_lens[i])
            rows = np.arange(total)
            blocks = batch.prefill_block_table[i][rows // bs]
            k = kc[blocks, rows % bs].astype(np.float64)  # [total, hkv, d]
            v = vc[blocks, rows % bs].astype(np.float64)
            lo, hi = batch.num_decode + ptr[i], batch.num_decode + ptr[i + 1]
            start = total - (hi - lo)
            qi = q[lo:hi].reshape(hi - lo, self.hkv, self.group, self.d)
            s = np.einsum("tkgd,skd->tkgs", qi, k) / np.sqrt(self.d)
            causal = rows[None, :] > (start + np.arange(hi - lo))[:, None]
            s[np.broadcast_to(causal[:, None, None, :], s.shape)] = -np.inf
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[lo:hi] = np.einsum("tkgs,skd->tkgd", p, v).reshape(hi - lo, self.hq, self.d)
        return out

    def logits(self, batch: StepBatch) -> np.ndarray:
        """float64 [num_sampled, vocab] of the sampled rows, after writing every layer's K/V
        for the whole step."""
        h = self.embed[batch.input_ids]
        n = batch.num_decode
        # One decode plan per step, run per layer (the tables do not change within a step).
        decode = (
            decode_plan(self.pool, batch.decode_block_table, batch.decode_seq_lens, self.hq)
            if n
            else None
        )
        for layer, (wq, wk, wv, wo) in enumerate(self.layers):
            k, v = self._kv(h, batch.positions, wk, wv)
            append_kv(k, v, self.pool, layer, batch.slot_mapping)
            q = (h @ wq).reshape(-1, self.hq, self.d)
            attn = self._prefill_attention(q, layer, batch)
            if decode is not None:
                attn[:n] = decode.run(q[:n].astype(np.float32), layer)
            h = h + attn.reshape(len(h), -1) @ wo
        return h[batch.sample_rows] @ self.unembed

    def run(self, batch: StepBatch) -> np.ndarray:
        return sample(self.logits(batch), batch.temperatures, batch.seeds, batch.sample_positions)
