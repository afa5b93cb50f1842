// Paged prefill (extend) attention on tensor cores (mma.sync m16n8k16, fp16/bf16 in, fp32
// accumulate), FlashAttention-2 style.
//
// A varlen batch: sequence i owns query tokens qo_indptr[i] .. qo_indptr[i+1] of q, which are the
// LAST qo_len_i of its seq_lens[i] context tokens (already in the cache). With `causal`, query
// token t (position prefix + t, prefix = seq_len - qo_len) sees keys 0 .. prefix + t; without it,
// every key of the context.
//
// Grid: x = work item (an int2 (sequence, first query token of the tile) of the host plan),
// y = KV head x query-head tile, z = KV split. One CTA of NWARPS warps owns M = 16 * NWARPS rows;
// row r is (query token q0 + r / gh, query head qh0 + r % gh), so every K/V tile loaded into
// shared memory serves all gh query heads of the GQA group that share it. Rows past the tile's
// q_tile_tokens * gh (or past the sequence's queries) are padding: computed, never written.
//
// Per CTA: Q (M x D) by cp.async into shared memory once; K and V tiles of BN tokens gathered
// through the block table by cp.async into STAGES stages (rows with their 16-byte chunks XORed
// by row & 7, so ldmatrix is conflict-free). Per tile and warp (16 rows):
//   S (16 x BN) = Q (A fragments; registers, or ldmatrix per step at D=256) * K^T (B, ldmatrix);
//   causal / length mask only on tiles that cross a row's limit; online softmax (log2 domain);
//   O (16 x D) += P (the S accumulators packed to 16-bit: the C layout of m16n8 is the A layout of
//   m16k16) * V (B, ldmatrix.trans).
// With gridDim.z > 1 each CTA covers one contiguous run of KV tiles and writes fp32 partials
// (O, log2-sum-exp) that merge_prefill_splits combines.
//
// FP8 caches (KV_FP8 = 1: float8_e4m3fn, 2: float8_e5m2; compiled with KV_BF16 = 0 and Q_BF16 =
// the query dtype): each thread loads its 8 fp8 bytes of a K/V row straight from global memory
// and stores them converted to fp16 into the same swizzled tile the 16-bit path fills by
// cp.async, so everything after the loads is the fp16 path (the simplest correct form; the
// loads are synchronous). bfloat16 queries are converted to fp16 after ldmatrix; the scales
// fold into the softmax scale (K) and the output (V), per tensor or per KV head.
// KV_FP8_ASYNC = 1 (fp8 only) makes those loads asynchronous: each thread cp.asyncs its 8 fp8
// bytes of a row into STAGES fp8 staging tiles (rows of HEAD_DIM bytes, after the fp16 tile),
// and once its own copies of tile j have landed converts exactly those bytes into a single fp16
// K/V tile (no barrier needed before the conversion: a thread reads only what it copied; the
// fp16 tile's previous readers are behind the loop's closing __syncthreads). Shared memory is
// the same as the synchronous form at STAGES = 2: one fp16 tile + two fp8 tiles = two fp16 tiles.
//
// Sliding window / chunked local attention (run-time window, attn_chunk; 0 = none; causal only,
// see decode_common.cuh's key_start): each row sees keys [key_start(pos), pos]; a CTA's KV tiles
// start at its first row's window start rounded down to BN, keys before it are not loaded, and
// a tile starting before its last row's start takes the lower mask too. first_page (null: 0):
// window-relative table rows (entry 0 is page first_page[seq]). Sinks (null: none): one logit
// per query head added to the row's denominator in the epilogue, or once in
// merge_prefill_splits when the keys are split (partials carry none).
//
// Compile-time constants (NVRTC -D): KV_BF16, HEAD_DIM (64|128|256), BLOCK_SIZE (power of two),
// NWARPS, BN (KV tile tokens, multiple of 16), STAGES, optionally KV_FP8 and Q_BF16.

#if !defined(KV_BF16) || !defined(HEAD_DIM) || !defined(BLOCK_SIZE) || !defined(NWARPS) || \
    !defined(BN) || !defined(STAGES)
#error "paged_prefill.cu needs KV_BF16, HEAD_DIM, BLOCK_SIZE, NWARPS, BN and STAGES defined"
#endif

