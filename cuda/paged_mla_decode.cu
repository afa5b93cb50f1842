// MLA attention (DeepSeek-V3 shape, absorbed projections) over a paged latent cache, decode and
// extend (qo_len >= 1 query tokens per sequence, causal), on tensor cores (mma.sync m16n8k16,
// fp16/bf16 in, fp32 accumulate), with split-KV.
//
// Per token the cache holds one vector of DQK = 576 elements: c_kv (the latent, DV = 512) then
// k_pe (the rope part, 64). Per query head: q_nope (already multiplied into the latent space,
// 512) and q_pe (64). logits = (q_nope . c_kv + q_pe . k_pe) * scale; the output of a head is
// the softmax-weighted sum of c_kv (512, in the latent space). Every query head attends to the
// same latent "head": a GQA group of all heads and all query positions, so a CTA serves a tile
// of HB = 16 * MT query rows and loads each latent tile once for all of them.
//
// Query rows: sequence `seq` has q_len query tokens (qo_indptr[seq + 1] - qo_indptr[seq], the
// LAST q_len of its len = seq_lens[seq] cached tokens; decode: qo_indptr null, q_len 1, token
// `seq`) and q_len * num_heads rows, position-major: row r is head r % num_heads of query
// token qo_indptr[seq] + r / num_heads, at position qpos = r / num_heads of the new tokens. It
// sees keys [0, len - q_len + qpos] (causal; decode: all len). A CTA reads keys only up to the
// last one its last row sees.
//
// One CTA per (row tile, split chunk, sequence), row tile fastest in the grid so the CTAs of
// one sequence's chunk run together and a second row tile finds the chunk in L2. NWARPS = MT *
// J warps: warp w serves m-tile mt = w / J (16 heads) and slice j = w % J. Per KV tile of BN
// tokens (cp.async into one of STAGES shared-memory stages, rows XOR-swizzled):
//   S phase: warp (mt, j) computes S (16 heads x BN/J tokens: slice j) = Q (ldmatrix from the Q
//     tile in shared memory, 36 k-steps of 16) * K^T (ldmatrix of the token rows);
//   the J warps of an m-tile exchange their row maxima through shared memory (named barrier
//     per m-tile), so all of them hold the same running max; each writes its slice of P (16-bit)
//     to the m-tile's P tile and keeps its own partial row sums;
//   O phase (after a second named barrier): warp (mt, j) owns output columns [j * DV/J, ...):
//     O (16 x DV/J) = O * alpha + P (16 x BN, ldmatrix) * V (ldmatrix.trans of the c_kv rows).
// A CTA barrier per tile orders the stages' reuse. At the end the J partial row sums are added
// through shared memory; an unsplit sequence writes `out`, a split one its normalised partial O
// (float32) and log2-sum-exp to the workspace, row r of split s of sequence seq at
// (seq * max_splits + s) * rows_per_seq + r, merged by `mla_merge` (a second launch). The
// splits of a sequence cut its whole len (the same count for all its row tiles, as the merge
// recomputes it); a row that sees no key of a split writes O = 0 and lse = -inf there.
//
// Tokens past the split's end or a row's causal limit, or whose table entry lies outside the
// row (pt_width) or the pool (num_pages), are masked (the first two not read when no row of
// the CTA sees them; the last two zero-filled without a read). A sequence of length 0 and a
// row that sees no key write zeros.
//
// Shared K = V heads of width 512 (Gemma 4's global layers, `attention_k_eq_v`; ROPE = 0): the
// same kernel with no rope part, each KV head's 512-wide rows read once as K and as V. The KV
// heads are a run-time count (num_kv_heads, byte stride kv_head_stride between them; MLA: 1, 0)
// and `group_heads` query heads share one (MLA: all of them): the rows of KV head kvh are its
// group's (query position, head) pairs, query head kvh * group_heads + r % group_heads. The
// grid's x runs over (KV head, row tile), row tile fastest.
//
// An fp8 latent cache (KV_FP8 = 1: float8_e4m3fn, one scale per layer, kv_scale[0]): the rows
// are 576 bytes, copied as they are (cp.async) into fp8 stages; after a stage lands, the CTA
// converts it into one 16-bit tile of the query's type (KV_BF16 then names the query dtype:
// e4m3 values are exact in fp16 and bf16), which the S and O phases read as they read a
// 16-bit stage. The dequantization scale is applied outside the mma: to the logits (c_kv .
// q_nope + k_pe . q_pe is linear in the row) and to the output (the value is c_kv), so the
// tile holds the codes' values unscaled (fp8_convert.cuh; FP8_F16_SCALE on sm_80, where the
// integer conversion yields value / 256). One barrier more per tile orders the conversion.
//
// Compile-time constants (NVRTC -D): KV_BF16, MT (m-tiles of 16 heads per CTA), J (warps per
// m-tile), BN (tokens per KV tile), STAGES, ROPE (64: MLA's rope part after the 512 latent
// elements; 0: a shared K = V head of 512; default 64), KV_FP8 (0: a 16-bit cache, the
// default; 1: float8_e4m3fn, MLA rows only).

