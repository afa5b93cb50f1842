"""NumPy float64 reference of the kvpool kernels.

Used by the tests as the ground truth for the CUDA kernels, and by the host backend
(``Pool(device="host")``), so the kernel API works without a GPU, slowly. Caches are the
per-layer views of a pool, ``[num_blocks, block_size, num_kv_heads, head_dim]``; bfloat16
data is carried as uint16 bit patterns and float8 (e4m3fn, e5m2) as uint8 codes (NumPy has
neither). An fp8 cache holds quantize(x / scale); its reference value is dequantize(code) * scale.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

NULL_SLOT = -1


FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


class Fp8Format:
    """One fp8 format: exponent bias, mantissa bits, largest finite code and value."""

    def __init__(self, bias: int, mant_bits: int, max_code: int, max_value: float) -> None:
        self.bias, self.mant_bits, self.max_code, self.max_value = (
            bias,
            mant_bits,
            max_code,
            max_value,
        )


FP8 = {
    "float8_e4m3fn": Fp8Format(7, 3, 0x7E, 448.0),  # no inf; NaN = 0x7f / 0xff
    "float8_e5m2": Fp8Format(15, 2, 0x7B, 57344.0),  # IEEE-like; 0x7c inf, 0x7d..0x7f NaN
}


def quantize_fp8(x: npt.NDArray, dtype: str) -> npt.NDArray[np.uint8]:
    """float32 values -> fp8 codes (uint8): round to nearest even, saturating to the largest
    finite value (infinities too), NaN -> 0x7f with its sign. Bit for bit what append_kv's
    kernel computes (the same integer algorithm on the float32 bits)."""
    f = FP8[dtype]
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    sign = ((b >> 24) & 0x80).astype(np.uint32)
    mag = b & np.uint32(0x7FFFFFFF)
    a = mag.view(np.float32)
    min_normal_exp = 1 - f.bias
    # Subnormal range of the target (a < 2^min_normal_exp): a multiple of the smallest
    # subnormal, rounded to nearest even by rint (exact: a power-of-two scaling).
    quantum = np.float32(2.0 ** (min_normal_exp - f.mant_bits))
    with np.errstate(over="ignore", invalid="ignore"):
        sub = np.rint(a / quantum).astype(np.float64)
    sub = np.where(np.isfinite(sub), np.minimum(sub, 1 << 20), 0).astype(np.uint32)
    # Normal range: drop 23 - mant_bits mantissa bits with round-to-nearest-even, then rebias.
    drop = 23 - f.mant_bits
    lsb = (mag >> drop) & 1
    rounded = (mag.astype(np.uint64) + ((1 << (drop - 1)) - 1) + lsb) >> drop
    normal = rounded.astype(np.int64) - ((127 - f.bias) << f.mant_bits)
    normal = np.minimum(normal, f.max_code).astype(np.uint32)
    exp = (mag >> 23).astype(np.int64) - 127
    code = np.where(exp < min_normal_exp, sub, normal)
    code = np.where(a >= np.float32(f.max_value), f.max_code, code)
    code = np.where(np.isnan(a), 0x7F, code)
    return (code | sign).astype(np.uint8)


def dequantize_fp8(codes: npt.NDArray, dtype: str) -> npt.NDArray[np.float64]:
    """fp8 codes (uint8) -> float64 (NaN codes -> NaN; e5m2's 0x7c -> inf)."""
    f = FP8[dtype]
    c = np.asarray(codes).view(np.uint8).astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> f.mant_bits) & ((1 << (7 - f.mant_bits)) - 1)
    m = (c & ((1 << f.mant_bits) - 1)).astype(np.float64)
    scale_m = 2.0**f.mant_bits
    val = np.where(
        e == 0, m / scale_m * 2.0 ** (1 - f.bias), (1 + m / scale_m) * 2.0 ** (e - f.bias)
    )
    top = (1 << (7 - f.mant_bits)) - 1  # the all-ones exponent
    if dtype == "float8_e5m2":
        val = np.where(e == top, np.where(m == 0, np.inf, np.nan), val)
    else:
        val = np.where((c & 0x7F) == 0x7F, np.nan, val)
    return sign * val


