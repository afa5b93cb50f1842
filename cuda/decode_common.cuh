// Shared by paged_decode.cu and paged_decode_tc.cu: the 16-bit element types, conversions and
// cp.async group helpers. Inlined into each source by kernels/_build.py's read_source (an
// `#include "decode_common.cuh"` line), so NVRTC needs no include path. Needs KV_BF16 defined.

#define NEG_INF (-__int_as_float(0x7f800000))

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