#if !defined(KV_BF16) || !defined(MT) || !defined(J) || !defined(BN) || !defined(STAGES)
#error "paged_mla_decode.cu needs KV_BF16, MT, J, BN and STAGES defined"
#endif

#ifndef ROPE
#define ROPE 64
#endif
static_assert(ROPE == 0 || ROPE == 64, "ROPE: 64 (MLA) or 0 (shared K = V head)");
#ifndef KV_FP8
#define KV_FP8 0
#endif
static_assert(KV_FP8 == 0 || (KV_FP8 == 1 && ROPE == 64), "KV_FP8: 0, or 1 (e4m3) for MLA rows");

#include "decode_common.cuh"

#define DV 512                 // latent width (c_kv), also the output width
#define DQK (DV + ROPE)        // latent + rope: one cache row, one query row
#define CHQ (DQK / 8)          // 16-byte chunks per row (72 or 64: multiples of 8, so XOR-swizzled)
#define CHV (DV / 8)           // chunks of the c_kv part
#define ROWB (DQK * 2)         // bytes per row in shared memory (1152; 1024 without rope)
#define HB (16 * MT)           // heads per CTA
#define NWARPS (MT * J)
#define NTHREADS (NWARPS * 32)
#define SW (BN / J)            // tokens of a warp's S slice
#define NB (SW / 8)            // its n8 blocks
#define CW (DV / J)            // output columns of a warp
#define ON (CW / 8)            // their n8 blocks
#define KSTEPS (DQK / 16)
#define ROW_BYTES (DQK * (KV_FP8 ? 1 : 2))  // bytes of a cache row (global memory)
#define CHG (ROW_BYTES / 16)   // its 16-byte chunks (72, 64; fp8: 36)
#if KV_FP8
#define STAGE_BYTES (BN * ROW_BYTES)  // an fp8 stage: rows as in the cache, unswizzled
#define KV16_BYTES (BN * ROWB)        // the converted 16-bit tile the mma phases read
#else
#define STAGE_BYTES (BN * ROWB)
#define KV16_BYTES 0
#endif
#define Q_BYTES (HB * ROWB)
#define PROWB (BN * 2)         // bytes of a P row
#define P_BYTES (HB * PROWB)
#define KV_AREA (STAGES * STAGE_BYTES + KV16_BYTES)
#define SMEM_BYTES (KV_AREA + Q_BYTES + P_BYTES + 2 * J * HB * 4)

static_assert(MT >= 1 && MT <= 8, "MT: 1..8 m-tiles");
static_assert(J == 1 || J == 2 || J == 4, "J: 1, 2 or 4 warps per m-tile");
static_assert(NB % 2 == 0 && NB >= 2, "a warp's S slice must be a multiple of 16 tokens");
static_assert(BN % 64 == 0, "BN: a multiple of 64 (P rows of a multiple of 8 chunks, swizzled)");
static_assert(STAGES >= 2 && STAGES <= 4, "STAGES: 2..4");
static_assert(MT <= 15, "named barrier ids 1..MT");