def to_float64(x: npt.NDArray, dtype: str) -> npt.NDArray[np.float64]:
    """Elements of the pool's dtype (float16, bfloat16 as uint16 bits, fp8 as uint8 codes) as
    float64 (fp8: the unscaled code values)."""
    if dtype in FP8:
        return dequantize_fp8(x, dtype)
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


def gather_kv(cache: npt.NDArray, block_table: npt.NDArray, seq_len: int) -> npt.NDArray:
    """The first `seq_len` tokens of one sequence as a contiguous [seq_len, kv_heads, dim]."""
    block_size = cache.shape[1]
    n = -(-seq_len // block_size)
    blocks = cache[np.asarray(block_table[:n], dtype=np.int64)]
    return blocks.reshape(n * block_size, *cache.shape[2:])[:seq_len]


def key_start(
    position: npt.ArrayLike, window: int | None = None, chunk: int | None = None
) -> npt.NDArray[np.int64]:
    """The first key position a query at `position` sees (its last is `position` itself).

    Sliding window `window` = w (transformers' ``sliding_window`` of gpt-oss and Gemma 3:
    ``kv_idx > q_idx - sliding_window``): the keys in (p - w, p], w keys with the query's own;
    FlashInfer's ``window_left`` is w - 1. Chunked local `chunk` = c (Llama 4's
    ``attention_chunk_size``: ``kv_idx // c == q_idx // c``): the keys in [floor(p / c) * c, p].
    Neither: 0 (full causal attention). At most one of them."""
    p = np.asarray(position, dtype=np.int64)
    if window is not None and chunk is not None:
        raise ValueError("a layer has a sliding window or a chunk, not both")
    if window is not None:
        return np.maximum(p - int(window) + 1, 0)
    if chunk is not None:
        return p // int(chunk) * int(chunk)
    return np.zeros_like(p)


def gather_kv_range(
    cache: npt.NDArray, block_table: npt.NDArray, first_page: int, begin: int, end: int
) -> npt.NDArray:
    """Tokens at positions begin .. end - 1 of one sequence as a contiguous [end - begin,
    kv_heads, dim], through a window-relative table row: position p is at offset
    p % block_size of page block_table[p // block_size - first_page] (first_page 0: a full
    table). Only the pages holding those tokens are read."""
    block_size = cache.shape[1]
    if end <= begin:
        return cache[:0, 0].reshape(0, *cache.shape[2:])
    pos = np.arange(begin, end, dtype=np.int64)
    idx = pos // block_size - int(first_page)
    if idx[0] < 0 or idx[-1] >= len(block_table):
        raise ValueError(
            f"positions {begin}..{end - 1} need table entries {idx[0]}..{idx[-1]}, the row "
            f"holds 0..{len(block_table) - 1} (first_page {first_page})"
        )
    pages = np.asarray(block_table, dtype=np.int64)[idx]
    return cache[pages, pos % block_size]


def attention_decode(
    q: npt.NDArray[np.float64],
    k: npt.NDArray[np.float64],
    v: npt.NDArray[np.float64],
    scale: float,
    *,
    sinks: npt.ArrayLike | None = None,
) -> npt.NDArray[np.float64]:
    """One sequence, contiguous: q [Hq, D], k/v [L, Hkv, D] -> [Hq, D] (float64, GQA). The
    query sees every key given (a window is applied by giving only its keys). `sinks` ([Hq]
    logits, gpt-oss): one extra logit per head in the softmax's denominator only (see
    attention_prefill)."""
    if sinks is not None:
        return attention_prefill(q[None], k, v, scale, causal=False, sinks=sinks)[0]
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


def _kv_scales(
    kv_scales: tuple[npt.ArrayLike, npt.ArrayLike] | None, hkv: int
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    if kv_scales is None:
        return np.ones(hkv), np.ones(hkv)
    ks, vs = (np.broadcast_to(np.asarray(x, dtype=np.float64), (hkv,)) for x in kv_scales)
    return ks, vs


def _first_pages(first_page: npt.ArrayLike | None, num_seqs: int) -> npt.NDArray[np.int64]:
    if first_page is None:
        return np.zeros(num_seqs, np.int64)
    fp = np.asarray(first_page, dtype=np.int64).reshape(-1)
    if fp.shape[0] != num_seqs:
        raise ValueError(f"first_page has {fp.shape[0]} entries for {num_seqs} sequences")
    return fp


def paged_attention_decode(
    q: npt.NDArray,
    k_cache: npt.NDArray,
    v_cache: npt.NDArray,
    block_tables: npt.NDArray,
    seq_lens: npt.NDArray,
    dtype: str,
    scale: float | None = None,
    *,
    q_dtype: str | None = None,
    kv_scales: tuple[npt.ArrayLike, npt.ArrayLike] | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: npt.ArrayLike | None = None,
    first_page: npt.ArrayLike | None = None,
) -> npt.NDArray[np.float64]:
    """Decode attention through block tables, in float64: q [S, Hq, D] -> [S, Hq, D].
    `dtype` is the cache's; q is in `q_dtype` (default: the cache's). kv_scales (an fp8 cache's
    k and v scales of this layer: scalars or [num_kv_heads]) multiply the dequantized K and V.

    The query of sequence i is at position seq_lens[i] - 1 and sees the keys from
    key_start(position, window, chunk) on (a sliding window or a chunk; see key_start); only
    their pages are read. first_page ([S], default 0): table row i's entry 0 is the sequence's
    page first_page[i] (a window group's table holds only its live pages). sinks ([Hq] float
    logits): per-head attention sinks, in the denominator only (attention_prefill)."""
    q64 = to_float64(q, q_dtype or dtype)
    if scale is None:
        scale = 1.0 / np.sqrt(q64.shape[-1])
    ks, vs = _kv_scales(kv_scales, k_cache.shape[2])
    lens = np.asarray(seq_lens, dtype=np.int64)
    fps = _first_pages(first_page, len(lens))
    out = np.zeros(q64.shape, dtype=np.float64)
    for i, n in enumerate(lens):
        n = int(n)
        lo = int(key_start(n - 1, window, chunk)) if n else 0
        k = gather_kv_range(k_cache, block_tables[i], int(fps[i]), lo, n)
        v = gather_kv_range(v_cache, block_tables[i], int(fps[i]), lo, n)
        k = to_float64(k, dtype) * ks[:, None]
        v = to_float64(v, dtype) * vs[:, None]
        out[i] = attention_decode(q64[i], k, v, scale, sinks=sinks)
    return out


def attention_prefill(
    q: npt.NDArray[np.float64],
    k: npt.NDArray[np.float64],
    v: npt.NDArray[np.float64],
    scale: float,
    causal: bool = True,
    *,
    window: int | None = None,
    chunk: int | None = None,
    sinks: npt.ArrayLike | None = None,
    k_start: int = 0,
) -> npt.NDArray[np.float64]:
    """One sequence, contiguous: q [T, Hq, D] are the last T of the L context tokens; k/v
    [L - k_start, Hkv, D] hold the keys at positions k_start .. L - 1 (k_start > 0: the
    earlier keys, which no query sees, are left out). With `causal` query t (position
    L - T + t) sees keys up to its own position, from key_start(position, window, chunk) on
    (window and chunk need causal). -> [T, Hq, D] (float64).

    `sinks` ([Hq] logits, gpt-oss's per-head learned sink s_h): the softmax of head h gets one
    more logit s_h that joins its denominator only,
    out = sum_j exp(l_j - m) v_j / (exp(s_h - m) + sum_j exp(l_j - m)), m = max(s_h, l_j)."""
    t_len, hq = q.shape[:2]
    n = k.shape[0] + int(k_start)
    out = np.zeros(q.shape, dtype=np.float64)
    if (window is not None or chunk is not None) and not causal:
        raise ValueError("a sliding window or a chunk needs causal attention")
    if k.shape[0] == 0 or t_len == 0:
        return out
    group = hq // k.shape[1]
    kq = np.repeat(k, group, axis=1)
    vq = np.repeat(v, group, axis=1)
    s = np.einsum("thd,lhd->htl", q, kq) * scale  # [Hq, T, L - k_start]
    if causal:
        pos = n - t_len + np.arange(t_len)  # each query's position: the last key it sees
        keys = int(k_start) + np.arange(k.shape[0])
        lo = key_start(pos, window, chunk)
        visible = (keys[None, :] <= pos[:, None]) & (keys[None, :] >= lo[:, None])
        if int(k_start) > 0 and (lo < int(k_start)).any():
            raise ValueError(f"k_start {k_start} leaves out keys a query sees")
        s = np.where(visible, s, -np.inf)
    if sinks is not None:
        sk = np.asarray(sinks, dtype=np.float64).reshape(hq)
        s = np.concatenate([s, np.broadcast_to(sk[:, None, None], (hq, t_len, 1))], axis=2)
    s -= s.max(axis=2, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=2, keepdims=True)
    if sinks is not None:
        p = p[:, :, :-1]  # the sink's share of the probability goes to no value
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
    q_dtype: str | None = None,
    kv_scales: tuple[npt.ArrayLike, npt.ArrayLike] | None = None,
    *,
    window: int | None = None,
    chunk: int | None = None,
    sinks: npt.ArrayLike | None = None,
    first_page: npt.ArrayLike | None = None,
) -> npt.NDArray[np.float64]:
    """Prefill (extend) attention through block tables, in float64: sequence i's queries are
    q[qo_indptr[i]:qo_indptr[i+1]], the last tokens of its seq_lens[i] cached tokens.
    q [total_q, Hq, D] -> [total_q, Hq, D]. `dtype` is the cache's; q is in `q_dtype` (default:
    the cache's); kv_scales (an fp8 cache's K and V scales, scalars or per KV head) multiply the
    cached values, so the result is attention over the dequantized cache. window, chunk,
    sinks and first_page as in paged_attention_decode (only the keys from the first query's
    key_start on are read)."""
    q64 = to_float64(q, q_dtype or dtype)
    ks, vs = _kv_scales(kv_scales, k_cache.shape[2])
    if scale is None:
        scale = 1.0 / np.sqrt(q64.shape[-1])
    out = np.zeros(q64.shape, dtype=np.float64)
    indptr = np.asarray(qo_indptr, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    fps = _first_pages(first_page, len(lens))
    for i, n in enumerate(lens):
        a, b, n = int(indptr[i]), int(indptr[i + 1]), int(n)
        lo = int(key_start(n - (b - a), window, chunk)) if causal and b > a else 0
        k = gather_kv_range(k_cache, block_tables[i], int(fps[i]), lo, n)
        v = gather_kv_range(v_cache, block_tables[i], int(fps[i]), lo, n)
        k = to_float64(k, dtype) * ks[None, :, None]
        v = to_float64(v, dtype) * vs[None, :, None]
        out[a:b] = attention_prefill(
            q64[a:b], k, v, scale, causal, window=window, chunk=chunk, sinks=sinks, k_start=lo
        )
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


def quantize_kv(
    x: npt.NDArray, in_dtype: str, scale: npt.ArrayLike, dtype: str
) -> npt.NDArray[np.uint8]:
    """K or V rows [T, Hkv, D] (float16, or bfloat16 bits) -> fp8 codes of x / scale, as
    append_kv writes them: the division in float32 (IEEE, round to nearest), then
    quantize_fp8. scale: a scalar or [Hkv] float32."""
    x32 = to_float64(x, in_dtype).astype(np.float32)
    s32 = np.asarray(scale, dtype=np.float32).reshape(-1)
    s32 = np.broadcast_to(s32, (x32.shape[1],))[None, :, None]
    return quantize_fp8(x32 / s32, dtype)


def copy_blocks(caches: list[npt.NDArray], pairs: npt.NDArray) -> None:
    """For every (src, dst) pair, copy block src onto block dst in every given cache view."""
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    for cache in caches:
        cache[pairs[:, 1]] = cache[pairs[:, 0]]


def paged_metadata(
    block_table: npt.NDArray,
    seq_lens: npt.NDArray,
    block_size: int,
    qo_indptr: npt.NDArray | None = None,
    num_slots: int = 0,
    num_indices: int | None = None,
) -> tuple[
    npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]
]:
    """What the paged_metadata kernel writes, from block_table (int32 [num_seqs, width]) and
    seq_lens (tokens per sequence, including the step's): (slot_mapping int64 [num_slots],
    indptr int32 [num_seqs + 1], indices int32 [num_indices], last_page_len int32 [num_seqs]).

    The slot mapping covers a packed step whose sequence s owns tokens qo_indptr[s] ..
    qo_indptr[s + 1] - 1, the last positions of the sequence; -1 past the step's tokens or
    past the table row. The CSR is FlashInfer's page table: ceil(seq_len / block_size) pages
    per sequence (at most width), indices -1 past indptr[-1] (num_indices defaults to
    num_seqs * width, the most any table can need)."""
    table = np.asarray(block_table, np.int64)
    lens = np.asarray(seq_lens, np.int64)
    num_seqs, width = table.shape
    pages = np.minimum(-(-np.maximum(lens, 0) // block_size), width)
    indptr = np.zeros(num_seqs + 1, np.int32)
    indptr[1:] = np.cumsum(pages)
    n_idx = num_seqs * width if num_indices is None else num_indices
    indices = np.full(n_idx, -1, np.int32)
    for s in range(num_seqs):
        indices[indptr[s] : indptr[s + 1]] = table[s, : pages[s]][: max(0, n_idx - indptr[s])]
    last = np.where(pages > 0, np.minimum(lens - (pages - 1) * block_size, block_size), 0)
    slots = np.full(num_slots, NULL_SLOT, np.int64)
    if qo_indptr is not None:
        ptr = np.asarray(qo_indptr, np.int64)
        for s in range(num_seqs):
            n = ptr[s + 1] - ptr[s]
            pos = np.arange(lens[s] - n, lens[s])
            page = np.where(pos >= 0, pos // block_size, width)
            ok = page < width
            vals = np.full(n, NULL_SLOT, np.int64)
            vals[ok] = table[s, page[ok]] * block_size + pos[ok] % block_size
            dst = np.arange(ptr[s], ptr[s + 1])
            keep = (dst >= 0) & (dst < num_slots)
            slots[dst[keep]] = vals[keep]
    return slots, indptr, indices, last.astype(np.int32)


def _f64(x: npt.NDArray, dtype: str) -> npt.NDArray[np.float64]:
    """Elements of `dtype` as float64 ("float64": taken as they are)."""
    return np.asarray(x, np.float64) if dtype == "float64" else to_float64(x, dtype)


def _latent_f64(cache: npt.NDArray, dtype: str, kv_scale: float) -> npt.NDArray[np.float64]:
    """An MLA latent cache as float64: fp8 codes dequantized and times the layer's scale."""
    if dtype in FP8:
        return dequantize_fp8(cache, dtype) * float(np.float32(kv_scale))
    return _f64(cache, dtype)


def mla_decode_reference(
    q_nope: npt.NDArray,
    q_pe: npt.NDArray,
    latent_cache: npt.NDArray,
    page_tables: npt.NDArray,
    seq_lens: npt.ArrayLike,
    scale: float,
    dtype: str = "float64",
    latent_dim: int = 512,
    *,
    kv_dtype: str | None = None,
    kv_scale: float = 1.0,
) -> npt.NDArray[np.float64]:
    """MLA decode with absorbed projections (DeepSeek-V3; FlashMLA's and FlashInfer's
    BatchMLAPagedAttentionWrapper's semantics), in float64.

    q_nope [num_seqs, H, latent_dim] (the query already multiplied into the latent space),
    q_pe [num_seqs, H, rope_dim]; latent_cache [num_pages, block_size, latent_dim + rope_dim]:
    one layer's latent rows, c_kv then k_pe per token; page_tables [num_seqs, >= pages] page
    ids; seq_lens [num_seqs]. Elements of `dtype` (bfloat16 as uint16 bits; "float64": taken as
    they are). The cache may hold another type, `kv_dtype` (default `dtype`): an fp8 cache
    (uint8 codes) is dequantized, code value * kv_scale (its layer's scale). Per head: logits =
    (q_nope . c_kv + q_pe . k_pe) * scale over the sequence's tokens, out = softmax(logits) @
    c_kv, [num_seqs, H, latent_dim]; an empty sequence gives zeros."""
    qn, qp = _f64(q_nope, dtype), _f64(q_pe, dtype)
    cache = _latent_f64(latent_cache, kv_dtype or dtype, kv_scale)
    lens = np.asarray(seq_lens, dtype=np.int64)
    out = np.zeros(qn.shape, dtype=np.float64)
    for i, n in enumerate(lens):
        if n <= 0:
            continue
        rows = gather_kv(cache, np.asarray(page_tables[i]), int(n))  # [n, latent + rope]
        c_kv, k_pe = rows[:, :latent_dim], rows[:, latent_dim:]
        logits = (qn[i] @ c_kv.T + qp[i] @ k_pe.T) * scale  # [H, n]
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        out[i] = p @ c_kv
    return out


def mla_extend_reference(
    q_nope: npt.NDArray,
    q_pe: npt.NDArray,
    latent_cache: npt.NDArray,
    page_tables: npt.NDArray,
    kv_lens: npt.ArrayLike,
    qo_indptr: npt.ArrayLike,
    scale: float,
    dtype: str = "float64",
    latent_dim: int = 512,
    *,
    kv_dtype: str | None = None,
    kv_scale: float = 1.0,
) -> npt.NDArray[np.float64]:
    """MLA extend (prefill over the latent cache, qo_len >= 1 query tokens per sequence) with
    absorbed projections, causal, in float64.

    q_nope [total_q, H, latent_dim], q_pe [total_q, H, rope_dim]: sequence i's query tokens at
    rows qo_indptr[i] .. qo_indptr[i + 1] - 1, the LAST qo_len of its kv_lens[i] cached tokens
    (their latents already written); query j of sequence i sees keys 0 .. kv_lens[i] - qo_len
    + j. latent_cache, page_tables, `dtype`, `kv_dtype` and `kv_scale` as for
    mla_decode_reference. Per (query, head):
    logits = (q_nope . c_kv + q_pe . k_pe) * scale over its keys, out = softmax(logits) @ c_kv,
    [total_q, H, latent_dim]; a query that sees no key gives zeros."""
    qn, qp = _f64(q_nope, dtype), _f64(q_pe, dtype)
    cache = _latent_f64(latent_cache, kv_dtype or dtype, kv_scale)
    lens = np.asarray(kv_lens, dtype=np.int64)
    indptr = np.asarray(qo_indptr, dtype=np.int64)
    out = np.zeros(qn.shape, dtype=np.float64)
    for i, n in enumerate(lens):
        q_len = int(indptr[i + 1] - indptr[i])
        if n <= 0 or q_len == 0:
            continue
        rows = gather_kv(cache, np.asarray(page_tables[i]), int(n))  # [n, latent + rope]
        c_kv = np.ascontiguousarray(rows[:, :latent_dim])
        first = int(indptr[i])
        q = np.concatenate([qn[first : first + q_len], qp[first : first + q_len]], axis=2)
        # Queries in chunks of at most ~2**24 logits: [chunk, H, n] at a time.
        step = max(1, (1 << 24) // max(1, q.shape[1] * int(n)))
        for j0 in range(0, q_len, step):
            j = np.arange(j0, min(j0 + step, q_len))
            limit = int(n) - q_len + j + 1  # keys each query sees
            logits = (q[j] @ rows.T) * scale  # [chunk, H, n]
            seen = np.arange(int(n))[None, None, :] < limit[:, None, None]
            logits = np.where(seen, logits, -np.inf)
            top = logits.max(axis=2, keepdims=True)
            p = np.where(seen, np.exp(logits - np.where(np.isfinite(top), top, 0.0)), 0.0)
            total = p.sum(axis=2, keepdims=True)
            res = (p @ c_kv) / np.where(total > 0, total, 1.0)
            out[first + j] = np.where(limit[:, None, None] > 0, res, 0.0)
    return out