#ifndef KV_FP8
#define KV_FP8 0
#endif
#if KV_FP8 && KV_BF16
#error "fp8 caches run the fp16 tensor-core path: compile them with KV_BF16=0"
#endif
#ifndef KV_FP8_ASYNC
#define KV_FP8_ASYNC 0
#endif
#if KV_FP8_ASYNC && !KV_FP8
#error "KV_FP8_ASYNC needs an fp8 cache (KV_FP8)"
#endif

#include "decode_common.cuh"
#if KV_FP8
#include "fp8_convert.cuh"
#endif

#define CH (HEAD_DIM / 8)             // 16-byte chunks per row
#define ROWB (HEAD_DIM * 2)           // bytes per row
#define NTHREADS (NWARPS * 32)
#define MROWS (16 * NWARPS)           // query rows (token x head) per CTA
#define Q_BYTES (MROWS * ROWB)
#define KV_TILE_BYTES (BN * ROWB)     // one K or V tile
#define KV_BUFS (KV_FP8_ASYNC ? 1 : STAGES)  // fp16 K/V tiles (async fp8: one, filled per tile)
#define STAGING_BYTES (BN * HEAD_DIM)  // one fp8 K or V staging tile (KV_FP8_ASYNC)
#define RPI (NTHREADS / CH)           // tile rows covered by one piece index (all threads)
#define KSTEPS (HEAD_DIM / 16)
#define NT (BN / 8)                   // n-tiles of S
#define DT (HEAD_DIM / 8)             // n-tiles of O
#define Q_IN_REGS (HEAD_DIM <= 128)   // D=256 re-reads Q fragments from shared memory per tile

#include "mma_common.cuh"

// Q's 16-bit pairs as the mma's operand type (bfloat16 queries over an fp8 cache: to fp16), and
// two output floats packed in the query dtype.
__device__ __forceinline__ u32 q_operand(u32 x) {
#if KV_FP8 && Q_BF16
    return pack2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
#else
    return x;
#endif
}

__device__ __forceinline__ u32 pack_out(float lo, float hi) {
#if KV_FP8 && Q_BF16
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return pack2(lo, hi);
#endif
}

#if KV_FP8_ASYNC
// 8 bytes global -> shared (through L1: cp.async.cg takes only 16); with fill false nothing is
// read and zeros are written.
__device__ __forceinline__ void cp_async8(unsigned dst, const char* gmem, bool fill) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;"
                 :: "r"(dst), "l"(gmem), "r"(fill ? 8 : 0) : "memory");
}
#endif

#if KV_FP8
// 8 fp8 codes (element i in byte i) -> 8 fp16 at a 16-byte shared-memory chunk.
__device__ __forceinline__ void store_fp8_as_f16(unsigned dst, uint2 x) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "r"(dst), "r"(f16x2_of_fp8x2(x.x)), "r"(f16x2_of_fp8x2(x.x >> 16)),
                    "r"(f16x2_of_fp8x2(x.y)), "r"(f16x2_of_fp8x2(x.y >> 16)) : "memory");
}
#endif

