"""NumPy float64 reference of the kvpool kernels.

Used by the tests as the ground truth for the CUDA kernels, and by the host backend
(``Pool(device="host")``), so the kernel API works without a GPU, slowly. Caches are the
per-layer views of a pool, ``[num_blocks, block_size, num_kv_heads, head_dim]``; bfloat16
data is carried as uint16 bit patterns (NumPy has no bfloat16).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

NULL_SLOT = -1


def to_float64(x: npt.NDArray, dtype: str) -> npt.NDArray[np.float64]:
    """Elements of the pool's dtype (float16, or bfloat16 as uint16 bits) as float64."""
    if dtype == "bfloat16":
        bits = np.asarray(x).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    return np.asarray(x).astype(np.float64)


def from_float64(x: npt.NDArray, dtype: str) -> npt.NDArray:
    """float64 -> the pool's dtype, rounding to nearest even (bfloat16 returned as uint16)."""
    if dtype == "bfloat16":
        u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return rounded.astype(np.uint16)
    if dtype == "float32":
        return np.asarray(x).astype(np.float32)
    return np.asarray(x).astype(np.float16)


def gather_kv(
    cache: npt.NDArray, block_table: npt.NDArray, seq_len: int
) -> npt.NDArray:
    """The first `seq_len` tokens of one sequence as a contiguous [seq_len, kv_heads, dim]."""
    block_size = cache.shape[1]
    n = -(-seq_len // block_size)
    blocks = cache[np.asarray(block_table[:n], dtype=np.int64)]
    return blocks.reshape(n * block_size, *cache.shape[2:])[:seq_len]


def attention_decode(
    q: npt.NDArray[np.float64],
    k: npt.NDArray[np.float64],
    v: npt.NDArray[np.float64],
    scale: float,
) -> npt.NDArray[np.float64]:
    """One sequence, contiguous: q [Hq, D], k/v [L, Hkv, D] -> [Hq, D] (float64, GQA)."""
    hq, hkv = q.shape[0], k.shape[1]
    if k.shape[0] == 0:
        return np.zeros_like(q, dtype=np.float64)
    group = hq // hkv
    kq = np.repeat(k, group, axis=1)  # [L, Hq, D]: query head h reads kv head h // group
    vq = np.repeat(v, group, axis=1)
    s = np.einsum("hd,lhd->hl", q, kq) * scale
    s -= s.max(axis=1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("hl,lhd->hd", p, vq)


def paged_attention_decode(
    q: npt.NDArray,
    k_cache: npt.NDArray,
    v_cache: npt.NDArray,
    block_tables: npt.NDArray,
    seq_lens: npt.NDArray,
    dtype: str,
    scale: float | None = None,
) -> npt.NDArray[np.float64]:
    """Decode attention through block tables, in float64: q [S, Hq, D] -> [S, Hq, D]."""
    q64 = to_float64(q, dtype)
    if scale is None:
        scale = 1.0 / np.sqrt(q64.shape[-1])
    out = np.zeros(q64.shape, dtype=np.float64)
    for i, n in enumerate(np.asarray(seq_lens)):
        k = to_float64(gather_kv(k_cache, block_tables[i], int(n)), dtype)
        v = to_float64(gather_kv(v_cache, block_tables[i], int(n)), dtype)
        out[i] = attention_decode(q64[i], k, v, scale)
    return out


def attention_prefill(
    q: npt.NDArray[np.float64],
    k: npt.NDArray[np.float64],
    v: npt.NDArray[np.float64],
    scale: float,
    causal: bool = True,
) -> npt.NDArray[np.float64]:
    """One sequence, contiguous: q [T, Hq, D] are the last T of the L context tokens in
    k/v [L, Hkv, D]; with `causal` query t sees keys 0 .. L - T + t. -> [T, Hq, D] (float64)."""
    t_len, hq = q.shape[:2]
    n = k.shape[0]
    out = np.zeros(q.shape, dtype=np.float64)
    if n == 0 or t_len == 0:
        return out
    group = hq // k.shape[1]
    kq = np.repeat(k, group, axis=1)
    vq = np.repeat(v, group, axis=1)
    s = np.einsum("thd,lhd->htl", q, kq) * scale  # [Hq, T, L]
    if causal:
        limit = n - t_len + np.arange(t_len)  # last key each query sees
        s = np.where(np.arange(n)[None, :] <= limit[:, None], s, -np.inf)
    s -= s.max(axis=2, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=2, keepdims=True)
    return np.einsum("htl,lhd->thd", p, vq)


def paged_attention_prefill(
    q: npt.NDArray,
    k_cache: npt.NDArray,
    v_cache: npt.NDArray,
    qo_indptr: npt.NDArray,
    block_tables: npt.NDArray,
    seq_lens: npt.NDArray,
    dtype: str,
    scale: float | None = None,
    causal: bool = True,
) -> npt.NDArray[np.float64]:
    """Prefill (extend) attention through block tables, in float64: sequence i's queries are
    q[qo_indptr[i]:qo_indptr[i+1]], the last tokens of its seq_lens[i] cached tokens.
    q [total_q, Hq, D] -> [total_q, Hq, D]."""
    q64 = to_float64(q, dtype)
    if scale is None:
        scale = 1.0 / np.sqrt(q64.shape[-1])
    out = np.zeros(q64.shape, dtype=np.float64)
    indptr = np.asarray(qo_indptr, dtype=np.int64)
    for i, n in enumerate(np.asarray(seq_lens)):
        a, b = indptr[i], indptr[i + 1]
        k = to_float64(gather_kv(k_cache, block_tables[i], int(n)), dtype)
        v = to_float64(gather_kv(v_cache, block_tables[i], int(n)), dtype)
        out[a:b] = attention_prefill(q64[a:b], k, v, scale, causal)
    return out


def append_kv(
    k: npt.NDArray,
    v: npt.NDArray,
    k_cache: npt.NDArray,
    v_cache: npt.NDArray,
    slot_mapping: npt.NDArray,
) -> None:
    """Write token i's K/V rows ([T, Hkv, D]) into slot_mapping[i]; slot -1 (or past the
    pool) is skipped. In place, byte-exact."""
    num_blocks, block_size = k_cache.shape[:2]
    slots = np.asarray(slot_mapping, dtype=np.int64)
    keep = (slots >= 0) & (slots < num_blocks * block_size)
    blk, off = np.divmod(slots[keep], block_size)
    k_cache[blk, off] = np.asarray(k)[keep]
    v_cache[blk, off] = np.asarray(v)[keep]


def copy_blocks(caches: list[npt.NDArray], pairs: npt.NDArray) -> None:
    """For every (src, dst) pair, copy block src onto block dst in every given cache view."""
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    for cache in caches:
        cache[pairs[:, 1]] = cache[pairs[:, 0]]
