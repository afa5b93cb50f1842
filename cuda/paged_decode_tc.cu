// Paged decode attention on tensor cores (mma.sync m16n8k16, fp16/bf16 in, fp32 accumulate),
// with the split-KV merge fused into the same launch.
//
// One CTA per (split chunk, KV head x query-head tile, sequence); NWARPS warps split the
// chunk's tokens in 16-token tiles (warp w takes tiles w, w+NWARPS, ...). Each warp streams its
// own tiles of K and V (16 tokens x DP columns each) into its own shared-memory stages with
// cp.async, STAGES-1 tiles ahead, so the main loop needs no CTA barrier (a __syncwarp orders the
// warp's copies against its ldmatrix reads).
//
// Head dims: the kernel is compiled per padded head dim DP (a multiple of 16, the mma K step);
// the real head_dim (a multiple of 8, <= DP) is a run-time argument. Columns head_dim..DP-1 of
// Q are zero in registers and those of K/V are zero-filled by cp.async (no global read), so the
// padding adds nothing to S and its O rows are never written.
//
// Block sizes: any power of two (run-time `bs_log2`). Lanes 0-15 (and 16-31, the same rows) each
// look up the block of one token row of the tile; a page of >= 16 tokens holds the whole tile
// (one table entry, read by every lane from the same address), a smaller page gives each row its
// own block id, which the copying lanes take by shuffle. Rows past the sequence end or whose
// table entry lies outside the pool are zero-filled and masked (a 16-bit row mask per stage).
//
// Per tile and warp, with the query-head tile of gq <= 16 heads padded to the 16 rows of M:
//   S (16 heads x 16 tokens) = Q (16 x DP, A fragments in registers) * K^T (B from ldmatrix);
//   online softmax in the log2 domain on the S accumulators (row = head);
//   O^T (DP x 8*NH heads) += V^T (A from ldmatrix.trans) * P^T (B = the S accumulators packed to
//   16-bit, no shuffle: the m16n8 C layout of S is the k16n8 B layout of P^T).
// At the end the NWARPS warp states (m, l, O) are merged through shared memory (the stage buffer).
//
// Split-KV: a sequence whose length needs one chunk writes `out` directly. Otherwise every CTA
// writes its normalised partial (part_o, part_lse in log2) to the workspace, then the last CTA to
// arrive for its (sequence, head tile) -- an atomic counter per (sequence, head tile) in the
// workspace, after a __threadfence -- merges the partials by log-sum-exp and writes `out`, and
// resets the counter to zero, so the workspace is reusable by the next launch (and by graph
// replays) without a memset. The counters must be zero before the first launch.
//
// FP8 caches (KV_FP8 = 1: float8_e4m3fn, 2: float8_e5m2; the host compiles them with KV_BF16 = 0
// and Q_BF16 = the query dtype): the cp.async stages hold the fp8 rows as they are in the cache
// (half the bytes of a 16-bit tile; rows padded, not swizzled); no ldmatrix and no fp16 copy of
// the tile: each lane reads its own fragment bytes with vector shared loads and converts fp8
// pairs to f16x2 in registers right before the mma (fp8_fragments.cuh: the dim permutation
// that makes a lane's bytes contiguous, for Q/K and for V/O). The mma runs in fp16. The fp8
// scales (per tensor or per KV head: this CTA's KV head) fold into the softmax scale (K) and
// into the output (V). bfloat16 queries are converted to fp16 in registers (exact for |q| in
// fp16's normal range, 6.1e-5 .. 65504). Needs head_dim % 16 == 0 (16-byte fp8 chunks; the
// host refuses other head dims).
//
// Sliding window / chunked local attention (WINDOW=1 modules; window and attn_chunk run-time,
// 0 = none, see decode_common.cuh's key_start): the query at position len - 1 sees keys
// [kv_lo, len); splits cut [kv_lo rounded down to a tile, len) and rows below kv_lo are masked
// without a load, so the pages before the window are never read. first_page (null: 0) makes the
// table rows window-relative: entry 0 is the sequence's page first_page[seq]; entries outside
// 0 .. bt_width - 1 are never read. Attention sinks (every module; sinks null: none): a
// per-query-head logit (natural log, the scaled q.k domain) added to the denominator once, in
// the direct output or in the fused merge, never in a split's partial.
//
// Compile-time constants (NVRTC -D): KV_BF16, DP (16..256, multiple of 16), NH (1: gq <= 8,
// 2: gq <= 16), NWARPS, STAGES (2..4), MAX_SPLITS (the most splits the host plans: the fused
// merge keeps MAX_SPLITS x 16 weights in shared memory), optionally KV_FP8, Q_BF16 and WINDOW.
// Everything else is a run-time argument.