#include "mma_common.cuh"

// Byte offset of (row, 16-byte chunk) in a tile of rows of `chunks` chunks (a multiple of 8):
// chunks XOR-swizzled by row & 7, so the 8 rows an ldmatrix reads at one chunk column land in
// 8 different bank groups.
__device__ __forceinline__ unsigned swz(int row, int chunk, int row_bytes) {
    return (unsigned)(row * row_bytes + ((chunk ^ (row & 7)) << 4));
}

__device__ __forceinline__ void mtile_sync(int mt) {
    asm volatile("bar.sync %0, %1;" :: "r"(mt + 1), "r"(J * 32) : "memory");
}

#if KV_FP8
#include "fp8_convert.cuh"

// Two e4m3 codes (low 16 bits of x) -> two elements of the mma's 16-bit type, exactly.
__device__ __forceinline__ u32 elem16x2_of_fp8x2(u32 x) {
    const u32 h = f16x2_of_fp8x2(x);
#if KV_BF16
    float lo, hi;
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((u16)h));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((u16)(h >> 16)));
    return pack2(lo, hi);
#else
    return h;
#endif
}

// fp8 stage `src` (BN rows of 576 bytes) -> the 16-bit tile `dst` (rows of ROWB, swizzled):
// 16 codes of a thread's chunk become 16-bit chunks 2ch and 2ch + 1 of the row.
__device__ __forceinline__ void convert_tile(unsigned src, unsigned dst, int tid) {
#pragma unroll 1  // the m-tiles' O accumulators hold the registers: keep the loop small
    for (int c = tid; c < BN * CHG; c += NTHREADS) {
        const int row = c / CHG, ch = c % CHG;
        u32 w[4], r[8];
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                     : "r"(src + row * ROW_BYTES + ch * 16));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            r[2 * i] = elem16x2_of_fp8x2(w[i]);
            r[2 * i + 1] = elem16x2_of_fp8x2(w[i] >> 16);
        }
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                     :: "r"(dst + swz(row, 2 * ch, ROWB)), "r"(r[0]), "r"(r[1]), "r"(r[2]),
                        "r"(r[3]) : "memory");
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                     :: "r"(dst + swz(row, 2 * ch + 1, ROWB)), "r"(r[4]), "r"(r[5]), "r"(r[6]),
                        "r"(r[7]) : "memory");
    }
}
#endif

// A sequence's query tokens: the first one's index in q / out, their number, and its rows per
// KV head (q_len * group_heads). Decode (qo_indptr null): one token per sequence, token `seq`.
struct QueryRows {
    int q_begin, q_len, rows;
};

__device__ __forceinline__ QueryRows query_rows(const int* qo_indptr, int seq, int group_heads) {
    QueryRows q;
    q.q_begin = qo_indptr ? qo_indptr[seq] : seq;
    q.q_len = qo_indptr ? qo_indptr[seq + 1] - q.q_begin : 1;
    q.rows = q.q_len * group_heads;
    return q;
}

// One past the last key the query at position `qpos` of the q_len new tokens sees (causal:
// they are the last q_len of the len cached tokens; decode: len).
__device__ __forceinline__ int key_limit(int len, int q_len, int qpos) {
    return len - q_len + qpos + 1;
}

// Element offset in q / out (strides per token and per head) of query row r of KV head kvh:
// query head kvh * group_heads + r % group_heads of query token q_begin + r / group_heads.
__device__ __forceinline__ i64 row_offset(const QueryRows& q, int r, int kvh, int group_heads,
                                          i64 tok_stride, i64 head_stride) {
    return (i64)(q.q_begin + r / group_heads) * tok_stride +
           (i64)(kvh * group_heads + r % group_heads) * head_stride;
}

