// The fp8 decode's register data path (paged_decode_tc.cu with KV_FP8 set): fp8 K/V tiles stay
// fp8 in shared memory and each lane builds its mma fragments from its own bytes, converting
// fp8 pairs to f16x2 right before the mma. Inlined like decode_common.cuh; needs DP and KSTEPS.
//
// The mma sums over the head dim (S = Q K^T) and over tokens (O^T += V^T P^T), so the order of
// those indices inside one mma is free as long as both operands agree. The kernel chooses, per
// lane, the dims whose bytes sit together in a row, so a lane reads whole 4..16-byte units:
//
// K (B of S, k = dim, n = token): lane (gid, tig) reads token rows gid and 8 + gid; its unit j
//   (K_VW bytes) is the row's unit 4j + tig, and bytes 4s..4s+3 of it feed k-step j*K_KPU + s:
//   b0 = bytes (0, 1) (k = 2tig, 2tig+1), b1 = bytes (2, 3) (k = 2tig+8, 2tig+9). Q's A
//   fragment takes the same dims (k_dim below), loaded once per launch.
// V (A of O^T, m = dim, k = token): lane (gid, tig) reads token rows 2tig, 2tig+1, 2tig+8 and
//   2tig+9 (the k of its a0..a3); its unit u (V_VW bytes) is the row's unit 8u + gid, and bytes
//   2s (A row gid) and 2s+1 (A row gid+8) feed d-tile u*V_DPU + s. A byte permute pairs the two
//   tokens of a register before the conversion. The output rows are mapped back by v_dim.
//
// Rows are padded so each phase of a vector shared load (8 lanes for 16 bytes, 16 for 8, 32 for
// 4) touches 32 different banks: K rows by K_ROW % (8 K_VW) == 4 K_VW (the phase's rows fall 4
// units apart), V rows by V_ROW % 64 == 16 (rows 2tig of a phase fall 32 bytes apart).
// tools/tc_fragment_emulator.py replays this mapping and the bank phases.

#define K_VW (KSTEPS % 4 == 0 ? 16 : KSTEPS % 2 == 0 ? 8 : 4)  // bytes per K unit
#define K_KPU (K_VW / 4)                                         // k-steps per K unit
#define K_UNITS (KSTEPS / K_KPU)                                 // K units per lane and row
#define V_VW (KSTEPS % 8 == 0 ? 16 : KSTEPS % 4 == 0 ? 8 : KSTEPS % 2 == 0 ? 4 : 2)
#define V_DPU (V_VW / 2)                                         // d-tiles per V unit
#define V_UNITS (KSTEPS / V_DPU)                                 // V units per lane and row
#define V_WORDS ((V_VW + 3) / 4)

__host__ __device__ constexpr int fp8_k_row(int r) { return r % (8 * K_VW) == 4 * K_VW ? r : fp8_k_row(r + 16); }
__host__ __device__ constexpr int fp8_v_row(int r) { return r % 64 == 16 ? r : fp8_v_row(r + 16); }
#define K_ROW fp8_k_row(DP)  // shared-memory bytes per fp8 K row
#define V_ROW fp8_v_row(DP)  // ... per fp8 V row

// The first of the 4 consecutive head dims lane `tig` gives k-step kk (Q and K alike).
__device__ __forceinline__ int k_dim(int kk, int tig) {
    return ((kk / K_KPU) * 4 + tig) * K_VW + (kk % K_KPU) * 4;
}

// The head dim of A row gid + 8*half of d-tile dd (V, and O^T's rows).
__device__ __forceinline__ int v_dim(int dd, int half, int gid) {
    return ((dd / V_DPU) * 8 + gid) * V_VW + 2 * (dd % V_DPU) + half;
}

// One unit of VW bytes from shared memory as 32-bit words (a 2-byte unit in the low half).
template <int VW>
__device__ __forceinline__ void lds_unit(const unsigned char* p, u32* w) {
    if constexpr (VW == 16) {
        const uint4 x = *reinterpret_cast<const uint4*>(p);
        w[0] = x.x; w[1] = x.y; w[2] = x.z; w[3] = x.w;
    } else if constexpr (VW == 8) {
        const uint2 x = *reinterpret_cast<const uint2*>(p);
        w[0] = x.x; w[1] = x.y;
    } else if constexpr (VW == 4) {
        w[0] = *reinterpret_cast<const u32*>(p);
    } else {
        w[0] = *reinterpret_cast<const u16*>(p);
    }
}

#include "fp8_convert.cuh"