#if !defined(KV_BF16) || !defined(DP) || !defined(NH) || !defined(NWARPS) || !defined(STAGES) || \
    !defined(MAX_SPLITS)
#error "paged_decode_tc.cu needs KV_BF16, DP, NH, NWARPS, STAGES and MAX_SPLITS defined"
#endif

#ifndef KV_FP8
#define KV_FP8 0
#endif
#ifndef WINDOW
#define WINDOW 0  // 1: sliding-window / chunked local attention and window-relative tables
#endif
#if KV_FP8 && KV_BF16
#error "fp8 caches run the fp16 tensor-core path: compile them with KV_BF16=0"
#endif

#include "decode_common.cuh"

#define TILE 16                                   // tokens per warp tile
#define CH (DP / 8)                               // 16-byte chunks per (padded) row
#define SCH ((CH % 8 == 0) ? CH : (CH | 1))       // shared-memory row stride in chunks
#define ROWB (SCH * 16)                           // shared-memory bytes per row
#define TILE_BYTES (TILE * ROWB)                  // one K or V tile
#define PPL (TILE * CH / 32)                      // 16-byte pieces per lane per K (or V) tile
#define KSTEPS (DP / 16)
#if KV_FP8
#include "fp8_fragments.cuh"
#define CH8 (DP / 16)                             // 16-byte fp8 chunks per row
#define PPL8 ((TILE * CH8 + 31) / 32)             // fp8 pieces per lane per K (or V) tile
#define K8_TILE_BYTES (TILE * K_ROW)              // one fp8 K tile (padded rows)
#define STAGE_BYTES (K8_TILE_BYTES + TILE * V_ROW)  // ... and the V tile after it
#else
#define STAGE_BYTES (2 * TILE_BYTES)
#endif
#define WARP_SMEM (STAGES * STAGE_BYTES)
#define NTHREADS (NWARPS * 32)
#define FULL 0xffffffffu

static_assert(DP % 16 == 0 && DP >= 16 && DP <= 256, "DP: a multiple of 16 in 16..256");
static_assert(NH == 1 || NH == 2, "NH must be 1 or 2");
static_assert(STAGES >= 2 && STAGES <= 4, "STAGES must be 2..4 (16 mask bits per stage in a u64)");
static_assert((TILE * CH) % 32 == 0, "pieces per tile must be a multiple of the warp size");
static_assert(WARP_SMEM * NWARPS >= 4 * MAX_SPLITS * 16,
              "the merge weights must fit in the stage buffer");

#include "mma_common.cuh"

// Loads of data other CTAs of this launch wrote: through L2, never a stale L1 line.
__device__ __forceinline__ float ld_cg(const float* p) {
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p) : "memory");
    return r;
}

// Q's 16-bit pairs as the mma's operand type: over an fp8 cache with bfloat16 queries, the pair
// converted to fp16 (the mma runs in fp16 there).
__device__ __forceinline__ u32 q_operand(u32 x) {
#if KV_FP8 && Q_BF16
    return pack2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
#else
    return x;
#endif
}

