// Paged decode attention on tensor cores (mma.sync m16n8k16, fp16/bf16 in, fp32 accumulate).
//
// Same arguments, grid and split-KV partial format as paged_decode.cu (the merge_splits kernel
// below is the same code), so the host picks either kernel per call.
//
// One CTA per (split chunk, KV head x query-head tile, sequence); NWARPS warps split the
// chunk's tokens in 16-token tiles (warp w takes tiles w, w+NWARPS, ...). Each warp streams its
// own tiles of K and V (16 tokens x HEAD_DIM each) into its own shared-memory stages with
// cp.async, STAGES-1 tiles ahead, so the main loop needs no CTA barrier (a __syncwarp orders the
// warp's copies against its ldmatrix reads). Rows are stored with the 16-byte chunk index XORed
// by (row & 7), so ldmatrix reads are free of bank conflicts.
//
// Per tile and warp, with the query-head tile of gq <= 16 heads padded to the 16 rows of M:
//   S (16 heads x 16 tokens) = Q (16 x D, A fragments in registers) * K^T (B from ldmatrix);
//   online softmax in the log2 domain on the S accumulators (row = head);
//   O^T (D x 8*NH heads) += V^T (A from ldmatrix.trans) * P^T (B = the S accumulators packed to
//   16-bit, no shuffle: the m16n8 C layout of S is the k16n8 B layout of P^T).
// Keeping O transposed puts D in M, so a head tile of <= 8 (NH=1) wastes nothing in P.V and
// needs HEAD_DIM/4 accumulator registers per thread (NH=2: HEAD_DIM/2).
// At the end the NWARPS warp states (m, l, O) are merged through shared memory (the stage
// buffer), as in paged_decode.cu.
//
// Compile-time constants (NVRTC -D): KV_BF16, HEAD_DIM (64|128|256), BLOCK_SIZE (power of two,
// >= 2), NH (1: gq <= 8, 2: gq <= 16), NWARPS, STAGES. The head tile gq is a run-time argument.

#if !defined(KV_BF16) || !defined(HEAD_DIM) || !defined(BLOCK_SIZE) || !defined(NH) || \
    !defined(NWARPS) || !defined(STAGES)
#error "paged_decode_tc.cu needs KV_BF16, HEAD_DIM, BLOCK_SIZE, NH, NWARPS and STAGES defined"
#endif

#include "decode_common.cuh"