// The factor of an fp8 cache's code values (the layer's scale; sm_80's conversion gives value /
// 256, FP8_F16_SCALE undoes it); 1 for a 16-bit cache.
__device__ __forceinline__ float kv_multiplier(const float* kv_scale) {
#if KV_FP8
    return kv_scale[0] * FP8_F16_SCALE;
#else
    return 1.f;
#endif
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) paged_mla_decode(
    const u16* __restrict__ q_nope, i64 qn_token_stride, i64 qn_head_stride,
    const u16* __restrict__ q_pe, i64 qp_token_stride, i64 qp_head_stride,
    u16* __restrict__ out, i64 out_token_stride, i64 out_head_stride,
    float* __restrict__ part_o, float* __restrict__ part_lse,
    const char* __restrict__ kv_base, i64 page_stride, i64 token_stride, i64 kv_head_stride,
    int num_pages, int bs_log2, const int* __restrict__ page_tables, i64 pt_stride, int pt_width,
    const int* __restrict__ seq_lens, const int* __restrict__ qo_indptr, int group_heads,
    int num_kv_heads, int rows_per_seq, int chunk_tokens, int max_splits, float scale_log2,
    const float* __restrict__ kv_scale) {
    const int tiles_per_head = (rows_per_seq + HB - 1) / HB;
    const int kvh = blockIdx.x / tiles_per_head;
    const int r_cta = (blockIdx.x - kvh * tiles_per_head) * HB;
    const int split = blockIdx.y;
    const int seq = blockIdx.z;
    const int len = max(seq_lens[seq], 0);
    const QueryRows qr = query_rows(qo_indptr, seq, group_heads);
    kv_base += (i64)kvh * kv_head_stride;
    if (r_cta >= qr.rows) return;  // this sequence has fewer query rows than the longest
    const SplitRange range = split_range(split, len, chunk_tokens, max_splits);
    if (split >= range.num_splits) return;  // this sequence is shorter than the longest
    // The keys the CTA's last row sees bound the tiles it reads (causal).
    const int last_row = min(r_cta + HB, qr.rows) - 1;
    const int t_begin = range.t_begin;
    const int t_end = min(range.t_end, key_limit(len, qr.q_len, last_row / group_heads));
    const int n_tiles = t_end > t_begin ? (t_end - t_begin + BN - 1) / BN : 0;

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int mt = warp / J, j = warp % J;
    const int gid = lane >> 2, tig = lane & 3;

    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned s_base = (unsigned)__cvta_generic_to_shared(smem);
    const unsigned s_q = s_base + KV_AREA;
    const unsigned s_p = s_q + Q_BYTES + mt * 16 * PROWB;  // this warp's m-tile's P rows
    float* red_max = reinterpret_cast<float*>(smem + KV_AREA + Q_BYTES + P_BYTES);
    float* red_l = red_max + J * HB;

    const int* pt_row = page_tables + seq * pt_stride;
    // The layer's dequantization scale, on the logits here and on the output at the end (read
    // again there: one register fewer across the tile loop).
    const float qk_scale = scale_log2 * kv_multiplier(kv_scale);
    const int bs_mask = (1 << bs_log2) - 1;

    // The Q tile: query rows r_cta .. r_cta + HB - 1 (rows past the sequence's zero), chunks
    // 0..63 from q_nope, 64..71 from q_pe (none without rope). Part of the first cp.async group.
    for (int c = tid; c < HB * CHQ; c += NTHREADS) {
        const int row = c / CHQ, ch = c % CHQ;
        const int r = r_cta + row;
        const bool in = r < qr.rows;
        const i64 tok = qr.q_begin + r / group_heads;
        const int h = kvh * group_heads + r % group_heads;
        const u16* src = (ROPE == 0 || ch < CHV)
                             ? q_nope + tok * qn_token_stride + (i64)h * qn_head_stride + ch * 8
                             : q_pe + tok * qp_token_stride + (i64)h * qp_head_stride + (ch - CHV) * 8;
        cp_async16(s_q + swz(row, ch, ROWB), in ? reinterpret_cast<const char*>(src)
                                                : reinterpret_cast<const char*>(q_nope), in);
    }

    // Tile `it` of the split into stage `stage`: BN rows of CHG chunks, each row's page looked
    // up in the table (entries outside the row or the pool: zero-filled, no read).
    auto load_tile = [&](int it, int stage) {
        const unsigned dst = s_base + stage * STAGE_BYTES;
        const int t0 = t_begin + it * BN;
        for (int c = tid; c < BN * CHG; c += NTHREADS) {
            const int row = c / CHG, ch = c % CHG;
            const int t = t0 + row;
            const int entry = t >> bs_log2;
            int page = -1;
            if (t < t_end && entry < pt_width) page = pt_row[entry];
            const bool ok = (unsigned)page < (unsigned)num_pages;
            const char* src = ok ? kv_base + (i64)page * page_stride +
                                       (i64)(t & bs_mask) * token_stride + ch * 16
                                 : kv_base;
#if KV_FP8
            cp_async16(dst + row * ROW_BYTES + ch * 16, src, ok);
#else
            cp_async16(dst + swz(row, ch, ROWB), src, ok);
#endif
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_tiles) load_tile(s, s);
        cp_async_commit();
    }

    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // rows gid, gid + 8 of the m-tile
    // The causal limits (one past the last key) of this lane's two rows; rows past the
    // sequence's are never stored.
    const int ra = r_cta + mt * 16 + gid, rb = ra + 8;
    const int lim_a = key_limit(len, qr.q_len, ra / group_heads);
    const int lim_b = key_limit(len, qr.q_len, rb / group_heads);
    float o[ON][4];
#pragma unroll
    for (int n = 0; n < ON; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[n][i] = 0.f;

    for (int it = 0; it < n_tiles; ++it) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile `it` (and Q) visible; every warp done with tile it - 1
        {
            const int nxt = it + STAGES - 1;
            if (nxt < n_tiles) load_tile(nxt, nxt % STAGES);
            cp_async_commit();
        }
#if KV_FP8
        const unsigned s_kv = s_base + STAGES * STAGE_BYTES;
        convert_tile(s_base + (it % STAGES) * STAGE_BYTES, s_kv, tid);
        __syncthreads();  // the 16-bit tile complete before any warp reads it
#else
        const unsigned s_kv = s_base + (it % STAGES) * STAGE_BYTES;
#endif
        const int t0 = t_begin + it * BN;

        // ---- S = Q K^T for the m-tile's 16 heads x the slice's SW tokens
        float s[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[nb][i] = 0.f;
        const int a_row = mt * 16 + (lane & 15);
        const int b_row = j * SW + (lane & 7) + ((lane >> 4) << 3);
        const int b_chk = (lane >> 3) & 1;
#pragma unroll 4
        for (int kk = 0; kk < KSTEPS; ++kk) {
            u32 a[4];
            ldsm_x4(a, s_q + swz(a_row, 2 * kk + (lane >> 4), ROWB));
#pragma unroll
            for (int p = 0; p < NB / 2; ++p) {
                u32 b[4];
                ldsm_x4(b, s_kv + swz(b_row + p * 16, 2 * kk + b_chk, ROWB));
                mma16816(s[2 * p], a[0], a[1], a[2], a[3], b[0], b[1]);
                mma16816(s[2 * p + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
            }
        }

        // ---- mask, scale, the m-tile's running max
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int t = t0 + j * SW + nb * 8 + 2 * tig + e;
                const int entry = t >> bs_log2;
                bool ok = t < t_end && entry < pt_width;
                if (ok) ok = (unsigned)pt_row[entry] < (unsigned)num_pages;
                s[nb][e] = ok && t < lim_a ? s[nb][e] * qk_scale : NEG_INF;
                s[nb][2 + e] = ok && t < lim_b ? s[nb][2 + e] * qk_scale : NEG_INF;
                mx0 = fmaxf(mx0, s[nb][e]);
                mx1 = fmaxf(mx1, s[nb][2 + e]);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const int r0 = mt * 16 + gid;
        if (tig == 0) {
            red_max[j * HB + r0] = mx0;
            red_max[j * HB + r0 + 8] = mx1;
        }
        mtile_sync(mt);
#pragma unroll
        for (int jj = 0; jj < J; ++jj) {
            mx0 = fmaxf(mx0, red_max[jj * HB + r0]);
            mx1 = fmaxf(mx1, red_max[jj * HB + r0 + 8]);
        }
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        // A row with no valid key yet keeps max -inf: exponents against 0 give p = 0, alpha = 0.
        const float mu0 = mn0 == NEG_INF ? 0.f : mn0, mu1 = mn1 == NEG_INF ? 0.f : mn1;
        const float alpha0 = exp2f(m0 - mu0), alpha1 = exp2f(m1 - mu1);
        m0 = mn0;
        m1 = mn1;
        l0 *= alpha0;
        l1 *= alpha1;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            const float p0 = exp2f(s[nb][0] - mu0), p1 = exp2f(s[nb][1] - mu0);
            const float p2 = exp2f(s[nb][2] - mu1), p3 = exp2f(s[nb][3] - mu1);
            l0 += p0 + p1;
            l1 += p2 + p3;
            const int tok = j * SW + nb * 8 + 2 * tig;
            const int ch = tok >> 3, byte = (tok & 7) * 2;
            const unsigned a0 = s_p + swz(gid, ch, PROWB) + byte;
            const unsigned a1 = s_p + swz(gid + 8, ch, PROWB) + byte;
            const u32 v01 = pack2(p0, p1), v23 = pack2(p2, p3);
            asm volatile("st.shared.u32 [%0], %1;" :: "r"(a0), "r"(v01) : "memory");
            asm volatile("st.shared.u32 [%0], %1;" :: "r"(a1), "r"(v23) : "memory");
        }
        mtile_sync(mt);  // the m-tile's P complete; its maxima read

        // ---- O = O * alpha + P V over this warp's output columns
#pragma unroll
        for (int n = 0; n < ON; ++n) {
            o[n][0] *= alpha0;
            o[n][1] *= alpha0;
            o[n][2] *= alpha1;
            o[n][3] *= alpha1;
        }
        const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3);
        const int v_chk = j * (CW / 8) + (lane >> 4);
#pragma unroll
        for (int ks = 0; ks < BN / 16; ++ks) {
            u32 a[4];
            ldsm_x4(a, s_p + swz(lane & 15, 2 * ks + (lane >> 4), PROWB));
#pragma unroll
            for (int q2 = 0; q2 < ON / 2; ++q2) {
                u32 b[4];
                ldsm_x4_trans(b, s_kv + swz(ks * 16 + v_row, v_chk + 2 * q2, ROWB));
                mma16816(o[2 * q2], a[0], a[1], a[2], a[3], b[0], b[1]);
                mma16816(o[2 * q2 + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
            }
        }
    }

    // ---- the m-tile's row sums: this warp's lanes, then its J warps
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const int r0 = mt * 16 + gid;
    mtile_sync(mt);  // every warp of the m-tile done reading red_max of the last tile
    if (tig == 0) {
        red_l[j * HB + r0] = l0;
        red_l[j * HB + r0 + 8] = l1;
    }
    mtile_sync(mt);
    float lt0 = 0.f, lt1 = 0.f;
#pragma unroll
    for (int jj = 0; jj < J; ++jj) {
        lt0 += red_l[jj * HB + r0];
        lt1 += red_l[jj * HB + r0 + 8];
    }
    // 1 / the row sum, times the dequantization scale of the values (1 for a 16-bit cache).
    const float kv_mul = kv_multiplier(kv_scale);
    const float inv0 = lt0 > 0.f ? kv_mul / lt0 : 0.f, inv1 = lt1 > 0.f ? kv_mul / lt1 : 0.f;
    const bool in_a = ra < qr.rows, in_b = rb < qr.rows;
    const int col0 = j * CW + 2 * tig;
    if (range.num_splits == 1) {
        u16* oa =
            out + row_offset(qr, ra, kvh, group_heads, out_token_stride, out_head_stride) + col0;
        u16* ob =
            out + row_offset(qr, rb, kvh, group_heads, out_token_stride, out_head_stride) + col0;
#pragma unroll
        for (int n = 0; n < ON; ++n) {
            if (in_a)
                *reinterpret_cast<u32*>(oa + n * 8) = pack2(o[n][0] * inv0, o[n][1] * inv0);
            if (in_b)
                *reinterpret_cast<u32*>(ob + n * 8) = pack2(o[n][2] * inv1, o[n][3] * inv1);
        }
    } else {
        const i64 base = (((i64)seq * max_splits + split) * num_kv_heads + kvh) * rows_per_seq;
        float* pa = part_o + (base + ra) * DV + col0;
        float* pb = part_o + (base + rb) * DV + col0;
#pragma unroll
        for (int n = 0; n < ON; ++n) {
            if (in_a)
                *reinterpret_cast<float2*>(pa + n * 8) = make_float2(o[n][0] * inv0, o[n][1] * inv0);
            if (in_b)
                *reinterpret_cast<float2*>(pb + n * 8) = make_float2(o[n][2] * inv1, o[n][3] * inv1);
        }
        if (j == 0 && tig == 0) {
            if (in_a) part_lse[base + ra] = lt0 > 0.f ? m0 + log2f(lt0) : NEG_INF;
            if (in_b) part_lse[base + rb] = lt1 > 0.f ? m1 + log2f(lt1) : NEG_INF;
        }
    }
}

// The split partials of one (query row, KV head, sequence) merged by log-sum-exp (log2
// domain): 128 threads, 4 columns each; blockIdx.x = kvh * rows_per_seq + row. A sequence of
// one split wrote `out` itself and is skipped, as are rows past the sequence's.
extern "C" __global__ void __launch_bounds__(128) mla_merge(
    const float* __restrict__ part_o, const float* __restrict__ part_lse, u16* __restrict__ out,
    i64 out_token_stride, i64 out_head_stride, const int* __restrict__ seq_lens,
    const int* __restrict__ qo_indptr, int group_heads, int num_kv_heads, int rows_per_seq,
    int chunk_tokens, int max_splits) {
    const int kvh = blockIdx.x / rows_per_seq, row = blockIdx.x - kvh * rows_per_seq;
    const int seq = blockIdx.y;
    const QueryRows qr = query_rows(qo_indptr, seq, group_heads);
    if (row >= qr.rows) return;
    const int n = num_splits_of(max(seq_lens[seq], 0), chunk_tokens, max_splits);
    if (n == 1) return;
    // Split s of this row at ((seq * max_splits + s) * num_kv_heads + kvh) * rows_per_seq + row.
    const i64 split_stride = (i64)num_kv_heads * rows_per_seq;
    const i64 base = (i64)seq * max_splits * split_stride + (i64)kvh * rows_per_seq + row;
    float mx = NEG_INF;
    for (int s = 0; s < n; ++s) mx = fmaxf(mx, part_lse[base + (i64)s * split_stride]);
    const int col = threadIdx.x * 4;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    float wsum = 0.f;
    if (mx != NEG_INF) {
        for (int s = 0; s < n; ++s) {
            const float w = exp2f(part_lse[base + (i64)s * split_stride] - mx);
            const float4 v = *reinterpret_cast<const float4*>(
                part_o + (base + (i64)s * split_stride) * DV + col);
            wsum += w;
            acc[0] += w * v.x;
            acc[1] += w * v.y;
            acc[2] += w * v.z;
            acc[3] += w * v.w;
        }
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    u16* o = out + row_offset(qr, row, kvh, group_heads, out_token_stride, out_head_stride) + col;
    *reinterpret_cast<u32*>(o) = pack2(acc[0] * inv, acc[1] * inv);
    *reinterpret_cast<u32*>(o + 2) = pack2(acc[2] * inv, acc[3] * inv);
}
