// Paged decode attention: one query token per sequence against its paged K/V.
//
// One CTA per (split chunk, KV head x query-head tile, sequence). The CTA reads each K/V row of
// its KV head once and scores it against the GQ query heads that share the head, so K/V leave
// device memory once per KV head (not once per query head). A row of HEAD_DIM elements is read
// by TPT = HEAD_DIM/8 lanes with one 16-byte load each; the 32/TPT subgroups of a warp take
// consecutive tokens. Every subgroup keeps its own online-softmax state (running max m, sum l,
// accumulator acc) in registers, in the log2 domain (q is pre-scaled by scale*log2(e)); the
// NSG subgroup states are merged through shared memory once, at the end.
//
// Split-KV (flash-decoding): the host plans chunk_tokens so that the grid fills the GPU. With
// one split the CTA writes the output; with several, each writes its normalised partial output
// and log2-sum-exp to part_o/part_lse and merge_splits() combines them.
//
// Loads: with PIPELINE=1 each thread streams its own 16-byte pieces into its own shared-memory
// slots with cp.async, STAGES loop trips ahead (zero-filled for masked tokens), so no barrier is
// needed in the loop and many loads stay in flight; with PIPELINE=0 it loads straight into
// registers. The merge area reuses the stage buffer (dynamic shared memory, sized by the host).
//
// Compile-time constants (NVRTC -D): KV_BF16 (0 float16, 1 bfloat16), HEAD_DIM (64|128|256),
// BLOCK_SIZE (tokens per KV block, power of two), GQ (query heads per CTA), NWARPS, PIPELINE.
// Addresses come only from the arguments: the slab base of the layer's K or V and the layout's
// byte strides (block, token, head), exactly as KvLayout.strides() reports them.

#if !defined(KV_BF16) || !defined(HEAD_DIM) || !defined(BLOCK_SIZE) || !defined(GQ) || \
    !defined(NWARPS) || !defined(PIPELINE)
#error "paged_decode.cu needs KV_BF16, HEAD_DIM, BLOCK_SIZE, GQ, NWARPS and PIPELINE defined"
#endif

#include "decode_common.cuh"

#define TPT (HEAD_DIM / 8)
#define SGW (32 / TPT)
#define NSG (NWARPS * SGW)
#define NTHREADS (NWARPS * 32)
#define UNROLL (GQ <= 2 ? 8 : (GQ <= 4 ? 4 : 2))
// Loop trips in flight: about 12 token slots per thread (48 KB per CTA at 128 threads).
#define STAGES (PIPELINE ? (12 / UNROLL < 2 ? 2 : 12 / UNROLL) : 0)
#define MERGE_FLOATS (NSG * GQ * (HEAD_DIM + 2))

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "HEAD_DIM must be 64, 128 or 256");
static_assert((BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0, "BLOCK_SIZE must be a power of two");
static_assert(GQ >= 1 && GQ <= 8, "GQ must be in 1..8");

__device__ __forceinline__ float elem_to_f32(u16 x) {
#if KV_BF16
    return __uint_as_float(((u32)x) << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#endif
}

// 8 packed 16-bit elements -> 8 floats.
__device__ __forceinline__ void unpack8(const uint4 v, float* f) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#if KV_BF16
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
#else
        f[2 * i] = elem_to_f32((u16)(w[i] & 0xffffu));
        f[2 * i + 1] = elem_to_f32((u16)(w[i] >> 16));
#endif
    }
}

// 16-byte read-only load that does not allocate in L1: every K/V byte is read exactly once.
__device__ __forceinline__ uint4 ld_stream16(const char* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

__device__ __forceinline__ void cp_async16(void* smem, const char* gmem, bool fill) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(gmem), "r"(fill ? 16 : 0) : "memory");
}

// One loop trip's arithmetic: score UNROLL tokens against GQ heads, update the online softmax.
__device__ __forceinline__ void consume(const uint4 (&kr)[UNROLL], const uint4 (&vr)[UNROLL],
                                        const bool (&valid)[UNROLL], const float (&qf)[GQ][8],
                                        float (&m)[GQ], float (&l)[GQ], float (&acc)[GQ][8]) {
    float s[UNROLL][GQ];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        float kf[8];
        unpack8(kr[u], kf);
#pragma unroll
        for (int g = 0; g < GQ; ++g) {
            float d = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) d = fmaf(qf[g][i], kf[i], d);
            s[u][g] = d;
        }
    }
    // Sum the partial dot products over the TPT lanes of each subgroup.
#pragma unroll
    for (int o = TPT / 2; o > 0; o >>= 1) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int g = 0; g < GQ; ++g) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], o);
        }
    }
    float p[UNROLL][GQ];
