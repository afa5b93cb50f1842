# Lane-level NumPy emulation of paged_decode_tc.cu, used to check its index and fragment
# arithmetic on a machine without a GPU (fragment layouts as the PTX ISA documents them).
# Run: python bench/tools/tc_fragment_emulator.py (prints the relative error per case).
# Lane-level numpy emulation of paged_decode_tc.cu (one CTA), fragment layouts per the PTX ISA.
import numpy as np
TILE=16
def run(D, BS, GQ, NW, STAGES, q, Kc, Vc, table, t_begin, t_end, scale_log2, num_blocks):
    NH = 1 if GQ <= 8 else 2
    CH = D//8; ROWB = D*2; TB = TILE*ROWB; PPL = TILE*CH//32; RPI = 32//CH; KS = D//16
    smem = np.zeros((NW*STAGES*2*TB)//2, np.float16)   # in 16-bit elements
    def swz(row, chunk): return row*ROWB + ((chunk ^ (row & 7)) << 4)
    def ldsm(base_b, addrs, trans):  # addrs: byte address per lane; returns regs [4][32][2]
        out = np.zeros((4,32,2), np.float32)
        for i in range(4):
            rows = [smem[(addrs[8*i+r])//2:(addrs[8*i+r])//2+8].astype(np.float32) for r in range(8)]
            M = np.stack(rows)  # 8x8, row r from lane 8i+r
            for t in range(32):
                if not trans: out[i,t] = M[t//4, 2*(t%4):2*(t%4)+2]
                else: out[i,t] = [M[2*(t%4), t//4], M[2*(t%4)+1, t//4]]
        return out
    def mma(C, a, b):  # C [32][4]; a [4][32][2]; b [2][32][2]
        A = np.zeros((16,16)); B = np.zeros((16,8))
        for t in range(32):
            g, tg = t//4, t%4
            A[g, 2*tg:2*tg+2] = a[0][t]; A[g+8, 2*tg:2*tg+2] = a[1][t]
            A[g, 2*tg+8:2*tg+10] = a[2][t]; A[g+8, 2*tg+8:2*tg+10] = a[3][t]
            B[2*tg:2*tg+2, g] = b[0][t]; B[2*tg+8:2*tg+10, g] = b[1][t]
        Dm = A@B
        for t in range(32):
            g, tg = t//4, t%4
            C[t,0]+=Dm[g,2*tg]; C[t,1]+=Dm[g,2*tg+1]; C[t,2]+=Dm[g+8,2*tg]; C[t,3]+=Dm[g+8,2*tg+1]
    h16 = lambda x: np.float32(np.float16(x))
    lanes = np.arange(32); gid = lanes//4; tig = lanes%4
    states = []
    n_tiles = (t_end - t_begin + TILE - 1)//TILE
    for warp in range(NW):
        n_my = (n_tiles - warp + NW - 1)//NW if n_tiles > warp else 0
        wbase = warp*STAGES*2*TB
        # Q A fragments
        qa = np.zeros((KS,4,32,2), np.float32)
        for kk in range(KS):
            for t in range(32):
                g, tg = t//4, t%4
                if g < GQ: qa[kk,0,t] = q[g, kk*16+2*tg:kk*16+2*tg+2]; qa[kk,2,t] = q[g, kk*16+8+2*tg:kk*16+10+2*tg]
                if NH==2 and g+8 < GQ: qa[kk,1,t] = q[g+8, kk*16+2*tg:kk*16+2*tg+2]; qa[kk,3,t] = q[g+8, kk*16+8+2*tg:kk*16+10+2*tg]
        m = np.full((NH,32), -np.inf); l = np.zeros((NH,32)); o = np.zeros((KS,NH,32,4))
        okbits = {}
        def issue(j):
            stage = j % STAGES; t0 = t_begin + (warp + j*NW)*TILE
            okA = okB = False; offA = offB = 0
            if j < n_my:
                b0 = table[t0//BS]; okA = 0 <= b0 < num_blocks; offA = (b0, t0 % BS)
                if BS >= TILE: okB = okA; offB = (b0, t0 % BS + 8)
                elif t0 + 8 < t_end: b1 = table[t0//BS+1]; okB = 0 <= b1 < num_blocks; offB = (b1, 0)
                sk = wbase + stage*2*TB
                for i in range(PPL):
                    for lane in range(32):
                        row = i*RPI + lane//CH; chunk = lane % CH; second = i*RPI >= 8
                        ok = (t0+row < t_end) and (okB if second else okA)
                        dst = (sk + swz(row, chunk))//2
                        if ok:
                            blk, off = offB if second else offA
                            tok = off + (row-8 if second else row)
                            smem[dst:dst+8] = Kc[blk, tok, chunk*8:chunk*8+8]
                            smem[dst+TB//2:dst+TB//2+8] = Vc[blk, tok, chunk*8:chunk*8+8]
                        else:
                            smem[dst:dst+8] = 0; smem[dst+TB//2:dst+TB//2+8] = 0
            okbits[stage] = (okA, okB)
        for j in range(STAGES-1): issue(j)
        mi = lanes >> 3; mr = lanes & 7; k_row = mr + ((mi>>1)<<3); k_cadd = mi & 1
        for it in range(n_my):
            issue(it + STAGES - 1)
            stage = it % STAGES; sk = wbase + stage*2*TB; sv = sk + TB
            t0 = t_begin + (warp + it*NW)*TILE; okA, okB = okbits[stage]
            s = np.zeros((2,32,4))
            for kk in range(KS):
                kb = ldsm(0, [sk + swz(k_row[x], 2*kk + k_cadd[x]) for x in range(32)], False)
                mma(s[0], qa[kk], [kb[0], kb[1]]); mma(s[1], qa[kk], [kb[2], kb[3]])
            valid = np.zeros((2,2,32), bool)
            for nt in range(2):
                for e in range(2):
                    valid[nt,e] = (t0 + nt*8 + 2*tig + e < t_end) & (okA if nt==0 else okB)
            pb = np.zeros((NH,2,32,2)); alpha = np.zeros((NH,32))
            for h in range(NH):
                x = np.zeros((2,2,32))
                for nt in range(2):
                    for e in range(2):
                        x[nt,e] = np.where(valid[nt,e], s[nt][:,2*h+e]*scale_log2, -np.inf)
                mx = np.maximum(m[h], x.max(axis=(0,1)))
                mx = np.maximum(mx, mx[lanes ^ 1]); mx = np.maximum(mx, mx[lanes ^ 2])
                with np.errstate(invalid='ignore'):
                    alpha[h] = np.where(mx == -np.inf, 1.0, np.exp2(m[h] - mx))
                m[h] = mx
                with np.errstate(invalid='ignore'):
                    p = np.where(valid, np.exp2(x - mx), 0.0)
                l[h] = l[h]*alpha[h] + p.sum(axis=(0,1))
                for nt in range(2):
                    pb[h,nt,:,0] = [h16(v) for v in p[nt,0]]; pb[h,nt,:,1] = [h16(v) for v in p[nt,1]]
            for h in range(NH):
                a0 = alpha[h][8*tig]; a1 = alpha[h][8*tig+4]
                for dd in range(KS):
                    o[dd,h][:,0]*=a0; o[dd,h][:,1]*=a1; o[dd,h][:,2]*=a0; o[dd,h][:,3]*=a1
            for dd in range(KS):
                va = ldsm(0, [sv + swz(k_row[x], 2*dd + k_cadd[x]) for x in range(32)], True)
                for h in range(NH):
                    mma(o[dd,h], va, [pb[h,0], pb[h,1]])
        # warp state -> per head
        sm = np.full(16, -np.inf); sl = np.zeros(16); sacc = np.zeros((16, D))
        for h in range(NH):
            lsum = l[h] + l[h][lanes ^ 1]; lsum = lsum + lsum[lanes ^ 2]
            for t in range(32):
                g, tg = t//4, t%4
                if tg == 0: sm[h*8+g] = m[h][t]; sl[h*8+g] = lsum[t]
                hd0 = h*8 + 2*tg
                for dd in range(KS):
                    sacc[hd0, dd*16+g] = o[dd,h][t,0]; sacc[hd0+1, dd*16+g] = o[dd,h][t,1]
                    sacc[hd0, dd*16+g+8] = o[dd,h][t,2]; sacc[hd0+1, dd*16+g+8] = o[dd,h][t,3]
        states.append((sm, sl, sacc))
    out = np.zeros((GQ, D))
    for g in range(GQ):
        M = max(st[0][g] for st in states)
        if M == -np.inf: continue
        L = sum(np.exp2(st[0][g]-M)*st[1][g] for st in states)
        O = sum(np.exp2(st[0][g]-M)*st[2][g] for st in states)
        out[g] = O / L
    return out

rng = np.random.default_rng(0)
for D, BS, GQ, NW, ST, L, tb in [(64, 8, 4, 4, 4, 100, 0), (64, 16, 12, 4, 4, 77, 0), (128, 32, 6, 4, 3, 150, 64), (64, 32, 16, 2, 2, 40, 0), (256, 16, 8, 2, 2, 33, 0), (64,8,1,4,4,5,0)]:
    nb = 40
    Kc = rng.standard_normal((nb, BS, D)).astype(np.float16); Vc = rng.standard_normal((nb, BS, D)).astype(np.float16)
    q = rng.standard_normal((GQ, D)).astype(np.float16).astype(np.float32)
    table = rng.permutation(nb)[: -(-L//BS)]
    t_end = L
    got = run(D, BS, GQ, NW, ST, q, Kc, Vc, table, tb, t_end, 1/np.sqrt(D)*1.4426950408889634, nb)
    toks = np.arange(tb, t_end)
    K = np.stack([Kc[table[t//BS], t % BS] for t in toks]).astype(np.float64); V = np.stack([Vc[table[t//BS], t % BS] for t in toks]).astype(np.float64)
    S = q.astype(np.float64) @ K.T / np.sqrt(D); P = np.exp(S - S.max(1, keepdims=True)); P /= P.sum(1, keepdims=True)
    ref = P @ V
    print(D, BS, GQ, NW, ST, L, tb, "rel err", np.linalg.norm(got-ref)/np.linalg.norm(ref))
