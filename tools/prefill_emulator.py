"""Lane-level NumPy emulation of cuda/paged_prefill.cu (all CTAs of a small launch, one split
or several plus the merge), with the mma / ldmatrix register layouts of the PTX ISA, so the
kernel's index, swizzle, fragment and mask arithmetic can be checked on a machine without a GPU.
Run: python tools/prefill_emulator.py (prints the relative error per case; < 1e-3 passes).
"""

import numpy as np

LANES = np.arange(32)
GID, TIG = LANES // 4, LANES % 4
MI, MR = LANES >> 3, LANES & 7


def ldsm(smem, addrs, trans):
    """ldmatrix .x4: addrs = byte address per lane (lane 8i+r: row r of matrix i) -> [4][32][2]."""
    out = np.zeros((4, 32, 2))
    for i in range(4):
        mat = np.stack([smem[addrs[8 * i + r] // 2 : addrs[8 * i + r] // 2 + 8] for r in range(8)])
        if not trans:
            out[i, :, 0] = mat[GID, 2 * TIG]
            out[i, :, 1] = mat[GID, 2 * TIG + 1]
        else:
            out[i, :, 0] = mat[2 * TIG, GID]
            out[i, :, 1] = mat[2 * TIG + 1, GID]
    return out


def mma(c, a, b):
    """c [32][4] += A (from a [4][32][2]) * B (from b [2][32][2]), m16n8k16 layouts."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    A[GID[:, None], 2 * TIG[:, None] + [0, 1]] = a[0]
    A[GID[:, None] + 8, 2 * TIG[:, None] + [0, 1]] = a[1]
    A[GID[:, None], 2 * TIG[:, None] + [8, 9]] = a[2]
    A[GID[:, None] + 8, 2 * TIG[:, None] + [8, 9]] = a[3]
    B[2 * TIG[:, None] + [0, 1], GID[:, None]] = b[0]
    B[2 * TIG[:, None] + [8, 9], GID[:, None]] = b[1]
    D = A @ B
    c[:, 0] += D[GID, 2 * TIG]
    c[:, 1] += D[GID, 2 * TIG + 1]
    c[:, 2] += D[GID + 8, 2 * TIG]
    c[:, 3] += D[GID + 8, 2 * TIG + 1]


def h16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


def cta(
    D,
    BS,
    BN,
    NW,
    q,
    Kc,
    Vc,
    table,
    seq_len,
    qo_begin,
    qo_len,
    qt0,
    kvh,
    qh0,
    gh,
    q_tile_tokens,
    causal,
    split,
    num_splits,
    scale_log2,
):
    """One CTA; returns {(token, head): (o row normalised, lse2)} for its valid rows."""
    ROWB = 2 * D
    CH = D // 8
    nthreads = 32 * NW
    rpi = nthreads // CH
    mrows = 16 * NW
    swz = lambda row, chunk: row * ROWB + ((chunk ^ (row & 7)) << 4)
    prefix = max(seq_len - qo_len, 0)
    q_tokens = min(q_tile_tokens, qo_len - qt0)
    kv_total = min(seq_len, prefix + qt0 + q_tokens) if causal else seq_len
    n_all = -(-kv_total // BN)
    tps = -(-n_all // num_splits)
    kv_begin = split * tps * BN
    kv_end = min(kv_total, kv_begin + tps * BN)
    n_tiles = -(-(kv_end - kv_begin) // BN) if kv_end > kv_begin else 0
    kv_nomask = min(kv_end, prefix + qt0 + 1) if causal else kv_end
    sq = np.zeros(mrows * D)
    for tid in range(nthreads):
        chunk = tid % CH
        for i in range(mrows // rpi):
            row = i * rpi + tid // CH
            t = row // gh
            ok = row < q_tile_tokens * gh and t < q_tokens
            dst = swz(row, chunk) // 2
            sq[dst : dst + 8] = (
                q[qo_begin + qt0 + t, qh0 + row % gh, chunk * 8 : chunk * 8 + 8] if ok else 0
            )
    res = {}
    for warp in range(NW):
        q_row = warp * 16 + MR + ((MI & 1) << 3)
        q_cadd = MI >> 1
        k_row = MR + ((MI >> 1) << 3)
        k_cadd = MI & 1
        v_row = MR + ((MI & 1) << 3)
        v_cadd = MI >> 1
        qa = [ldsm(sq, swz(q_row, 2 * kk + q_cadd), False) for kk in range(D // 16)]
        lim = []
        for h in range(2):
            t = (warp * 16 + GID + 8 * h) // gh
            lim.append(np.minimum(kv_end, prefix + qt0 + t + 1) if causal else np.full(32, kv_end))
        m = np.full((2, 32), -np.inf)
        l = np.zeros((2, 32))
        o = np.zeros((D // 8, 32, 4))
        for j in range(n_tiles):
            t0 = kv_begin + j * BN
            sk = np.zeros(BN * D)
            sv = np.zeros(BN * D)
            for tid in range(nthreads):
                chunk = tid % CH
                for i in range(BN // rpi):
                    row = i * rpi + tid // CH
                    t = t0 + row
                    dst = swz(row, chunk) // 2
                    if t < kv_end and 0 <= table[t // BS] < Kc.shape[0]:
                        sk[dst : dst + 8] = Kc[
                            table[t // BS], t % BS, kvh, chunk * 8 : chunk * 8 + 8
                        ]
                        sv[dst : dst + 8] = Vc[
                            table[t // BS], t % BS, kvh, chunk * 8 : chunk * 8 + 8
                        ]
            s = np.zeros((BN // 8, 32, 4))
            for kk in range(D // 16):
                for np_ in range(BN // 16):
                    kb = ldsm(sk, swz(np_ * 16 + k_row, 2 * kk + k_cadd), False)
                    mma(s[2 * np_], qa[kk], kb[0:2])
                    mma(s[2 * np_ + 1], qa[kk], kb[2:4])
            masked = t0 + BN > kv_nomask
            for h in range(2):
                x = s[:, :, 2 * h : 2 * h + 2] * scale_log2  # [nt][lane][e]
                key = (
                    t0
                    + np.arange(BN // 8)[:, None, None] * 8
                    + 2 * TIG[None, :, None]
                    + np.arange(2)
                )
                if masked:
                    x = np.where(key >= lim[h][None, :, None], -np.inf, x)
                mx = np.maximum(m[h], x.max(axis=(0, 2)))
                mx = np.maximum(mx, mx[LANES ^ 1])
                mx = np.maximum(mx, mx[LANES ^ 2])
                base = np.where(mx == -np.inf, 0.0, mx)
                alpha = np.exp2(m[h] - base)
                m[h] = mx
                p = np.exp2(x - base[None, :, None])
                s[:, :, 2 * h : 2 * h + 2] = p
                l[h] = l[h] * alpha + p.sum(axis=(0, 2))
                o[:, :, 2 * h : 2 * h + 2] *= alpha[None, :, None]
            for kt in range(BN // 16):
                a = np.stack(
                    [
                        h16(s[2 * kt][:, 0:2]),
                        h16(s[2 * kt][:, 2:4]),
                        h16(s[2 * kt + 1][:, 0:2]),
                        h16(s[2 * kt + 1][:, 2:4]),
                    ]
                )
                for dp in range(D // 16):
                    vb = ldsm(sv, swz(kt * 16 + v_row, 2 * dp + v_cadd), True)
                    mma(o[2 * dp], a, vb[0:2])
                    mma(o[2 * dp + 1], a, vb[2:4])
        for h in range(2):
            lsum = l[h] + l[h][LANES ^ 1]
            lsum = lsum + lsum[LANES ^ 2]
            for lane in range(32):
                row = warp * 16 + GID[lane] + 8 * h
                t = row // gh
                if row >= q_tile_tokens * gh or t >= q_tokens:
                    continue
                key = (qo_begin + qt0 + t, qh0 + row % gh)
                inv = 1 / lsum[lane] if lsum[lane] > 0 else 0.0
                orow, _ = res.setdefault(key, (np.zeros(D), None))
                for n in range(D // 8):
                    orow[8 * n + 2 * TIG[lane] : 8 * n + 2 * TIG[lane] + 2] = (
                        o[n, lane, 2 * h : 2 * h + 2] * inv
                    )
                lse = m[h][lane] + np.log2(lsum[lane]) if lsum[lane] > 0 else -np.inf
                res[key] = (orow, lse)
    return res


def launch(D, BS, q, Kc, Vc, indptr, tables, lens, group, causal, num_splits, rows=64, BN=64):
    """Every CTA of the plan the glue would make (all tiles; splits merged as the merge kernel)."""
    gh = max(d for d in range(1, min(group, rows) + 1) if group % d == 0)
    qtile = rows // gh
    hkv = Kc.shape[2]
    total_q, hq = q.shape[:2]
    scale_log2 = 1 / np.sqrt(D) * 1.4426950408889634
    parts = [{} for _ in range(num_splits)]
    for seq in range(len(lens)):
        qo_len = indptr[seq + 1] - indptr[seq]
        for qt0 in range(0, qo_len, qtile):
            for y in range(hkv * (group // gh)):
                kvh, ht = divmod(y, group // gh)
                for sp in range(num_splits):
                    parts[sp].update(
                        cta(
                            D,
                            BS,
                            BN,
                            rows // 16,
                            q,
                            Kc,
                            Vc,
                            tables[seq],
                            lens[seq],
                            indptr[seq],
                            qo_len,
                            qt0,
                            kvh,
                            kvh * group + ht * gh,
                            gh,
                            qtile,
                            causal,
                            sp,
                            num_splits,
                            scale_log2,
                        )
                    )
    out = np.zeros((total_q, hq, D))
    for (tok, h), _ in parts[0].items():
        lses = np.array([p[(tok, h)][1] for p in parts])
        M = lses.max()
        if -np.inf == M:
            continue
        w = np.exp2(lses - M)
        out[tok, h] = sum(wi * p[(tok, h)][0] for wi, p in zip(w, parts)) / w.sum()
    return out


def reference(q, Kc, Vc, indptr, tables, lens, BS, causal):
    total_q, hq, D = q.shape
    group = hq // Kc.shape[2]
    out = np.zeros_like(q)
    for i, n in enumerate(lens):
        a, b = indptr[i], indptr[i + 1]
        toks = np.arange(n)
        K = Kc[tables[i][toks // BS], toks % BS].repeat(group, axis=1)  # [L, Hq, D]
        V = Vc[tables[i][toks // BS], toks % BS].repeat(group, axis=1)
        S = np.einsum("thd,lhd->htl", q[a:b], K) / np.sqrt(D)
        if causal:
            S = np.where(
                toks[None, None, :] <= (n - (b - a) + np.arange(b - a))[None, :, None], S, -np.inf
            )
        P = np.exp(S - S.max(axis=2, keepdims=True))
        P /= P.sum(axis=2, keepdims=True)
        out[a:b] = np.einsum("htl,lhd->thd", P, V)
    return out


def main():
    rng = np.random.default_rng(0)
    cases = [  # D, BS, hq, hkv, qo_lens, seq_lens, causal, splits
        (64, 16, 4, 1, [5, 1, 70], [5, 40, 130], True, 1),
        (64, 8, 6, 2, [3, 20], [100, 20], True, 3),
        (128, 32, 2, 2, [65], [200], True, 2),
        (64, 4, 3, 3, [9, 2], [9, 80], False, 1),
        (256, 16, 2, 1, [7], [50], True, 2),
    ]
    for D, BS, hq, hkv, qo, lens, causal, splits in cases:
        lens = np.array(lens)
        indptr = np.concatenate([[0], np.cumsum(qo)])
        nblk = [-(-n // BS) for n in lens]
        nb = sum(nblk) + 4
        ids = rng.permutation(nb)
        tables = np.full((len(lens), max(nblk) + 1), -1)
        at = 0
        for i, k in enumerate(nblk):
            tables[i, :k] = ids[at : at + k]
            at += k
        Kc = h16(rng.standard_normal((nb, BS, hkv, D)))
        Vc = h16(rng.standard_normal((nb, BS, hkv, D)))
        q = h16(rng.standard_normal((indptr[-1], hq, D)))
        want = reference(q, Kc, Vc, indptr, tables, lens, BS, causal)
        # wide CTAs (4 warps, 64 rows) and narrow ones (1 warp, 16 rows), as in _build.py
        for rows, bn in ((64, 32 if D == 256 else 64), (16, 16 if D == 256 else 32)):
            got = launch(
                D, BS, q, Kc, Vc, indptr, tables, lens, hq // hkv, causal, splits, rows=rows, BN=bn
            )
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            print(
                D,
                BS,
                hq,
                hkv,
                qo,
                [int(n) for n in lens],
                causal,
                splits,
                f"rows {rows}",
                "rel err",
                f"{err:.2e}",
                "OK" if err < 1e-3 else "FAIL",
            )


if __name__ == "__main__":
    main()