// Byte offset of (row, 16-byte chunk) inside a tile. Rows of a multiple of 8 chunks: chunks
// XOR-swizzled by row & 7; other rows: an odd row stride (SCH). Either way the 8 rows an
// ldmatrix reads at one chunk column land in 8 different 16-byte bank groups.
__device__ __forceinline__ unsigned swz(int row, int chunk) {
    if (CH % 8 == 0) return (unsigned)(row * ROWB + ((chunk ^ (row & 7)) << 4));
    return (unsigned)(row * ROWB + (chunk << 4));
}

extern "C" __global__ void __launch_bounds__(NTHREADS) paged_decode_tc(
    const u16* __restrict__ q, i64 q_seq_stride, i64 q_head_stride,
    u16* __restrict__ out, i64 out_seq_stride, i64 out_head_stride,
    float* __restrict__ part_o, float* __restrict__ part_lse, int* __restrict__ counters,
    const char* __restrict__ k_base, const char* __restrict__ v_base,
    i64 block_stride, i64 token_stride, i64 head_stride, int num_blocks, int bs_log2,
    const int* __restrict__ block_tables, i64 bt_stride, const int* __restrict__ seq_lens,
    int num_q_heads, int head_dim, int group, int gq, int chunk_tokens, int max_splits,
    float scale_log2, const int* __restrict__ first_page, int bt_width, int window, int attn_chunk,
    const float* __restrict__ sinks
#if KV_FP8
    , const float* __restrict__ k_scale, const float* __restrict__ v_scale, int scale_head_stride
#endif
    ) {
    const int split = blockIdx.x;
    const int n_tiles_h = (group + gq - 1) / gq;
    const int kvh = blockIdx.y / n_tiles_h;
    const int tile_h = blockIdx.y % n_tiles_h;
    const int qh0 = kvh * group + tile_h * gq;
    const int gq_here = min(gq, group - tile_h * gq);  // the last head tile may be shorter
    const int seq = blockIdx.z;
    const int len = seq_lens[seq];
    // Keys [kv_lo, len): the whole sequence, or its query's window / chunk (key_start). The
    // splits cut [kv_base, len), kv_base = kv_lo rounded down to a tile, so the work per query
    // is the window's, not the context's: no page before the window's is read (rows below kv_lo
    // are masked without a load). first_page (may be null: 0) is the sequence's page held by
    // table entry 0 (a window group's table holds only its live pages).
    // Compiled in only with WINDOW=1 (the modules of window plans): the full-attention modules
    // keep their register budget (several head widths sit at the 255-register limit).
#if WINDOW
    const int kv_lo = len > 0 ? key_start(len - 1, window, attn_chunk) : 0;
    const int kv_base = kv_lo & ~(TILE - 1);
    const int page0 = first_page != nullptr ? first_page[seq] : 0;
#else
    const int kv_base = 0;
#endif
    const SplitRange range = split_range(split, len - kv_base, chunk_tokens, max_splits);
    const int n_splits = range.num_splits;
    if (split >= n_splits) return;  // this sequence is shorter than the longest
    const int t_begin = kv_base + range.t_begin, t_end = kv_base + range.t_end;

#if KV_FP8
    // Dequantization folded: S uses k_scale through the softmax scale, O gets v_scale at the end.
    scale_log2 *= k_scale[kvh * scale_head_stride] * FP8_F16_SCALE;
    const float out_scale = v_scale[kvh * scale_head_stride] * FP8_F16_SCALE;
#else
    const float out_scale = 1.f;
#endif

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int gid = lane >> 2;  // mma group (row of A/C, column of B)
    const int tig = lane & 3;   // thread in group

    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned smem_base = (unsigned)__cvta_generic_to_shared(smem);
    const unsigned warp_smem = smem_base + (unsigned)(warp * WARP_SMEM);

    // Q as A fragments (rows = heads of the tile; rows >= gq_here and columns >= head_dim are
    // zero). Columns come in pairs (2*tig, 2*tig+1) and head_dim is even: one test per pair.
    u32 qa[KSTEPS][4];
    {
        const u16* q_seq = q + seq * q_seq_stride;
        const bool r0 = gid < gq_here, r1 = gid + 8 < gq_here;
        const u16* p0 = q_seq + (i64)(qh0 + gid) * q_head_stride + tig * 2;
        const u16* p1 = q_seq + (i64)(qh0 + gid + 8) * q_head_stride + tig * 2;
#if KV_FP8
        // fp8_fragments.cuh's dims: k-step kk takes dims k_dim .. k_dim + 3 (a0/a1: the first
        // pair, a2/a3: the second). head_dim is a multiple of 16: one test per k-step.
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            const int c = k_dim(kk, tig);
            const bool in = c < head_dim;
            qa[kk][0] = (r0 && in) ? q_operand(*reinterpret_cast<const u32*>(p0 - tig * 2 + c)) : 0u;
            qa[kk][2] =
                (r0 && in) ? q_operand(*reinterpret_cast<const u32*>(p0 - tig * 2 + c + 2)) : 0u;
            qa[kk][1] =
                (NH == 2 && r1 && in) ? q_operand(*reinterpret_cast<const u32*>(p1 - tig * 2 + c)) : 0u;
            qa[kk][3] = (NH == 2 && r1 && in)
                            ? q_operand(*reinterpret_cast<const u32*>(p1 - tig * 2 + c + 2)) : 0u;
        }
#else
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            const bool c0 = kk * 16 + tig * 2 < head_dim, c1 = kk * 16 + 8 + tig * 2 < head_dim;
            qa[kk][0] = (r0 && c0) ? q_operand(*reinterpret_cast<const u32*>(p0 + kk * 16)) : 0u;
            qa[kk][2] =
                (r0 && c1) ? q_operand(*reinterpret_cast<const u32*>(p0 + kk * 16 + 8)) : 0u;
            if (NH == 2) {
                qa[kk][1] =
                    (r1 && c0) ? q_operand(*reinterpret_cast<const u32*>(p1 + kk * 16)) : 0u;
                qa[kk][3] =
                    (r1 && c1) ? q_operand(*reinterpret_cast<const u32*>(p1 + kk * 16 + 8)) : 0u;
            } else {
                qa[kk][1] = qa[kk][3] = 0u;
            }
        }
