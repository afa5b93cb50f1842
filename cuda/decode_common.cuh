// Shared by paged_decode.cu and paged_decode_tc.cu: the 16-bit element types, conversions,
// cp.async group helpers and the split of a sequence's tokens between CTAs. Inlined into each source by kernels/_build.py's read_source (an
// `#include "decode_common.cuh"` line), so NVRTC needs no include path. Needs KV_BF16 defined.

#define NEG_INF (-__int_as_float(0x7f800000))
#define INT_MAX_I 0x7fffffff

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// The query/output element type: the cache's, except over an fp8 cache (Q_BF16 set by the host).
#ifndef Q_BF16
#define Q_BF16 KV_BF16
#endif

__device__ __forceinline__ u16 f32_to_elem(float f) {
    u16 r;
#if Q_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
    return r;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// Split `split` of a sequence of `len` tokens reads tokens [t_begin, t_end): chunks of
// chunk_tokens, at most max_splits of them, the last taking whatever is left (so a short planned
// chunk never drops a token). num_splits (>= 1) is how many splits the sequence has, the ones
// the merge combines; a CTA whose split is not below it has nothing to read.
struct SplitRange {
    int num_splits, t_begin, t_end;
};

__device__ __forceinline__ int num_splits_of(int len, int chunk_tokens, int max_splits) {
    return max(1, min(max_splits, (len + chunk_tokens - 1) / chunk_tokens));
}

__device__ __forceinline__ SplitRange split_range(int split, int len, int chunk_tokens, int max_splits) {
    SplitRange r;
    r.num_splits = num_splits_of(len, chunk_tokens, max_splits);
    r.t_begin = split * chunk_tokens;
    r.t_end = (split == r.num_splits - 1) ? len : min(len, r.t_begin + chunk_tokens);
    return r;
}

// Sliding-window and chunked local attention (run-time arguments; 0 = not this kind): the first
// key position the query at `pos` sees; its last is `pos`. window w (transformers'
// sliding_window of gpt-oss / Gemma 3, `kv_idx > q_idx - w`): keys (pos - w, pos]; chunk c
// (Llama 4): keys [pos / c * c, pos]; neither: 0. The host never sets both.
__device__ __forceinline__ int key_start(int pos, int window, int chunk) {
    if (window > 0) return max(pos - window + 1, 0);
    if (chunk > 0) return pos / chunk * chunk;
    return 0;
}

#define LOG2E_F 1.4426950408889634f  // attention sinks are natural-log logits; kernels use exp2
