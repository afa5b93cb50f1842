# Lane-level NumPy emulation of cuda/paged_decode_tc.cu, used to check its index and fragment
# arithmetic on a machine without a GPU (fragment layouts as the PTX ISA documents them):
# padded head widths (DP) with a run-time head_dim, the shared-memory row layout (XOR swizzle or
# odd chunk stride), per-row block look-up for pages of < 16 tokens, row masks, the warp merge,
# and the fused split-KV merge (every split CTA emulated, then the last-CTA merge formula).
# The fp8 path (its own fragment mapping) is emulated in fp8_fragment_emulator.py.
# Run: python tools/tc_fragment_emulator.py  (prints the relative error per case and
# fails on an error above 2e-3, an out-of-tile shared-memory address, or a bank conflict).
import numpy as np

TILE = 16


def swz_fn(DP):
    CH = DP // 8
    SCH = CH if CH % 8 == 0 else (CH | 1)
    ROWB = SCH * 16

    def swz(row, chunk):
        if CH % 8 == 0:
            return row * ROWB + ((chunk ^ (row & 7)) << 4)
        return row * ROWB + (chunk << 4)

    return swz, ROWB


def run_cta(
    DP, head_dim, bs, GQ, NW, STAGES, q, Kc, Vc, table, t_begin, t_end, scale_log2, num_blocks
):
    """One CTA: returns (out[GQ, head_dim] normalised, lse[GQ] in log2)."""
    NH = 1 if GQ <= 8 else 2
    CH = DP // 8
    swz, ROWB = swz_fn(DP)
    TB = TILE * ROWB
    PPL = TILE * CH // 32
    KS = DP // 16
    smem = np.full(
        (NW * STAGES * 2 * TB) // 2, np.nan, np.float32
    )  # 16-bit slots, NaN = never written
    bs_log2 = bs.bit_length() - 1
    d_chunks = head_dim // 8

    def ldsm(addrs, trans):  # addrs: byte address per lane; returns regs [4][32][2]
        out = np.zeros((4, 32, 2), np.float32)
        for i in range(4):
            group = [addrs[8 * i + r] for r in range(8)]
            # 8 rows of 16 bytes: one 128-byte wavefront iff the 16-byte bank groups differ
            assert len({(a // 16) % 8 for a in group}) == 8, "ldmatrix bank conflict"
            M = np.stack([smem[a // 2 : a // 2 + 8] for a in group])
            assert not np.isnan(M).any(), "ldmatrix read a slot no copy wrote"
            for t in range(32):
                if not trans:
                    out[i, t] = M[t // 4, 2 * (t % 4) : 2 * (t % 4) + 2]
                else:
                    out[i, t] = [M[2 * (t % 4), t // 4], M[2 * (t % 4) + 1, t // 4]]
        return out

    def mma(C, a, b):  # C [32][4]; a [4][32][2]; b [2][32][2]
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        for t in range(32):
            g, tg = t // 4, t % 4
            A[g, 2 * tg : 2 * tg + 2] = a[0][t]
            A[g + 8, 2 * tg : 2 * tg + 2] = a[1][t]
            A[g, 2 * tg + 8 : 2 * tg + 10] = a[2][t]
            A[g + 8, 2 * tg + 8 : 2 * tg + 10] = a[3][t]
            B[2 * tg : 2 * tg + 2, g] = b[0][t]
            B[2 * tg + 8 : 2 * tg + 10, g] = b[1][t]
        Dm = A @ B
        for t in range(32):
            g, tg = t // 4, t % 4
            C[t, 0] += Dm[g, 2 * tg]
            C[t, 1] += Dm[g, 2 * tg + 1]
            C[t, 2] += Dm[g + 8, 2 * tg]
            C[t, 3] += Dm[g + 8, 2 * tg + 1]

    h16 = lambda x: np.float32(np.float16(x))
    lanes = np.arange(32)
    tig = lanes % 4
    qpad = np.zeros((16, DP), np.float32)
    qpad[:GQ, :head_dim] = q
    states = []
    n_tiles = (t_end - t_begin + TILE - 1) // TILE
    for warp in range(NW):
        n_my = (n_tiles - warp + NW - 1) // NW if n_tiles > warp else 0
        wbase = warp * STAGES * 2 * TB
        qa = np.zeros((KS, 4, 32, 2), np.float32)
        for kk in range(KS):
            for t in range(32):
                g, tg = t // 4, t % 4
                for r, rowg in ((0, g), (1, g + 8)):
                    if rowg < GQ and (r == 0 or NH == 2):
                        c0, c1 = kk * 16 + 2 * tg, kk * 16 + 8 + 2 * tg
                        if c0 < head_dim:
                            qa[kk, r, t] = qpad[rowg, c0 : c0 + 2]
                        if c1 < head_dim:
                            qa[kk, r + 2, t] = qpad[rowg, c1 : c1 + 2]
        m = np.full((NH, 32), -np.inf)
        l = np.zeros((NH, 32))
        o = np.zeros((KS, NH, 32, 4))
        rowbits = {}

        def issue(j):
            stage = j % STAGES
            t0 = t_begin + (warp + j * NW) * TILE
            mask = 0
            if j < n_my:
                blk = np.zeros(32, np.int64)
                row_ok = np.zeros(32, bool)
                for lane in range(32):
                    row_tok = t0 + (lane & 15)
                    blk[lane] = table[min(row_tok, t_end - 1) >> bs_log2]
                    row_ok[lane] = row_tok < t_end and 0 <= blk[lane] < num_blocks
                mask = sum(1 << r for r in range(16) if row_ok[r])
                sk = wbase + stage * 2 * TB
                for i in range(PPL):
                    for lane in range(32):
                        p = i * 32 + lane
                        row, c = p // CH, p % CH
                        b = blk[lane] if bs_log2 >= 4 and t_begin % TILE == 0 else blk[row]
                        ok = (mask >> row) & 1 and c < d_chunks
                        dst = sk + swz(row, c)
                        assert sk <= dst and dst + 16 <= sk + TB, "copy outside its K tile"
                        if ok:
                            tok = (t0 + row) & (bs - 1)
                            smem[dst // 2 : dst // 2 + 8] = Kc[b, tok, c * 8 : c * 8 + 8]
                            smem[(dst + TB) // 2 : (dst + TB) // 2 + 8] = Vc[
                                b, tok, c * 8 : c * 8 + 8
                            ]
                        else:
                            smem[dst // 2 : dst // 2 + 8] = 0
                            smem[(dst + TB) // 2 : (dst + TB) // 2 + 8] = 0
            rowbits[stage] = mask

        for j in range(STAGES - 1):
            issue(j)
        mi = lanes >> 3
        mr = lanes & 7
        ld_row = mr + ((mi >> 1) << 3)
        ld_cadd = mi & 1
        for it in range(n_my):
            issue(it + STAGES - 1)
            stage = it % STAGES
            sk = wbase + stage * 2 * TB
            sv = sk + TB
            rows = rowbits[stage]
            s = np.zeros((2, 32, 4))
            for kk in range(KS):
                kb = ldsm([sk + swz(ld_row[x], 2 * kk + ld_cadd[x]) for x in range(32)], False)
                mma(s[0], qa[kk], [kb[0], kb[1]])
                mma(s[1], qa[kk], [kb[2], kb[3]])
            valid = np.zeros((2, 2, 32), bool)
            for nt in range(2):
                for e in range(2):
                    valid[nt, e] = (rows >> (nt * 8 + 2 * tig + e)) & 1
            pb = np.zeros((NH, 2, 32, 2))
            alpha = np.zeros((NH, 32))
            for h in range(NH):
                x = np.zeros((2, 2, 32))
                for nt in range(2):
                    for e in range(2):
                        x[nt, e] = np.where(valid[nt, e], s[nt][:, 2 * h + e] * scale_log2, -np.inf)
                mx = np.maximum(m[h], x.max(axis=(0, 1)))
                mx = np.maximum(mx, mx[lanes ^ 1])
                mx = np.maximum(mx, mx[lanes ^ 2])
                with np.errstate(invalid="ignore"):
                    alpha[h] = np.where(mx == -np.inf, 1.0, np.exp2(m[h] - mx))
                m[h] = mx
                with np.errstate(invalid="ignore"):
                    p = np.where(valid, np.exp2(x - mx), 0.0)
                l[h] = l[h] * alpha[h] + p.sum(axis=(0, 1))
                for nt in range(2):
                    pb[h, nt, :, 0] = [h16(v) for v in p[nt, 0]]
                    pb[h, nt, :, 1] = [h16(v) for v in p[nt, 1]]
            for h in range(NH):
                a0 = alpha[h][8 * tig]
                a1 = alpha[h][8 * tig + 4]
                for dd in range(KS):
                    o[dd, h][:, 0] *= a0
                    o[dd, h][:, 1] *= a1
                    o[dd, h][:, 2] *= a0
                    o[dd, h][:, 3] *= a1
            for dd in range(KS):
                va = ldsm([sv + swz(ld_row[x], 2 * dd + ld_cadd[x]) for x in range(32)], True)
                for h in range(NH):
                    mma(o[dd, h], va, [pb[h, 0], pb[h, 1]])
        sm = np.full(16, -np.inf)
        sl = np.zeros(16)
        sacc = np.zeros((16, DP))
        for h in range(NH):
            lsum = l[h] + l[h][lanes ^ 1]
            lsum = lsum + lsum[lanes ^ 2]
            for t in range(32):
                g, tg = t // 4, t % 4
                if tg == 0:
                    sm[h * 8 + g] = m[h][t]
                    sl[h * 8 + g] = lsum[t]
                hd0 = h * 8 + 2 * tg
                for dd in range(KS):
                    sacc[hd0, dd * 16 + g] = o[dd, h][t, 0]
                    sacc[hd0 + 1, dd * 16 + g] = o[dd, h][t, 1]
                    sacc[hd0, dd * 16 + g + 8] = o[dd, h][t, 2]
                    sacc[hd0 + 1, dd * 16 + g + 8] = o[dd, h][t, 3]
        states.append((sm, sl, sacc))
    out = np.zeros((GQ, head_dim))
    lse = np.full(GQ, -np.inf)
    for g in range(GQ):
        M = max(st[0][g] for st in states)
        if -np.inf == M:
            continue
        L = sum(np.exp2(st[0][g] - M) * st[1][g] for st in states)
        O = sum(np.exp2(st[0][g] - M) * st[2][g] for st in states)
        out[g] = O[:head_dim] / L
        lse[g] = M + np.log2(L)
    return out, lse


def run(
    DP,
    head_dim,
    bs,
    GQ,
    NW,
    STAGES,
    q,
    Kc,
    Vc,
    table,
    length,
    chunk,
    max_splits,
    scale_log2,
    num_blocks,
):
    """Every split CTA of one (sequence, head tile), then the fused merge's formula."""
    n = max(1, min(max_splits, -(-length // chunk)))
    parts = []
    for split in range(n):
        t_begin = split * chunk
        t_end = length if split == n - 1 else min(length, t_begin + chunk)
        parts.append(
            run_cta(
                DP,
                head_dim,
                bs,
                GQ,
                NW,
                STAGES,
                q,
                Kc,
                Vc,
                table,
                t_begin,
                t_end,
                scale_log2,
                num_blocks,
            )
        )
    if n == 1:
        return parts[0][0]
    lse = np.stack([p[1] for p in parts])  # [n, GQ]
    M = lse.max(axis=0)
    w = np.where(-np.inf < M, np.exp2(lse - M), 0.0)
    L = w.sum(axis=0)
    w = np.where(L > 0, w / np.where(L > 0, L, 1), 0.0)
    return sum(w[s][:, None] * parts[s][0] for s in range(n))


def main():
    rng = np.random.default_rng(0)
    # (DP, head_dim, block_size, GQ, NWARPS, STAGES, length, chunk, max_splits)
    cases = [
        (64, 64, 8, 4, 4, 4, 100, 100, 1),
        (80, 80, 16, 12, 4, 4, 77, 77, 1),
        (128, 120, 32, 6, 4, 3, 150, 64, 3),
        (48, 40, 1, 3, 2, 2, 37, 37, 1),
        (32, 32, 2, 16, 2, 2, 40, 40, 1),
        (112, 112, 4, 9, 2, 3, 70, 64, 2),
        (256, 256, 256, 8, 2, 2, 33, 33, 1),
        (96, 96, 64, 1, 4, 3, 200, 64, 4),
        (64, 56, 128, 5, 2, 4, 5, 5, 1),
        (64, 64, 32, 4, 2, 2, 100, 40, 3),
    ]  # unaligned chunks
    worst = 0.0
    for DP, hd, BS, GQ, NW, ST, L, chunk, splits in cases:
        nb = 48
        Kc = rng.standard_normal((nb, BS, hd)).astype(np.float16)
        Vc = rng.standard_normal((nb, BS, hd)).astype(np.float16)
        q = rng.standard_normal((GQ, hd)).astype(np.float16).astype(np.float32)
        nblk = -(-L // BS)
        table = rng.permutation(nb)[:nblk]
        table[0] = 0  # block 0 and the pool's last block are ordinary blocks
        if nblk > 1:
            table[-1] = nb - 1
        if len(set(table)) != len(table):
            table = np.arange(nblk)
        got = run(
            DP,
            hd,
            BS,
            GQ,
            NW,
            ST,
            q,
            Kc,
            Vc,
            table,
            L,
            chunk,
            splits,
            1 / np.sqrt(hd) * 1.4426950408889634,
            nb,
        )
        toks = np.arange(L)
        K = np.stack([Kc[table[t // BS], t % BS] for t in toks]).astype(np.float64)
        V = np.stack([Vc[table[t // BS], t % BS] for t in toks]).astype(np.float64)
        S = q.astype(np.float64) @ K.T / np.sqrt(hd)
        P = np.exp(S - S.max(1, keepdims=True))
        P /= P.sum(1, keepdims=True)
        ref = P @ V
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        worst = max(worst, err)
        print(
            f"DP {DP} head_dim {hd} bs {BS} gq {GQ} warps {NW} stages {ST} len {L} "
            f"chunk {chunk} splits {splits}: rel err {err:.2e}"
        )
    assert worst < 2e-3, worst
    print("all cases within 2e-3")


if __name__ == "__main__":
    main()