#endif
    }

    float m[NH], l[NH];
    float o[KSTEPS][NH][4];  // O^T: [d tile][head tile][c0..c3]
#pragma unroll
    for (int h = 0; h < NH; ++h) {
        m[h] = NEG_INF;
        l[h] = 0.f;
#pragma unroll
        for (int dd = 0; dd < KSTEPS; ++dd)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[dd][h][i] = 0.f;
    }

    // The tokens this CTA may load: [row_lo, row_hi) = [t_begin, t_end) cut to the window's
    // start and to the positions whose pages the table row holds (entries 0 .. bt_width - 1 are
    // pages page0 ..). bt_page points at the entry of page 0 (page0 entries before the row), so
    // a token's entry is bt_page[token >> bs_log2]; only entries inside the row are read.
#if WINDOW
    const int row_lo = max(max(t_begin, kv_lo), (int)min((i64)page0 << bs_log2, (i64)INT_MAX_I));
    const int row_hi = (int)min((i64)t_end, ((i64)page0 + bt_width) << bs_log2);
    const int* bt_page = block_tables + seq * bt_stride - page0;
#else
    const int row_hi = t_end;  // the host checked that the rows hold every sequence's pages
    const int* bt_page = block_tables + seq * bt_stride;
#endif
    const char* k_head = k_base + kvh * head_stride;
    const char* v_head = v_base + kvh * head_stride;
    const int bs_mask = (1 << bs_log2) - 1;
    // A page of >= 16 tokens holds a whole tile when tiles start at multiples of 16 tokens (the
    // host plans chunks of a multiple of 64; any other chunk falls back to per-row look-ups).
    const bool one_block_per_tile = bs_log2 >= 4 && (t_begin & (TILE - 1)) == 0;
    const int d_chunks = head_dim >> 3;

