# Lane-level NumPy emulation of the fp8 data path of cuda/paged_decode_tc.cu (KV_FP8 set; the
# layout and fragment rules are in cuda/fp8_fragments.cuh), checked on a machine without a GPU.
# For every fp8 head width (DP 32..256, step 16) and both fp8 formats it replays one warp tile:
#   - the cp.async pieces into the padded fp8 K and V rows (masked rows zero-filled);
#   - each lane's vector shared loads (address inside its tile, every byte written by a copy,
#     no bank conflict in any phase: 8 lanes for 16-byte loads, 16 for 8-byte, 32 below);
#   - the K B-fragments (bytes 0-1 / 2-3 of a word), Q's A fragments at the permuted dims, the
#     V A-fragments built by the kernel's __byte_perm selectors, and O^T's rows mapped back;
#   - the integer fp8x2 -> f16x2 conversion of pre-sm_89 GPUs against the fp8 value tables.
# Q, P and the fp8 values are chosen so that every product and sum is exact in float64, so the
# emulated mma results must EQUAL Q K^T and P V of the dequantized tile, not just be close.
# Run: python tools/fp8_fragment_emulator.py  (fails on the first mismatch).
import numpy as np

TILE = 16


def fp8_values(fmt):
    """The value of each of the 256 codes (NaN for NaN codes; e5m2's infinities kept)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    if fmt == "e4m3":
        e, m = (codes >> 3) & 15, codes & 7
        v = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7))
        v = np.where((codes & 0x7F) == 0x7F, np.nan, v)
    else:
        e, m = (codes >> 2) & 31, codes & 3
        v = np.where(e == 0, m / 4 * 2.0**-14, (1 + m / 4) * 2.0 ** (e - 15))
        v = np.where(e == 31, np.where(m == 0, np.inf, np.nan), v)
    return sign * v


class Layout:
    """fp8_fragments.cuh's constants for one padded head width."""

    def __init__(self, dp):
        ks = self.ksteps = dp // 16
        self.dp = dp
        self.k_vw = 16 if ks % 4 == 0 else 8 if ks % 2 == 0 else 4
        self.k_kpu = self.k_vw // 4
        self.k_units = ks // self.k_kpu
        self.v_vw = 16 if ks % 8 == 0 else 8 if ks % 4 == 0 else 4 if ks % 2 == 0 else 2
        self.v_dpu = self.v_vw // 2
        self.v_units = ks // self.v_dpu
        self.k_row = next(
            r for r in range(dp, dp + 256, 16) if r % (8 * self.k_vw) == 4 * self.k_vw
        )
        self.v_row = next(r for r in range(dp, dp + 256, 16) if r % 64 == 16)
        self.k_tile = TILE * self.k_row

    def k_dim(self, kk, tig):
        return ((kk // self.k_kpu) * 4 + tig) * self.k_vw + (kk % self.k_kpu) * 4

    def v_dim(self, dd, half, gid):
        return ((dd // self.v_dpu) * 8 + gid) * self.v_vw + 2 * (dd % self.v_dpu) + half


def byte_perm(x, y, sel):
    b = (int(y) << 32) | int(x)
    return sum(((b >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def check_banks(addrs, vw, what):
    """One warp-wide vector load: per phase, each bank serves one 4-byte word."""
    per_phase = 32 if vw <= 4 else 128 // vw
    for p0 in range(0, 32, per_phase):
        words = {}
        for a in addrs[p0 : p0 + per_phase]:
            for w in range(a // 4, (a + vw + 3) // 4):
                words.setdefault(w % 32, set()).add(w)
        assert all(len(s) == 1 for s in words.values()), f"{what}: bank conflict {addrs}"


def mma(A, B):
    return A @ B  # float64; the operands below make it exact


def run_tile(lay, fmt, rng):
    vals = fp8_values(fmt)
    finite = np.flatnonzero(np.isfinite(vals))
    dp, ks = lay.dp, lay.ksteps
    codes_k = rng.choice(finite, (TILE, dp)).astype(np.uint8)
    codes_v = rng.choice(finite, (TILE, dp)).astype(np.uint8)
    mask = int(rng.integers(1, 1 << 16)) | 1
    if rng.random() < 0.3:
        mask = 0xFFFF
    valid = np.array([(mask >> r) & 1 for r in range(TILE)], bool)

    # cp.async pieces: (row, 16-byte chunk c) -> row * ROW + 16c; masked rows zero-filled.
    stage = np.full(lay.k_tile + TILE * lay.v_row, -1, np.int32)
    ch8 = dp // 16
    for p in range(((TILE * ch8 + 31) // 32) * 32):
        if p >= TILE * ch8:
            continue
        row, c = p // ch8, p % ch8
        dk, dv = row * lay.k_row + 16 * c, lay.k_tile + row * lay.v_row + 16 * c
        assert dk + 16 <= lay.k_tile and dv + 16 <= len(stage)
        stage[dk : dk + 16] = codes_k[row, 16 * c : 16 * c + 16] if valid[row] else 0
        stage[dv : dv + 16] = codes_v[row, 16 * c : 16 * c + 16] if valid[row] else 0

    def lds(addrs, vw, lo, hi, what):
        check_banks(addrs, vw, what)
        out = []
        for a in addrs:
            assert lo <= a and a + vw <= hi, f"{what}: read outside the tile"
            b = stage[a : a + vw]
            assert (b >= 0).all(), f"{what}: read a byte no copy wrote"
            out.append(b.astype(np.int64))
        return out

    q = rng.integers(-4, 5, (16, dp)).astype(np.float64)  # 16 head rows (NH = 2)
    pm = rng.integers(0, 5, (16, TILE)).astype(np.float64)  # P (head x token), exact in fp16
    kdq = np.where(valid[:, None], vals[codes_k], 0.0)
    vdq = np.where(valid[:, None], vals[codes_v], 0.0)

    # S = Q K^T: A from Q at k_dim, B from each lane's K unit bytes.
    s = np.zeros((16, TILE))
    for j in range(lay.k_units):
        units = []
        for nt in range(2):
            addrs = [(nt * 8 + t // 4) * lay.k_row + (4 * j + t % 4) * lay.k_vw for t in range(32)]
            units.append(lds(addrs, lay.k_vw, 0, lay.k_tile, f"K DP {dp}"))
        for e in range(lay.k_kpu):
            kk = j * lay.k_kpu + e
            A = np.zeros((16, 16))
            for t in range(32):
                g, tg = t // 4, t % 4
                c = lay.k_dim(kk, tg)
                A[g, 2 * tg : 2 * tg + 2] = q[g, c : c + 2]
                A[g + 8, 2 * tg : 2 * tg + 2] = q[g + 8, c : c + 2]
                A[g, 2 * tg + 8 : 2 * tg + 10] = q[g, c + 2 : c + 4]
                A[g + 8, 2 * tg + 8 : 2 * tg + 10] = q[g + 8, c + 2 : c + 4]
            for nt in range(2):
                B = np.zeros((16, 8))
                for t in range(32):
                    g, tg = t // 4, t % 4
                    w = units[nt][t][4 * e : 4 * e + 4]
                    B[2 * tg : 2 * tg + 2, g] = vals[w[0:2]]  # b0: bytes 0, 1
                    B[2 * tg + 8 : 2 * tg + 10, g] = vals[w[2:4]]  # b1: bytes 2, 3
                s[:, nt * 8 : nt * 8 + 8] += mma(A, B)
    assert np.array_equal(s, q @ kdq.T), f"S differs at DP {dp} {fmt}"

    # O^T += V^T P^T: A from the byte-permuted V words, then O^T's rows through v_dim.
    sacc = np.full((16, dp), np.nan)
    o = np.zeros((ks, 2, 32, 4))
    for u in range(lay.v_units):
        rows = []
        for r in range(4):
            addrs = [
                lay.k_tile
                + (2 * (t % 4) + (r & 1) + (r >> 1) * 8) * lay.v_row
                + (8 * u + t // 4) * lay.v_vw
                for t in range(32)
            ]
            rows.append(lds(addrs, lay.v_vw, lay.k_tile, len(stage), f"V DP {dp}"))
        for e in range(lay.v_dpu):
            dd = u * lay.v_dpu + e
            sel = 0x7362 if e & 1 else 0x5140
            A = np.zeros((16, 16))
            for t in range(32):
                g, tg = t // 4, t % 4
                word = [
                    int.from_bytes(
                        bytes(list(rows[r][t][4 * (e // 2) : 4 * (e // 2) + 4])), "little"
                    )
                    for r in range(4)
                ]
                lo, hi = byte_perm(word[0], word[1], sel), byte_perm(word[2], word[3], sel)
                pair = lambda x: vals[[x & 0xFF, (x >> 8) & 0xFF]]
                A[g, 2 * tg : 2 * tg + 2] = pair(lo)
                A[g + 8, 2 * tg : 2 * tg + 2] = pair(lo >> 16)
                A[g, 2 * tg + 8 : 2 * tg + 10] = pair(hi)
                A[g + 8, 2 * tg + 8 : 2 * tg + 10] = pair(hi >> 16)
            for h in range(2):
                D = mma(A, pm[h * 8 : h * 8 + 8].T)  # B = P^T of head tile h (the fp16 path's)
                for t in range(32):
                    g, tg = t // 4, t % 4
                    o[dd, h, t] = (
                        D[g, 2 * tg],
                        D[g, 2 * tg + 1],
                        D[g + 8, 2 * tg],
                        D[g + 8, 2 * tg + 1],
                    )
    for h in range(2):
        for t in range(32):
            g, tg = t // 4, t % 4
            hd0 = h * 8 + 2 * tg
            for dd in range(ks):
                d0, d1 = lay.v_dim(dd, 0, g), lay.v_dim(dd, 1, g)
                sacc[hd0, d0], sacc[hd0 + 1, d0] = o[dd, h, t, 0], o[dd, h, t, 1]
                sacc[hd0, d1], sacc[hd0 + 1, d1] = o[dd, h, t, 2], o[dd, h, t, 3]
    assert np.array_equal(sacc, pm @ vdq), f"O differs at DP {dp} {fmt}"


def check_integer_conversion(fmt):
    """f16x2_of_fp8x2's pre-sm_89 path: byte_perm(x, 0, 0x1404), then the e4m3 shift."""
    vals = fp8_values(fmt)
    for lo in range(256):
        hi = (lo * 37 + 11) & 0xFF
        h = byte_perm(lo | (hi << 8), 0, 0x1404)
        if fmt == "e4m3":
            h = (h & 0x80008000) | ((h >> 1) & 0x3F803F80)
        got = np.array([h & 0xFFFF, h >> 16], np.uint16).view(np.float16).astype(np.float64)
        want = vals[[lo, hi]] / (256.0 if fmt == "e4m3" else 1.0)
        for g, w, c in zip(got, want, (lo, hi)):
            if np.isnan(w):
                continue  # e4m3 NaN (never written) / e5m2 NaN
            assert g == w, f"{fmt} code {c:#x}: {g} != {w}"


def main():
    rng = np.random.default_rng(0)
    for fmt in ("e4m3", "e5m2"):
        check_integer_conversion(fmt)
        for dp in range(32, 257, 16):
            lay = Layout(dp)
            for _ in range(3):
                run_tile(lay, fmt, rng)
            print(
                f"{fmt} DP {dp}: K unit {lay.k_vw} B, V unit {lay.v_vw} B, rows "
                f"{lay.k_row}/{lay.v_row} B: S and O exact, no bank conflict"
            )
    print("all fp8 fragment cases exact")


if __name__ == "__main__":
    main()