// Byte offset of (row, 16-byte chunk) inside a tile: chunks XOR-swizzled by row & 7, so the 8
// rows one ldmatrix matrix reads fall in 8 different bank groups.
__device__ __forceinline__ unsigned swz(int row, int chunk) {
    return (unsigned)(row * ROWB + ((chunk ^ (row & 7)) << 4));
}

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "HEAD_DIM must be 64, 128 or 256");
static_assert((BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0 && BLOCK_SIZE >= 1, "BLOCK_SIZE: power of two");
static_assert(BN % 16 == 0 && BN % RPI == 0 && MROWS % RPI == 0, "tile shape");
static_assert(STAGES >= 2, "STAGES must be >= 2");

extern "C" __global__ void __launch_bounds__(NTHREADS) paged_prefill(
    const u16* __restrict__ q, i64 q_tok_stride, i64 q_head_stride,
    u16* __restrict__ out, i64 out_tok_stride, i64 out_head_stride,
    float* __restrict__ part_o, float* __restrict__ part_lse,
    const char* __restrict__ k_base, const char* __restrict__ v_base,
    i64 block_stride, i64 token_stride, i64 head_stride, int num_blocks,
    const int* __restrict__ block_tables, i64 bt_stride, int bt_width,
    const int* __restrict__ seq_lens, const int* __restrict__ qo_indptr,
    const int2* __restrict__ work, int total_q, int num_q_heads, int group, int gh,
    int q_tile_tokens, int causal, float scale_log2, const int* __restrict__ first_page,
    int window, int attn_chunk, const float* __restrict__ sinks
#if KV_FP8
    , const float* __restrict__ k_scale, const float* __restrict__ v_scale, int scale_head_stride
#endif
    ) {
    const int2 item = work[blockIdx.x];
    const int seq = item.x;
    const int qt0 = item.y;  // first query token of the tile, relative to the sequence
    const int n_htiles = group / gh;
    const int kvh = blockIdx.y / n_htiles;
    const int qh0 = kvh * group + (blockIdx.y % n_htiles) * gh;
    const int split = blockIdx.z;
    const int num_splits = gridDim.z;
#if KV_FP8
    scale_log2 *= k_scale[kvh * scale_head_stride] * FP8_F16_SCALE;
    const float out_scale = v_scale[kvh * scale_head_stride] * FP8_F16_SCALE;
#else
    const float out_scale = 1.f;
#endif

    const int qo_begin = qo_indptr[seq];
    const int qo_len = qo_indptr[seq + 1] - qo_begin;
    const int len = seq_lens[seq];
    const int prefix = max(len - qo_len, 0);
    // Valid query tokens in this tile (never past q's total_q rows, whatever qo_indptr holds).
    const int q_tokens = min(min(q_tile_tokens, qo_len - qt0), total_q - qo_begin - qt0);

    // Keys this CTA's rows can see: [kv_lo, kv_total), kv_lo the first row's window / chunk
    // start (key_start; 0 without), then this split's share, in whole BN tiles from kv_lo's
    // tile on: the tiles (and pages) before the window are never touched, so the work per
    // query is the window's whatever the context. (Windows and chunks need causal: the host.)
    const int kv_total = causal ? min(len, prefix + qt0 + q_tokens) : len;
    const int kv_lo = causal ? key_start(prefix + qt0, window, attn_chunk) : 0;
    // Tiles starting before the last row's start need the lower mask.
    const int kv_lo_last = causal ? key_start(prefix + qt0 + max(q_tokens, 1) - 1, window, attn_chunk) : 0;
    const int kv_first = kv_lo / BN * BN;
    const int n_tiles_all = kv_total > kv_first ? (kv_total - kv_first + BN - 1) / BN : 0;
    const int tiles_per_split = (n_tiles_all + num_splits - 1) / num_splits;
    const int kv_begin = kv_first + split * tiles_per_split * BN;
    const int kv_end = min(kv_total, kv_begin + tiles_per_split * BN);
    const int n_tiles = kv_end > kv_begin ? (kv_end - kv_begin + BN - 1) / BN : 0;
    // Tiles ending at or before this key need no mask: every row sees all of them.
    const int kv_nomask = causal ? min(kv_end, prefix + qt0 + 1) : kv_end;
    // Table entry 0 holds page first_page[seq] of the sequence (a window group's table holds
    // only its live pages; null: 0).
    const int page0 = first_page != nullptr ? first_page[seq] : 0;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int gid = lane >> 2;  // mma group: row of A/C, column of B
    const int tig = lane & 3;   // thread in group

    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned s_q = (unsigned)__cvta_generic_to_shared(smem);
    const unsigned s_kv = s_q + Q_BYTES;  // KV_BUFS x (K tile, V tile)
#if KV_FP8_ASYNC
    const unsigned s_stage = s_kv + KV_BUFS * 2 * KV_TILE_BYTES;  // STAGES x (fp8 K, fp8 V)
#endif

    const int chunk = tid % CH;  // this thread's 16-byte column in every row it copies

    // Q rows -> shared memory (padding rows zero-filled). Commit group 0.
#pragma unroll
    for (int i = 0; i < MROWS / RPI; ++i) {
        const int row = i * RPI + tid / CH;
        const int t = row / gh;
        const bool ok = row < q_tile_tokens * gh && t < q_tokens;
        const u16* src = q + (i64)(qo_begin + qt0 + t) * q_tok_stride +
                         (i64)(qh0 + row % gh) * q_head_stride + chunk * 8;
        cp_async16(s_q + swz(row, chunk), ok ? reinterpret_cast<const char*>(src)
                                             : reinterpret_cast<const char*>(q), ok);
    }
    cp_async_commit();

    const int* bt = block_tables + (i64)seq * bt_stride;
#if KV_FP8
    const char* k_lane = k_base + kvh * head_stride + chunk * 8;  // 8 fp8 codes per chunk
    const char* v_lane = v_base + kvh * head_stride + chunk * 8;
#else
    const char* k_lane = k_base + kvh * head_stride + chunk * 16;
    const char* v_lane = v_base + kvh * head_stride + chunk * 16;
#endif

    // K and V of tile j (keys kv_begin + j*BN ...) into stage j % STAGES; one commit group per
    // call (empty past the last tile, so the wait counts stay uniform).
    auto issue = [&](int j) {
        if (j < n_tiles) {
            const int t0 = kv_begin + j * BN;
#if !KV_FP8_ASYNC
            const unsigned sk = s_kv + (unsigned)((j % KV_BUFS) * 2 * KV_TILE_BYTES);
#endif
#pragma unroll
            for (int i = 0; i < BN / RPI; ++i) {
                const int row = i * RPI + tid / CH;
                const int t = t0 + row;
                const int idx = t / BLOCK_SIZE - page0;
                // Keys before the window are not loaded (zeros, masked below); never outside
                // the table row.
                bool ok = t >= kv_lo && t < kv_end && (unsigned)idx < (unsigned)bt_width;
                i64 off = 0;
                if (ok) {
                    const int b = __ldg(bt + idx);
                    ok = (unsigned)b < (unsigned)num_blocks;  // an entry outside the pool reads zeros
                    off = (i64)b * block_stride + (i64)(t % BLOCK_SIZE) * token_stride;
                }
#if KV_FP8_ASYNC
                const unsigned st = s_stage + (unsigned)((j % STAGES) * 2 * STAGING_BYTES +
                                                         row * HEAD_DIM + chunk * 8);
                cp_async8(st, ok ? k_lane + off : k_lane, ok);
                cp_async8(st + STAGING_BYTES, ok ? v_lane + off : v_lane, ok);
#elif KV_FP8
                const unsigned dst = sk + swz(row, chunk);
                store_fp8_as_f16(dst, ok ? __ldg(reinterpret_cast<const uint2*>(k_lane + off))
                                         : make_uint2(0u, 0u));
                store_fp8_as_f16(dst + KV_TILE_BYTES,
                                 ok ? __ldg(reinterpret_cast<const uint2*>(v_lane + off))
                                    : make_uint2(0u, 0u));
#else
                const unsigned dst = sk + swz(row, chunk);
                cp_async16(dst, ok ? k_lane + off : k_lane, ok);
                cp_async16(dst + KV_TILE_BYTES, ok ? v_lane + off : v_lane, ok);
#endif
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) issue(j);

    // Row limits of this thread's two rows (gid and gid + 8 of the warp): keys lo_lim ..
    // lim - 1 (the window's or chunk's start, the exclusive causal bound).
    int lim[2], lo_lim[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = warp * 16 + gid + 8 * h;
        const int t = row / gh;
        lim[h] = causal ? min(kv_end, prefix + qt0 + t + 1) : kv_end;
        lo_lim[h] = causal ? key_start(prefix + qt0 + t, window, attn_chunk) : 0;
    }

    // ldmatrix lane roles: matrix mi = lane / 8, row mr = lane % 8 within it.
    const int mi = lane >> 3, mr = lane & 7;
    // Q (A of Q.K^T, non-trans): (rows 0-7, chunk 2kk), (8-15, 2kk), (0-7, 2kk+1), (8-15, 2kk+1).
    const int q_row = warp * 16 + mr + ((mi & 1) << 3), q_cadd = mi >> 1;
    // K (B of Q.K^T, non-trans): (keys 0-7, chunk 2kk), (0-7, 2kk+1), (8-15, 2kk), (8-15, 2kk+1).
    const int k_row = mr + ((mi >> 1) << 3), k_cadd = mi & 1;
    // V (B of P.V, trans): (keys 0-7, chunk 2dp), (8-15, 2dp), (0-7, 2dp+1), (8-15, 2dp+1).
    const int v_row = mr + ((mi & 1) << 3), v_cadd = mi >> 1;

#if Q_IN_REGS
    u32 qa[KSTEPS][4];
#endif
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float o[DT][4];
#pragma unroll
    for (int n = 0; n < DT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[n][i] = 0.f;

    for (int j = 0; j < n_tiles; ++j) {
        issue(j + STAGES - 1);
        cp_async_wait<STAGES - 1>();  // Q and tile j have landed (this thread's copies) ...
#if KV_FP8_ASYNC
        // ... this thread's staged fp8 bytes of tile j -> the fp16 tile (zero-filled rows: 0).
#pragma unroll
        for (int i = 0; i < BN / RPI; ++i) {
            const int row = i * RPI + tid / CH;
            const unsigned st = s_stage + (unsigned)((j % STAGES) * 2 * STAGING_BYTES +
                                                     row * HEAD_DIM + chunk * 8);
            uint2 kx, vx;
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(kx.x), "=r"(kx.y) : "r"(st));
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
                         : "=r"(vx.x), "=r"(vx.y) : "r"(st + STAGING_BYTES));
            store_fp8_as_f16(s_kv + swz(row, chunk), kx);
            store_fp8_as_f16(s_kv + KV_TILE_BYTES + swz(row, chunk), vx);
        }
#endif
        __syncthreads();              // ... and everyone's
#if Q_IN_REGS
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
                ldsm_x4(qa[kk], s_q + swz(q_row, 2 * kk + q_cadd));
#if KV_FP8 && Q_BF16
#pragma unroll
                for (int i = 0; i < 4; ++i) qa[kk][i] = q_operand(qa[kk][i]);
#endif
            }
        }
#endif
        const unsigned sk = s_kv + (unsigned)((j % KV_BUFS) * 2 * KV_TILE_BYTES);
        const unsigned sv = sk + KV_TILE_BYTES;
        const int t0 = kv_begin + j * BN;

        // S = Q K^T: s[nt][0,1] row gid, keys t0 + nt*8 + 2*tig + {0,1}; s[nt][2,3] row gid + 8.
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[nt][i] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
#if Q_IN_REGS
            const u32* a = qa[kk];
#else
            u32 a[4];
            ldsm_x4(a, s_q + swz(q_row, 2 * kk + q_cadd));
#if KV_FP8 && Q_BF16
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = q_operand(a[i]);
#endif
#endif
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                u32 kb[4];
                ldsm_x4(kb, sk + swz(np * 16 + k_row, 2 * kk + k_cadd));
                mma16816(s[2 * np], a[0], a[1], a[2], a[3], kb[0], kb[1]);
                mma16816(s[2 * np + 1], a[0], a[1], a[2], a[3], kb[2], kb[3]);
            }
        }

        const bool masked = t0 + BN > kv_nomask || t0 < kv_lo_last;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = m[h];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float x = s[nt][2 * h + e] * scale_log2;
                    const int key = t0 + nt * 8 + 2 * tig + e;
                    if (masked && (key >= lim[h] || key < lo_lim[h])) x = NEG_INF;
                    s[nt][2 * h + e] = x;
                    mx = fmaxf(mx, x);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float base = (mx == NEG_INF) ? 0.f : mx;  // a row with no key yet stays empty
            const float alpha = exp2f(m[h] - base);
            m[h] = mx;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = exp2f(s[nt][2 * h + e] - base);
                    s[nt][2 * h + e] = p;
                    sum += p;
                }
            l[h] = l[h] * alpha + sum;  // this lane's part; the quad is summed at the end