#if WINDOW
    const int n_tiles = row_hi > row_lo ? (t_end - t_begin + TILE - 1) / TILE : 0;
#else
    const int n_tiles = (t_end - t_begin + TILE - 1) / TILE;
#endif
    const int n_my = n_tiles > warp ? (n_tiles - warp + NWARPS - 1) / NWARPS : 0;
    unsigned long long rowbits = 0;  // bits 16*stage + r: token row r of that stage is valid

    auto issue = [&](int j) {
        const int stage = j % STAGES;
        const int t0 = t_begin + (warp + j * NWARPS) * TILE;
        unsigned mask = 0;
        if (j < n_my) {  // uniform across the warp
            // This lane's token row (lane & 15): its block id and whether the row exists.
            // Rows outside [row_lo, row_hi) look up the page of the nearest row that exists
            // (the same page when one page holds the tile) and are missing: zero-filled and
            // masked, like a row whose table entry lies outside the pool.
            const int row_tok = t0 + (lane & 15);
#if WINDOW
            const int blk = __ldg(bt_page + (min(max(row_tok, row_lo), row_hi - 1) >> bs_log2));
            const bool row_ok =
                row_tok >= row_lo && row_tok < row_hi && (unsigned)blk < (unsigned)num_blocks;
#else
            const int blk = __ldg(bt_page + (min(row_tok, row_hi - 1) >> bs_log2));
            const bool row_ok = row_tok < row_hi && (unsigned)blk < (unsigned)num_blocks;
#endif
            mask = __ballot_sync(FULL, row_ok) & 0xffffu;
            const unsigned sk = warp_smem + (unsigned)(stage * STAGE_BYTES);
#if KV_FP8
#pragma unroll
            for (int i = 0; i < PPL8; ++i) {
                const int p = i * 32 + lane;
                const bool in_tile = p < TILE * CH8;  // false only in a last, partial round
                const int row = in_tile ? p / CH8 : 0, c = p % CH8;
                const int b = one_block_per_tile ? blk : __shfl_sync(FULL, blk, row);
                if (in_tile) {
                    const bool ok = ((mask >> row) & 1u) && c < (head_dim >> 4);
                    const i64 off = (i64)b * block_stride +
                                    (i64)((t0 + row) & bs_mask) * token_stride + c * 16;
                    const unsigned dk = sk + (unsigned)(row * K_ROW + c * 16);
                    const unsigned dv = sk + (unsigned)(K8_TILE_BYTES + row * V_ROW + c * 16);
                    cp_async16(dk, ok ? k_head + off : k_head, ok);
                    cp_async16(dv, ok ? v_head + off : v_head, ok);
                }
            }
#else
#pragma unroll
            for (int i = 0; i < PPL; ++i) {
                const int p = i * 32 + lane;
                const int row = p / CH, c = p % CH;  // compile-time divisors
                // Pages of >= 16 tokens: every row's block is this lane's; smaller: row's lane's.
                const int b = one_block_per_tile ? blk : __shfl_sync(FULL, blk, row);
                const bool ok = ((mask >> row) & 1u) && c < d_chunks;
                const i64 off = (i64)b * block_stride +
                                (i64)((t0 + row) & bs_mask) * token_stride + c * 16;
                const unsigned dst = sk + swz(row, c);
                cp_async16(dst, ok ? k_head + off : k_head, ok);
                cp_async16(dst + TILE_BYTES, ok ? v_head + off : v_head, ok);
            }
#endif
        }
        const unsigned sh = 16 * stage;
        rowbits = (rowbits & ~(0xffffull << sh)) | ((unsigned long long)mask << sh);
        cp_async_commit();  // past the warp's last tile an empty group keeps the count uniform
    };