#pragma unroll
    for (int g = 0; g < GQ; ++g) {
        float mx = m[g];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) mx = valid[u] ? fmaxf(mx, s[u][g]) : mx;
        const float alpha = (mx == NEG_INF) ? 1.f : exp2f(m[g] - mx);
        m[g] = mx;
        l[g] *= alpha;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] *= alpha;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            p[u][g] = valid[u] ? exp2f(s[u][g] - mx) : 0.f;
            l[g] += p[u][g];
        }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        float vf[8];
        unpack8(vr[u], vf);
#pragma unroll
        for (int g = 0; g < GQ; ++g) {
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(p[u][g], vf[i], acc[g][i]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(NTHREADS) paged_decode(
    const u16* __restrict__ q, i64 q_seq_stride, i64 q_head_stride,
    u16* __restrict__ out, i64 out_seq_stride, i64 out_head_stride,
    float* __restrict__ part_o, float* __restrict__ part_lse,
    const char* __restrict__ k_base, const char* __restrict__ v_base,
    i64 block_stride, i64 token_stride, i64 head_stride, int num_blocks,
    const int* __restrict__ block_tables, i64 bt_stride, const int* __restrict__ seq_lens,
    int num_q_heads, int group, int chunk_tokens, int max_splits, float scale_log2) {
    const int split = blockIdx.x;
    const int n_tiles = group / GQ;
    const int kvh = blockIdx.y / n_tiles;
    const int qh0 = kvh * group + (blockIdx.y % n_tiles) * GQ;
    const int seq = blockIdx.z;
    const int len = seq_lens[seq];
    const SplitRange range = split_range(split, len, chunk_tokens, max_splits);
    if (split >= range.num_splits) return;  // merge_splits() reads only the splits that exist
    const int t_begin = range.t_begin, t_end = range.t_end;

    const int lane = threadIdx.x & 31;
    const int dl = lane % TPT;                               // which 8 elements of the row
    const int sg = (threadIdx.x >> 5) * SGW + lane / TPT;   // token subgroup in the CTA

    float qf[GQ][8];
#pragma unroll
    for (int g = 0; g < GQ; ++g) {
        const u16* qp = q + seq * q_seq_stride + (i64)(qh0 + g) * q_head_stride + dl * 8;
        unpack8(*reinterpret_cast<const uint4*>(qp), qf[g]);
#pragma unroll
        for (int i = 0; i < 8; ++i) qf[g][i] *= scale_log2;
    }

    float m[GQ], l[GQ], acc[GQ][8];
#pragma unroll
    for (int g = 0; g < GQ; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
    }

    const int* bt = block_tables + seq * bt_stride;
    const char* k_head = k_base + kvh * head_stride + dl * 16;
    const char* v_head = v_base + kvh * head_stride + dl * 16;

#if PIPELINE
    extern __shared__ __align__(16) uint4 stage_buf[];  // [STAGES][UNROLL][K|V][NTHREADS]
    const int n_iters = (t_end - t_begin + NSG * UNROLL - 1) / (NSG * UNROLL);
    unsigned vmask = 0;  // bit stage*UNROLL+u: token u of the trip held in `stage` is real
    auto issue = [&](int it) {
        const int stage = it % STAGES;
        unsigned bits = 0;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = t_begin + it * (NSG * UNROLL) + u * NSG + sg;
            i64 off = 0;
            bool ok = false;
            if (it < n_iters && t < t_end) {
                const int blk = __ldg(bt + t / BLOCK_SIZE);
                // An entry outside the pool is skipped rather than dereferenced.
                ok = (unsigned)blk < (unsigned)num_blocks;
                if (ok) off = (i64)blk * block_stride + (i64)(t % BLOCK_SIZE) * token_stride;
            }
            uint4* slot = stage_buf + ((stage * UNROLL + u) * 2) * NTHREADS + threadIdx.x;
            cp_async16(slot, k_head + off, ok);
            cp_async16(slot + NTHREADS, v_head + off, ok);
            bits |= (unsigned)ok << u;
        }
        const unsigned field = ((1u << UNROLL) - 1u) << (stage * UNROLL);
        vmask = (vmask & ~field) | (bits << (stage * UNROLL));
        cp_async_commit();
    };
#pragma unroll
    for (int it = 0; it < STAGES - 1; ++it) issue(it);
    for (int it = 0; it < n_iters; ++it) {
        issue(it + STAGES - 1);
        cp_async_wait<STAGES - 1>();  // this thread's copies for trip `it` have landed
        const int stage = it % STAGES;
        uint4 kr[UNROLL], vr[UNROLL];
        bool valid[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint4* slot = stage_buf + ((stage * UNROLL + u) * 2) * NTHREADS + threadIdx.x;
            kr[u] = slot[0];
            vr[u] = slot[NTHREADS];
            valid[u] = (vmask >> (stage * UNROLL + u)) & 1u;
        }
        consume(kr, vr, valid, qf, m, l, acc);
    }
    cp_async_wait<0>();
    __syncthreads();  // the stage buffer becomes the merge area
    float* merge = reinterpret_cast<float*>(stage_buf);
#else
    for (int t0 = t_begin; t0 < t_end; t0 += NSG * UNROLL) {
        uint4 kr[UNROLL], vr[UNROLL];
        bool valid[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = t0 + u * NSG + sg;
            valid[u] = false;
            kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
            if (t < t_end) {
                const int blk = __ldg(bt + t / BLOCK_SIZE);
                // An entry outside the pool is skipped rather than dereferenced.
                if ((unsigned)blk < (unsigned)num_blocks) {
                    const i64 off = (i64)blk * block_stride + (i64)(t % BLOCK_SIZE) * token_stride;
                    kr[u] = ld_stream16(k_head + off);
                    vr[u] = ld_stream16(v_head + off);
                    valid[u] = true;
                }
            }
        }
        consume(kr, vr, valid, qf, m, l, acc);
    }
    __shared__ __align__(16) float merge[MERGE_FLOATS];
#endif

    // Merge the NSG subgroup states of the CTA.
    float (*s_m)[GQ] = reinterpret_cast<float (*)[GQ]>(merge);
    float (*s_l)[GQ] = reinterpret_cast<float (*)[GQ]>(merge + NSG * GQ);
    float (*s_acc)[GQ][HEAD_DIM] = reinterpret_cast<float (*)[GQ][HEAD_DIM]>(merge + 2 * NSG * GQ);
#pragma unroll
    for (int g = 0; g < GQ; ++g) {
        if (dl == 0) {
            s_m[sg][g] = m[g];
            s_l[sg][g] = l[g];
        }
        float4* dst = reinterpret_cast<float4*>(&s_acc[sg][g][dl * 8]);
        dst[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
        dst[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
    }
    __syncthreads();

    for (int i = threadIdx.x; i < GQ * HEAD_DIM; i += NTHREADS) {
        const int g = i / HEAD_DIM;
        const int d = i % HEAD_DIM;
        float M = NEG_INF;
#pragma unroll
        for (int j = 0; j < NSG; ++j) M = fmaxf(M, s_m[j][g]);
        float L = 0.f, O = 0.f;
        if (M != NEG_INF) {
#pragma unroll
            for (int j = 0; j < NSG; ++j) {
                const float w = exp2f(s_m[j][g] - M);  // 0 for an empty subgroup (m = -inf)
                L = fmaf(w, s_l[j][g], L);
                O = fmaf(w, s_acc[j][g][d], O);
            }
        }
        const float o = L > 0.f ? O / L : 0.f;
        const int qh = qh0 + g;
        if (part_o == nullptr) {
            out[seq * out_seq_stride + (i64)qh * out_head_stride + d] = f32_to_elem(o);
        } else {
            const i64 row = ((i64)seq * max_splits + split) * num_q_heads + qh;
            part_o[row * HEAD_DIM + d] = o;
            if (d == 0) part_lse[row] = L > 0.f ? M + log2f(L) : NEG_INF;
        }
    }
}

// Log-sum-exp merge of the split partials: one CTA per (query head, sequence), HEAD_DIM threads.
extern "C" __global__ void __launch_bounds__(HEAD_DIM) merge_splits(
    const float* __restrict__ part_o, const float* __restrict__ part_lse,
    u16* __restrict__ out, i64 out_seq_stride, i64 out_head_stride,
    const int* __restrict__ seq_lens, int num_q_heads, int chunk_tokens, int max_splits) {
    const int qh = blockIdx.x;
    const int seq = blockIdx.y;
    const int d = threadIdx.x;
    const int len = seq_lens[seq];
    const int n = num_splits_of(len, chunk_tokens, max_splits);
    const i64 row0 = (i64)seq * max_splits * num_q_heads + qh;
    float M = NEG_INF;
    for (int s = 0; s < n; ++s) M = fmaxf(M, part_lse[row0 + (i64)s * num_q_heads]);
    float L = 0.f, O = 0.f;
    if (M != NEG_INF) {
        for (int s = 0; s < n; ++s) {
            const i64 row = row0 + (i64)s * num_q_heads;
            const float w = exp2f(part_lse[row] - M);
            L += w;
            O = fmaf(w, part_o[row * HEAD_DIM + d], O);
        }
    }
    out[seq * out_seq_stride + (i64)qh * out_head_stride + d] = f32_to_elem(L > 0.f ? O / L : 0.f);
}