#pragma unroll
            for (int n = 0; n < DT; ++n) {
                o[n][2 * h] *= alpha;
                o[n][2 * h + 1] *= alpha;
            }
        }

        // O += P V, P's k16 step kt = keys 16kt .. 16kt+15 = S n-tiles 2kt, 2kt+1.
#pragma unroll
        for (int kt = 0; kt < BN / 16; ++kt) {
            const u32 a0 = pack2(s[2 * kt][0], s[2 * kt][1]);
            const u32 a1 = pack2(s[2 * kt][2], s[2 * kt][3]);
            const u32 a2 = pack2(s[2 * kt + 1][0], s[2 * kt + 1][1]);
            const u32 a3 = pack2(s[2 * kt + 1][2], s[2 * kt + 1][3]);
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                u32 vb[4];
                ldsm_x4_trans(vb, sv + swz(kt * 16 + v_row, 2 * dp + v_cadd));
                mma16816(o[2 * dp], a0, a1, a2, a3, vb[0], vb[1]);
                mma16816(o[2 * dp + 1], a0, a1, a2, a3, vb[2], vb[3]);
            }
        }
        __syncthreads();  // every warp is done with stage j % STAGES before it is refilled
    }
    cp_async_wait<0>();

    // Epilogue: this thread holds rows gid, gid + 8 of its warp, columns 8n + 2tig + {0,1}.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float lsum = l[h];
        lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
        lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
        const int row = warp * 16 + gid + 8 * h;
        const int t = row / gh;
        if (row >= q_tile_tokens * gh || t >= q_tokens) continue;
        const int tok = qo_begin + qt0 + t;
        const int qh = qh0 + row % gh;
        if (part_o == nullptr && sinks != nullptr && m[h] != NEG_INF)
            lsum += exp2f(sinks[qh] * LOG2E_F - m[h]);  // a sink joins the denominator only
        const float inv = lsum > 0.f ? out_scale / lsum : 0.f;
        if (part_o == nullptr) {
            u16* dst = out + (i64)tok * out_tok_stride + (i64)qh * out_head_stride + 2 * tig;
#pragma unroll
            for (int n = 0; n < DT; ++n)
                *reinterpret_cast<u32*>(dst + 8 * n) = pack_out(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
        } else {
            const i64 prow = ((i64)split * total_q + tok) * num_q_heads + qh;
            float* dst = part_o + prow * HEAD_DIM + 2 * tig;
#pragma unroll
            for (int n = 0; n < DT; ++n)
                *reinterpret_cast<float2*>(dst + 8 * n) = float2{o[n][2 * h] * inv, o[n][2 * h + 1] * inv};
            if (tig == 0) part_lse[prow] = lsum > 0.f ? m[h] + log2f(lsum) : NEG_INF;  // no sink
        }
    }
}