#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) issue(j);

    // ldmatrix lane roles: matrix mi = lane / 8, row within it lane % 8. K (non-trans, B of
    // Q.K^T) and V (trans, A of V^T.P^T) use the same four matrices: (tok 0-7, chunk 2k),
    // (0-7, 2k+1), (8-15, 2k), (8-15, 2k+1).
    const int mi = lane >> 3, mr = lane & 7;
    const int ld_row = mr + ((mi >> 1) << 3), ld_cadd = mi & 1;

    for (int it = 0; it < n_my; ++it) {
        __syncwarp();  // every lane is done reading the stage the next issue overwrites
        issue(it + STAGES - 1);
        cp_async_wait<STAGES - 1>();  // this lane's copies of tile `it` have landed
        __syncwarp();                 // ... and every other lane's
        const int stage = it % STAGES;
#if KV_FP8
        // This lane's fragment bytes of the stage (fp8_fragments.cuh): K rows gid, 8 + gid;
        // V rows 2tig, 2tig+1, 2tig+8, 2tig+9.
        const unsigned char* k8 = smem + warp * WARP_SMEM + stage * STAGE_BYTES;
        const unsigned char* v8 = k8 + K8_TILE_BYTES;
#else
        const unsigned sk = warp_smem + (unsigned)(stage * STAGE_BYTES);
        const unsigned sv = sk + TILE_BYTES;
#endif
        const unsigned rows = (unsigned)(rowbits >> (16 * stage)) & 0xffffu;

        // S = Q K^T: s[n-tile][c]: c0,c1 head gid, tokens nt*8+2*tig+{0,1}; c2,c3 head gid+8.
        float s[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[nt][i] = 0.f;
#if KV_FP8
#pragma unroll
        for (int j = 0; j < K_UNITS; ++j) {
            u32 w[2][K_VW / 4];  // [n-tile] this lane's unit 4j + tig of token rows gid, 8 + gid
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
                lds_unit<K_VW>(k8 + (nt * 8 + gid) * K_ROW + (4 * j + tig) * K_VW, w[nt]);
#pragma unroll
            for (int e = 0; e < K_KPU; ++e) {
                const int kk = j * K_KPU + e;
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
                    mma16816(s[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3],
                             f16x2_of_fp8x2(w[nt][e]), f16x2_of_fp8x2(w[nt][e] >> 16));
            }
        }
#else
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            u32 kb[4];
            ldsm_x4(kb, sk + swz(ld_row, 2 * kk + ld_cadd));
            mma16816(s[0], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], kb[0], kb[1]);
            mma16816(s[1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], kb[2], kb[3]);
        }
#endif

        // Online softmax per head row (h = 0: head gid, h = 1: head gid + 8).
        bool valid[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) valid[nt][e] = (rows >> (nt * 8 + 2 * tig + e)) & 1u;
        u32 pb[NH][2];  // P^T as B fragments: [head tile][token half]
        float alpha[NH];
#pragma unroll
        for (int h = 0; h < NH; ++h) {
            float x[2][2];
            float mx = m[h];
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    x[nt][e] = valid[nt][e] ? s[nt][2 * h + e] * scale_log2 : NEG_INF;
                    mx = fmaxf(mx, x[nt][e]);
                }
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
            alpha[h] = (mx == NEG_INF) ? 1.f : exp2f(m[h] - mx);
            m[h] = mx;
            float p[2][2], sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    p[nt][e] = valid[nt][e] ? exp2f(x[nt][e] - mx) : 0.f;
                    sum += p[nt][e];
                }
            l[h] = l[h] * alpha[h] + sum;  // this lane's part; the quad is summed at the end
            pb[h][0] = pack2(p[0][0], p[0][1]);
            pb[h][1] = pack2(p[1][0], p[1][1]);
        }

        // Rescale O^T: its columns are heads h*8 + 2*tig + {0,1}, whose alpha lives in the quad
        // of lanes 4*(2*tig) and 4*(2*tig+1).
