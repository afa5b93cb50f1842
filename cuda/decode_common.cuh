// Shared by paged_decode.cu and paged_decode_tc.cu: the 16-bit element types, conversions,
// cp.async group helpers and the log-sum-exp merge of split-KV partials (both decode kernels
// write the same partial format). Inlined into each source by kernels/_build.py's
// read_source (an `#include "decode_common.cuh"` line), so NVRTC needs no include path.
// Needs KV_BF16 and HEAD_DIM defined.

#define NEG_INF (-__int_as_float(0x7f800000))

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

__device__ __forceinline__ u16 f32_to_elem(float f) {
    u16 r;
#if KV_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
    return r;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// Log-sum-exp merge of the split partials: one CTA per (query head, sequence), HEAD_DIM threads.
extern "C" __global__ void __launch_bounds__(HEAD_DIM) merge_splits(
    const float* __restrict__ part_o, const float* __restrict__ part_lse,
    u16* __restrict__ out, i64 out_seq_stride, i64 out_head_stride,
    const int* __restrict__ seq_lens, int num_q_heads, int chunk_tokens, int max_splits) {
    const int qh = blockIdx.x;
    const int seq = blockIdx.y;
    const int d = threadIdx.x;
    const int len = seq_lens[seq];
    const int n = max(1, min(max_splits, (len + chunk_tokens - 1) / chunk_tokens));
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