// Log-sum-exp merge of the KV-split partials: one CTA per (query token, query head), HEAD_DIM
// threads. Partials are [num_splits][total_q][num_q_heads] (O rows of HEAD_DIM, and the lse).
extern "C" __global__ void __launch_bounds__(HEAD_DIM) merge_prefill_splits(
    const float* __restrict__ part_o, const float* __restrict__ part_lse,
    u16* __restrict__ out, i64 out_tok_stride, i64 out_head_stride,
    int total_q, int num_q_heads, int num_splits, const float* __restrict__ sinks) {
    const int tok = blockIdx.x;
    const int qh = blockIdx.y;
    const int d = threadIdx.x;
    const i64 stride = (i64)total_q * num_q_heads;
    const i64 row0 = (i64)tok * num_q_heads + qh;
    float M = NEG_INF;
    for (int s = 0; s < num_splits; ++s) M = fmaxf(M, part_lse[row0 + s * stride]);
    float L = 0.f, O = 0.f;
    if (M != NEG_INF) {
        for (int s = 0; s < num_splits; ++s) {
            const i64 row = row0 + s * stride;
            const float w = exp2f(part_lse[row] - M);  // 0 for an empty split
            L += w;
            O = fmaf(w, part_o[row * HEAD_DIM + d], O);
        }
        if (sinks != nullptr) L += exp2f(sinks[qh] * LOG2E_F - M);  // the sink, once per row
    }
    out[(i64)tok * out_tok_stride + (i64)qh * out_head_stride + d] = f32_to_elem(L > 0.f ? O / L : 0.f);
}