#pragma unroll
        for (int h = 0; h < NH; ++h) {
            const float a0 = __shfl_sync(FULL, alpha[h], 8 * tig);
            const float a1 = __shfl_sync(FULL, alpha[h], 8 * tig + 4);
#pragma unroll
            for (int dd = 0; dd < KSTEPS; ++dd) {
                o[dd][h][0] *= a0;
                o[dd][h][1] *= a1;
                o[dd][h][2] *= a0;
                o[dd][h][3] *= a1;
            }
        }

        // O^T += V^T P^T.
#if KV_FP8
#pragma unroll
        for (int u = 0; u < V_UNITS; ++u) {
            u32 w[4][V_WORDS];  // token rows 2tig, 2tig+1, 2tig+8, 2tig+9: unit 8u + gid
#pragma unroll
            for (int r = 0; r < 4; ++r)
                lds_unit<V_VW>(v8 + (2 * tig + (r & 1) + (r >> 1) * 8) * V_ROW + (8 * u + gid) * V_VW,
                               w[r]);
#pragma unroll
            for (int e = 0; e < V_DPU; ++e) {
                // Bytes 2e (A row gid) and 2e+1 (row gid + 8) of the unit, two tokens per half.
                const u32 sel = (e & 1) ? 0x7362u : 0x5140u;
                const u32 lo = __byte_perm(w[0][e / 2], w[1][e / 2], sel);  // tokens 2tig, +1
                const u32 hi = __byte_perm(w[2][e / 2], w[3][e / 2], sel);  // tokens 2tig+8, +9
                const u32 va0 = f16x2_of_fp8x2(lo), va1 = f16x2_of_fp8x2(lo >> 16);
                const u32 va2 = f16x2_of_fp8x2(hi), va3 = f16x2_of_fp8x2(hi >> 16);
#pragma unroll
                for (int h = 0; h < NH; ++h)
                    mma16816(o[u * V_DPU + e][h], va0, va1, va2, va3, pb[h][0], pb[h][1]);
            }
        }
#else
#pragma unroll
        for (int dd = 0; dd < KSTEPS; ++dd) {
            u32 va[4];
            ldsm_x4_trans(va, sv + swz(ld_row, 2 * dd + ld_cadd));
#pragma unroll
            for (int h = 0; h < NH; ++h)
                mma16816(o[dd][h], va[0], va[1], va[2], va[3], pb[h][0], pb[h][1]);
        }
#endif
    }
    cp_async_wait<0>();
    __syncthreads();  // the stage buffer becomes the merge area

    // Per-warp state to shared memory: m, l per head; O[head][d].
    float* merge = reinterpret_cast<float*>(smem);
    float* s_m = merge;                                  // [NWARPS][16]
    float* s_l = merge + NWARPS * 16;                    // [NWARPS][16]
    float* s_acc = merge + 2 * NWARPS * 16;              // [NWARPS][16][DP]
