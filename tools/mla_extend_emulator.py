"""Tile-level NumPy emulation of cuda/paged_mla_decode.cu (decode and extend): every CTA of a
launch, its query rows (position-major: row r is head r % H of query position r // H), its
causal key bound, its split chunk, its 64-token tiles with the table and pool masks, the online
softmax in the log2 domain as the kernel keeps it (running max, alpha rescale, the -inf row
guard), the split partials' layout ((seq * max_splits + split) * rows_per_seq + row) and
mla_merge. Float64 throughout: the kernel's index, mask and merge arithmetic are checked on a
machine without a GPU (tests/test_mla_extend.py); its mma fragments are the decode's, unchanged
(tools/tc_fragment_emulator.py covers the pattern).

The shared K = V head_dim 512 launch (ROPE = 0, kernels/_shared_kv.py) is the same emulation
with KV heads: cache [num_pages, block_size, num_kv_heads, 512], q_pe None, the grid's x over
(KV head, row tile), query head kvh * group_heads + r % group_heads, partials at
((seq * max_splits + split) * num_kv_heads + kvh) * rows_per_seq + row.

An fp8 latent cache (KV_FP8): `cache` holds the codes' values unscaled, as the kernel's 16-bit
tile does, and `kv_scale` (the layer's scale) multiplies the logits' scale and the output's
1 / row sum, where the kernel applies it (qk_scale, kv_mul).

Every formula below names the line of the .cu it mirrors; `limit_shift` moves the causal key
bound (key_limit) by that many tokens and `kv_head_shift` makes KV head kvh read the rows of
head kvh + shift: the mutations the tests must catch.
Run: python tools/mla_extend_emulator.py (prints the largest relative error per case).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DV, DQK = 512, 576
NEG_INF = -math.inf


@dataclass(frozen=True)
class Launch:
    """The plan's numbers the kernel receives: rows per CTA (HB), tokens per tile (BN), the
    split (chunk_tokens, max_splits), rows_per_seq (longest qo_len x heads of one KV head)."""

    head_tile: int
    chunk_tokens: int
    max_splits: int
    rows_per_seq: int
    bn: int = 64


def num_splits_of(length: int, chunk_tokens: int, max_splits: int) -> int:  # decode_common.cuh
    return max(1, min(max_splits, -(-length // chunk_tokens)))


def split_range(split: int, length: int, chunk: int, max_splits: int) -> tuple[int, int, int]:
    n = num_splits_of(length, chunk, max_splits)
    begin = split * chunk
    end = length if split == n - 1 else min(length, begin + chunk)
    return n, begin, end


def query_rows(qo_indptr, seq: int, num_heads: int) -> tuple[int, int, int]:
    """(q_begin, q_len, rows) of query_rows(); qo_indptr None is decode."""
    if qo_indptr is None:
        return seq, 1, num_heads
    begin = int(qo_indptr[seq])
    q_len = int(qo_indptr[seq + 1]) - begin
    return begin, q_len, q_len * num_heads


def key_limit(length: int, q_len: int, qpos, limit_shift: int = 0):
    return length - q_len + qpos + 1 + limit_shift


def emulate(
    q_nope: np.ndarray,
    q_pe: np.ndarray | None,
    cache: np.ndarray,
    page_tables: np.ndarray,
    seq_lens: np.ndarray,
    qo_indptr: np.ndarray | None,
    scale: float,
    launch: Launch,
    limit_shift: int = 0,
    kv_head_shift: int = 0,
    kv_scale: float = 1.0,
) -> np.ndarray:
    """out [tokens, H, 512] as the two launches write it (NaN where nothing was written).
    cache [num_pages, block_size, 576] (float64; MLA) or [num_pages, block_size, num_kv_heads,
    512] (shared K = V, q_pe None), page_tables [num_seqs, pt_width] int."""
    tokens, num_heads, _ = q_nope.shape
    if cache.ndim == 3:  # MLA: one latent "KV head" for all query heads
        cache = cache[:, :, None, :]
    num_kv_heads = cache.shape[2]
    group_heads = num_heads // num_kv_heads
    num_seqs = len(seq_lens)
    num_pages, bs = cache.shape[0], cache.shape[1]
    dqk = cache.shape[3]
    pt_width = page_tables.shape[1]
    hb, bn = launch.head_tile, launch.bn
    tiles_per_head = -(-launch.rows_per_seq // hb)
    ctas_per_seq = num_kv_heads * tiles_per_head
    scale_log2 = scale * math.log2(math.e) * kv_scale  # qk_scale = scale_log2 * kv_mul
    parts = [q_nope] if q_pe is None else [q_nope, q_pe]
    q = np.concatenate(parts, axis=2).astype(np.float64)
    assert q.shape[2] == dqk
    out = np.full((tokens, num_heads, DV), np.nan)
    all_rows = num_kv_heads * launch.rows_per_seq  # [.., kvh * rows_per_seq + row]
    part_o = np.full((num_seqs, launch.max_splits, all_rows, DV), np.nan)
    part_lse = np.full((num_seqs, launch.max_splits, all_rows), np.nan)
    for seq in range(num_seqs):
        length = max(int(seq_lens[seq]), 0)
        q_begin, q_len, rows = query_rows(qo_indptr, seq, group_heads)
        for x in range(ctas_per_seq):
            kvh = x // tiles_per_head  # kvh = blockIdx.x / tiles_per_head
            r_cta = (x - kvh * tiles_per_head) * hb
            kv_rows = cache[:, :, (kvh + kv_head_shift) % num_kv_heads]  # kv_base += kvh * stride
            if r_cta >= rows:
                continue
            for split in range(launch.max_splits):
                n_splits, t_begin, t_end = split_range(
                    split, length, launch.chunk_tokens, launch.max_splits
                )
                if split >= n_splits:
                    continue
                last_row = min(r_cta + hb, rows) - 1
                t_end = min(t_end, key_limit(length, q_len, last_row // group_heads, limit_shift))
                n_tiles = -(-(t_end - t_begin) // bn) if t_end > t_begin else 0
                r = r_cta + np.arange(hb)
                valid = r < rows
                tok = q_begin + r // group_heads
                head = kvh * group_heads + r % group_heads
                qt = np.zeros((hb, dqk))
                qt[valid] = q[tok[valid], head[valid]]
                lim = key_limit(length, q_len, r // group_heads, limit_shift)
                m = np.full(hb, NEG_INF)
                ll = np.zeros(hb)
                o = np.zeros((hb, DV))
                for it in range(n_tiles):
                    t = t_begin + it * bn + np.arange(bn)
                    entry = t // bs
                    ok = (t < t_end) & (entry < pt_width)
                    page = np.full(bn, -1)
                    page[ok] = page_tables[seq, entry[ok]]
                    ok &= (page >= 0) & (page < num_pages)
                    kv = np.zeros((bn, dqk))  # zero-filled without a read
                    kv[ok] = kv_rows[page[ok], t[ok] % bs]
                    s = qt @ kv.T
                    mask = ok[None, :] & (t[None, :] < lim[:, None])
                    s = np.where(mask, s * scale_log2, NEG_INF)
                    mn = np.maximum(m, s.max(axis=1))
                    mu = np.where(mn == NEG_INF, 0.0, mn)
                    alpha = np.exp2(m - mu)
                    p = np.exp2(s - mu[:, None])
                    m = mn
                    ll = ll * alpha + p.sum(axis=1)
                    o = o * alpha[:, None] + p @ kv[:, :DV]  # V: the same rows' first 512
                inv = np.where(ll > 0, kv_scale / np.where(ll > 0, ll, 1.0), 0.0)  # kv_mul / l
                if n_splits == 1:
                    out[tok[valid], head[valid]] = (o * inv[:, None])[valid]
                else:
                    at = kvh * launch.rows_per_seq + r[valid]
                    part_o[seq, split, at] = (o * inv[:, None])[valid]
                    lse = np.where(ll > 0, m + np.log2(np.where(ll > 0, ll, 1.0)), NEG_INF)
                    part_lse[seq, split, at] = lse[valid]
    # mla_merge: one (KV head x row, sequence) per CTA.
    for seq in range(num_seqs):
        q_begin, q_len, rows = query_rows(qo_indptr, seq, group_heads)
        n = num_splits_of(max(int(seq_lens[seq]), 0), launch.chunk_tokens, launch.max_splits)
        if n == 1:
            continue
        for x in range(all_rows):
            kvh, row = divmod(x, launch.rows_per_seq)
            if row >= rows:
                continue
            lse = part_lse[seq, :n, x]
            mx = lse.max()
            acc, wsum = np.zeros(DV), 0.0
            if mx != NEG_INF:
                w = np.exp2(lse - mx)
                wsum = w.sum()
                acc = (w[:, None] * part_o[seq, :n, x]).sum(axis=0)
            inv = 1.0 / wsum if wsum > 0 else 0.0
            out[q_begin + row // group_heads, kvh * group_heads + row % group_heads] = acc * inv
    return out


def main() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from kvpool import reference

    rng = np.random.default_rng(0)
    bs, heads = 16, 5
    lens = np.array([1, 40, 64, 65, 130])
    qo = np.array([1, 3, 64, 17, 65])
    indptr = np.concatenate([[0], np.cumsum(qo)])
    width = -(-lens.max() // bs)
    pages = rng.permutation(64)[: len(lens) * width].reshape(len(lens), width)
    cache = rng.standard_normal((64, bs, DQK))
    qn = rng.standard_normal((indptr[-1], heads, DV))
    qp = rng.standard_normal((indptr[-1], heads, DQK - DV))
    want = reference.mla_extend_reference(qn, qp, cache, pages, lens, indptr, 0.05)
    for tile, chunk, splits in ((16, 1 << 20, 1), (64, 64, 3), (32, 128, 2)):
        got = emulate(
            qn, qp, cache, pages, lens, indptr, 0.05, Launch(tile, chunk, splits, qo.max() * heads)
        )
        err = np.abs(got - want).max() / np.abs(want).max()
        print(f"tile {tile} chunk {chunk} splits {splits}: {err:.2e}")


if __name__ == "__main__":
    main()