#define TILE 16                        // tokens per warp tile (the k of P.V, the n of Q.K^T)
#define CH (HEAD_DIM / 8)              // 16-byte chunks per row
#define ROWB (HEAD_DIM * 2)            // bytes per row
#define TILE_BYTES (TILE * ROWB)       // one K or V tile
#define PPL (TILE * CH / 32)           // 16-byte pieces per lane per K (or V) tile
#define RPI (32 / CH)                  // tile rows covered by one piece index (all lanes)
#define KSTEPS (HEAD_DIM / 16)
#define NTHREADS (NWARPS * 32)

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "HEAD_DIM must be 64, 128 or 256");
static_assert((BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0 && BLOCK_SIZE >= 8, "BLOCK_SIZE: power of two >= 8");
static_assert(NH == 1 || NH == 2, "NH must be 1 or 2");
static_assert(STAGES >= 2, "STAGES must be >= 2");

// Two floats -> one register of two 16-bit elements, `lo` in the low half (lower k index).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if KV_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

__device__ __forceinline__ void mma16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
#if KV_BF16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#endif
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(u32 (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

__device__ __forceinline__ void cp_async16(unsigned dst, const char* gmem, bool fill) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(gmem), "r"(fill ? 16 : 0) : "memory");
}

// Byte offset of (row, 16-byte chunk) inside a tile: chunks XOR-swizzled by row & 7.
__device__ __forceinline__ unsigned swz(int row, int chunk) {
    return (unsigned)(row * ROWB + ((chunk ^ (row & 7)) << 4));
}

extern "C" __global__ void __launch_bounds__(NTHREADS) paged_decode_tc(
    const u16* __restrict__ q, i64 q_seq_stride, i64 q_head_stride,
    u16* __restrict__ out, i64 out_seq_stride, i64 out_head_stride,
    float* __restrict__ part_o, float* __restrict__ part_lse,
    const char* __restrict__ k_base, const char* __restrict__ v_base,
    i64 block_stride, i64 token_stride, i64 head_stride, int num_blocks,
    const int* __restrict__ block_tables, i64 bt_stride, const int* __restrict__ seq_lens,
    int num_q_heads, int group, int gq, int chunk_tokens, int max_splits, float scale_log2) {
    const int split = blockIdx.x;
    const int n_tiles_h = group / gq;
    const int kvh = blockIdx.y / n_tiles_h;
    const int qh0 = kvh * group + (blockIdx.y % n_tiles_h) * gq;
    const int seq = blockIdx.z;
    const int len = seq_lens[seq];
    const int t_begin = split * chunk_tokens;
    if (split > 0 && t_begin >= len) return;  // merge_splits() reads only the splits that exist
    const int t_end = (split == max_splits - 1) ? len : min(len, t_begin + chunk_tokens);

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int gid = lane >> 2;  // mma group (row of A/C, column of B)
    const int tig = lane & 3;   // thread in group

    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned smem_base = (unsigned)__cvta_generic_to_shared(smem);
    const unsigned warp_smem = smem_base + (unsigned)(warp * STAGES * 2 * TILE_BYTES);

    // Q as A fragments (rows = heads of the tile; rows >= gq are zero). Scaling is applied to S.
    u32 qa[KSTEPS][4];
    {
        const u16* q_seq = q + seq * q_seq_stride;
        const bool r0 = gid < gq, r1 = gid + 8 < gq;
        const u16* p0 = q_seq + (i64)(qh0 + gid) * q_head_stride + tig * 2;
        const u16* p1 = q_seq + (i64)(qh0 + gid + 8) * q_head_stride + tig * 2;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            qa[kk][0] = r0 ? *reinterpret_cast<const u32*>(p0 + kk * 16) : 0u;
            qa[kk][2] = r0 ? *reinterpret_cast<const u32*>(p0 + kk * 16 + 8) : 0u;
            if (NH == 2) {
                qa[kk][1] = r1 ? *reinterpret_cast<const u32*>(p1 + kk * 16) : 0u;
                qa[kk][3] = r1 ? *reinterpret_cast<const u32*>(p1 + kk * 16 + 8) : 0u;
            } else {
                qa[kk][1] = qa[kk][3] = 0u;
            }
        }
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

    const int* bt = block_tables + seq * bt_stride;
    const int chunk = lane % CH;  // this lane's 16-byte column in every tile row it copies
    const char* k_lane = k_base + kvh * head_stride + chunk * 16;
    const char* v_lane = v_base + kvh * head_stride + chunk * 16;

    const int n_tiles = (t_end - t_begin + TILE - 1) / TILE;
    const int n_my = n_tiles > warp ? (n_tiles - warp + NWARPS - 1) / NWARPS : 0;
    unsigned okbits = 0;  // bits 2*stage, 2*stage+1: tokens 0-7 / 8-15 of that stage's blocks exist

    auto issue = [&](int j) {
        const int stage = j % STAGES;
        const int t0 = t_begin + (warp + j * NWARPS) * TILE;
        bool okA = false, okB = false;
        i64 offA = 0, offB = 0;
        if (j < n_my) {
            const int b0 = __ldg(bt + t0 / BLOCK_SIZE);
            okA = (unsigned)b0 < (unsigned)num_blocks;  // an entry outside the pool is skipped
            offA = (i64)b0 * block_stride + (i64)(t0 % BLOCK_SIZE) * token_stride;
            if (BLOCK_SIZE >= TILE) {
                okB = okA;
                offB = offA + 8 * token_stride;
            } else if (t0 + 8 < t_end) {  // BLOCK_SIZE 8: the second half is the next block
                const int b1 = __ldg(bt + t0 / BLOCK_SIZE + 1);
                okB = (unsigned)b1 < (unsigned)num_blocks;
                offB = (i64)b1 * block_stride;
            }
        }
        const unsigned sk = warp_smem + (unsigned)(stage * 2 * TILE_BYTES);
        if (j < n_my) {  // past the warp's last tile only an empty group is committed
#pragma unroll
        for (int i = 0; i < PPL; ++i) {
            const int row = i * RPI + lane / CH;
            const bool second = i * RPI >= 8;  // compile-time per i: RPI divides 8
            const bool ok = (t0 + row < t_end) && (second ? okB : okA);
            const i64 off = (second ? offB + (i64)(row - 8) * token_stride
                                    : offA + (i64)row * token_stride);
            const unsigned dst = sk + swz(row, chunk);
            cp_async16(dst, ok ? k_lane + off : k_lane, ok);
            cp_async16(dst + TILE_BYTES, ok ? v_lane + off : v_lane, ok);
        }
        }
        const unsigned sh = 2 * stage;
        okbits = (okbits & ~(3u << sh)) | (((unsigned)okA | ((unsigned)okB << 1)) << sh);
        cp_async_commit();
    };

#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) issue(j);

    // ldmatrix lane roles: matrix mi = lane / 8, row within it lane % 8.
    const int mi = lane >> 3, mr = lane & 7;
    // K (non-trans, B of Q.K^T): matrices (tok 0-7, chunk 2kk), (0-7, 2kk+1), (8-15, 2kk), (8-15, 2kk+1).
    const int k_row = mr + ((mi >> 1) << 3), k_cadd = mi & 1;
    // V (trans, A of V^T.P^T): (tok 0-7, chunk 2dd), (0-7, 2dd+1), (8-15, 2dd), (8-15, 2dd+1).
    const int v_row = mr + ((mi >> 1) << 3), v_cadd = mi & 1;

    for (int it = 0; it < n_my; ++it) {
        __syncwarp();  // every lane is done reading the stage the next issue overwrites
        issue(it + STAGES - 1);
        cp_async_wait<STAGES - 1>();  // this lane's copies of tile `it` have landed
        __syncwarp();                 // ... and every other lane's
        const int stage = it % STAGES;
        const unsigned sk = warp_smem + (unsigned)(stage * 2 * TILE_BYTES);
        const unsigned sv = sk + TILE_BYTES;
        const int t0 = t_begin + (warp + it * NWARPS) * TILE;
        const unsigned ok2 = okbits >> (2 * stage);

        // S = Q K^T: s[n-tile][c]: c0,c1 head gid, tokens nt*8+2*tig+{0,1}; c2,c3 head gid+8.
        float s[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[nt][i] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            u32 kb[4];
            ldsm_x4(kb, sk + swz(k_row, 2 * kk + k_cadd));
            mma16816(s[0], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], kb[0], kb[1]);
            mma16816(s[1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], kb[2], kb[3]);
        }

        // Online softmax per head row (h = 0: head gid, h = 1: head gid + 8).
        bool valid[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                valid[nt][e] = (t0 + nt * 8 + 2 * tig + e < t_end) && ((ok2 >> nt) & 1u);
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
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
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
            const float a0 = __shfl_sync(0xffffffffu, alpha[h], 8 * tig);
            const float a1 = __shfl_sync(0xffffffffu, alpha[h], 8 * tig + 4);
#pragma unroll
            for (int dd = 0; dd < KSTEPS; ++dd) {
                o[dd][h][0] *= a0;
                o[dd][h][1] *= a1;
                o[dd][h][2] *= a0;
                o[dd][h][3] *= a1;
            }
        }

        // O^T += V^T P^T.
#pragma unroll
        for (int dd = 0; dd < KSTEPS; ++dd) {
            u32 va[4];
            ldsm_x4_trans(va, sv + swz(v_row, 2 * dd + v_cadd));
#pragma unroll
            for (int h = 0; h < NH; ++h)
                mma16816(o[dd][h], va[0], va[1], va[2], va[3], pb[h][0], pb[h][1]);
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the stage buffer becomes the merge area

    // Per-warp state to shared memory: m, l per head; O[head][d].
    float* merge = reinterpret_cast<float*>(smem);
    float* s_m = merge;                                  // [NWARPS][16]
    float* s_l = merge + NWARPS * 16;                    // [NWARPS][16]
    float* s_acc = merge + 2 * NWARPS * 16;              // [NWARPS][16][HEAD_DIM]
#pragma unroll
    for (int h = 0; h < NH; ++h) {
        float lsum = l[h];
        lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
        lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
        if (tig == 0) {
            s_m[warp * 16 + h * 8 + gid] = m[h];
            s_l[warp * 16 + h * 8 + gid] = lsum;
        }
        const int hd0 = h * 8 + 2 * tig;
#pragma unroll
        for (int dd = 0; dd < KSTEPS; ++dd) {
            float* row0 = s_acc + ((i64)warp * 16 + hd0) * HEAD_DIM + dd * 16 + gid;
            row0[0] = o[dd][h][0];
            row0[HEAD_DIM] = o[dd][h][1];
            row0[8] = o[dd][h][2];
            row0[HEAD_DIM + 8] = o[dd][h][3];
        }
    }
    __syncthreads();

    for (int i = threadIdx.x; i < gq * HEAD_DIM; i += NTHREADS) {
        const int g = i / HEAD_DIM;
        const int d = i % HEAD_DIM;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) M = fmaxf(M, s_m[w * 16 + g]);
        float L = 0.f, O = 0.f;
        if (M != NEG_INF) {
#pragma unroll
            for (int w = 0; w < NWARPS; ++w) {
                const float wt = exp2f(s_m[w * 16 + g] - M);  // 0 for an empty warp (m = -inf)
                L = fmaf(wt, s_l[w * 16 + g], L);
                O = fmaf(wt, s_acc[(w * 16 + g) * HEAD_DIM + d], O);
            }
        }
        const float res = L > 0.f ? O / L : 0.f;
        const int qh = qh0 + g;
        if (part_o == nullptr) {
            out[seq * out_seq_stride + (i64)qh * out_head_stride + d] = f32_to_elem(res);
        } else {
            const i64 row = ((i64)seq * max_splits + split) * num_q_heads + qh;
            part_o[row * HEAD_DIM + d] = res;
            if (d == 0) part_lse[row] = L > 0.f ? M + log2f(L) : NEG_INF;
        }
    }
}