#pragma unroll
    for (int h = 0; h < NH; ++h) {
        float lsum = l[h];
        lsum += __shfl_xor_sync(FULL, lsum, 1);
        lsum += __shfl_xor_sync(FULL, lsum, 2);
        if (tig == 0) {
            s_m[warp * 16 + h * 8 + gid] = m[h];
            s_l[warp * 16 + h * 8 + gid] = lsum;
        }
        const int hd0 = h * 8 + 2 * tig;
#pragma unroll
        for (int dd = 0; dd < KSTEPS; ++dd) {
#if KV_FP8
            float* row0 = s_acc + (warp * 16 + hd0) * DP + v_dim(dd, 0, gid);
            const int half = v_dim(dd, 1, gid) - v_dim(dd, 0, gid);
#else
            float* row0 = s_acc + (warp * 16 + hd0) * DP + dd * 16 + gid;
            const int half = 8;
#endif
            row0[0] = o[dd][h][0];
            row0[DP] = o[dd][h][1];
            row0[half] = o[dd][h][2];
            row0[DP + half] = o[dd][h][3];
        }
    }
    __syncthreads();

    const bool direct = n_splits == 1;
    for (int i = threadIdx.x; i < gq_here * head_dim; i += NTHREADS) {
        const int g = i / head_dim;
        const int d = i - g * head_dim;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) M = fmaxf(M, s_m[w * 16 + g]);
        float L = 0.f, O = 0.f;
        if (M != NEG_INF) {
#pragma unroll
            for (int w = 0; w < NWARPS; ++w) {
                const float wt = exp2f(s_m[w * 16 + g] - M);  // 0 for an empty warp (m = -inf)
                L = fmaf(wt, s_l[w * 16 + g], L);
                O = fmaf(wt, s_acc[(w * 16 + g) * DP + d], O);
            }
        }
        const int qh = qh0 + g;
        // A sink (gpt-oss) joins the denominator only; a split's partial leaves it to the merge.
        const float den =
            (direct && sinks != nullptr && M != NEG_INF) ? L + exp2f(sinks[qh] * LOG2E_F - M) : L;
        const float res = den > 0.f ? O / den * out_scale : 0.f;
        if (direct) {
            out[seq * out_seq_stride + (i64)qh * out_head_stride + d] = f32_to_elem(res);
        } else {
            const i64 row = ((i64)seq * max_splits + split) * num_q_heads + qh;
            part_o[row * head_dim + d] = res;
            if (d == 0) part_lse[row] = L > 0.f ? M + log2f(L) : NEG_INF;
        }
    }
    if (direct) return;

    // Fused merge: the last CTA of this (sequence, head tile) to finish combines all partials.
    __shared__ int s_last;
    __threadfence();  // this thread's partial stores are visible device-wide before the count
    __syncthreads();
    if (threadIdx.x == 0) {
        int* counter = counters + (i64)seq * gridDim.y + blockIdx.y;
        const int arrived = atomicAdd(counter, 1);
        s_last = arrived == n_splits - 1;
        if (s_last) *counter = 0;  // every CTA of this tile has counted: reset for the next launch
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();  // order the partial loads below after the count that saw every arrival

    // Weights w[s][g] = exp2(lse_s - M_g) / L_g in shared memory (the stage buffer is free: every
    // read of s_acc above is behind the barrier), then out = sum_s w[s][g] * part_o[s][g].
    float* s_w = merge;  // [MAX_SPLITS][16]
    const i64 row0 = (i64)seq * max_splits * num_q_heads + qh0;
    for (int i = threadIdx.x; i < n_splits * gq_here; i += NTHREADS) {
        const int sp = i / gq_here, g = i - sp * gq_here;
        s_w[sp * 16 + g] = ld_cg(part_lse + row0 + (i64)sp * num_q_heads + g);
    }
    __syncthreads();
    if (threadIdx.x < gq_here) {
        const int g = threadIdx.x;
        float M = NEG_INF;
        for (int sp = 0; sp < n_splits; ++sp) M = fmaxf(M, s_w[sp * 16 + g]);
        float L = 0.f;
        if (M != NEG_INF) {
            for (int sp = 0; sp < n_splits; ++sp) L += exp2f(s_w[sp * 16 + g] - M);
            if (sinks != nullptr) L += exp2f(sinks[qh0 + g] * LOG2E_F - M);  // once, here
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
        for (int sp = 0; sp < n_splits; ++sp)
            s_w[sp * 16 + g] = M != NEG_INF ? exp2f(s_w[sp * 16 + g] - M) * inv : 0.f;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < gq_here * head_dim; i += NTHREADS) {
        const int g = i / head_dim;
        const int d = i - g * head_dim;
        const float* po = part_o + (row0 + g) * head_dim + d;
        const i64 step = (i64)num_q_heads * head_dim;
        float O = 0.f;
#pragma unroll 8
        for (int sp = 0; sp < n_splits; ++sp) O = fmaf(s_w[sp * 16 + g], ld_cg(po + sp * step), O);
        out[seq * out_seq_stride + (i64)(qh0 + g) * out_head_stride + d] = f32_to_elem(O);
    }
}
