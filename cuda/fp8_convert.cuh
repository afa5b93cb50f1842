// fp8 pair -> f16x2 conversion shared by the fp8 decode (fp8_fragments.cuh) and the fp8
// prefill (paged_prefill.cu). Inlined like decode_common.cuh (needs it first, and KV_FP8 set:
// 1 float8_e4m3fn, 2 float8_e5m2).
//
// sm_89+ converts in hardware (cvt ... e4m3x2 / e5m2x2: exact, the low byte to the low half).
// Older GPUs by integer ops: the code goes to the high byte of a half, which for e5m2 is its
// fp16 already; for e4m3 the sign stays and exponent + mantissa move right by one bit, giving
// value / 256 exactly (subnormals too; FP8_F16_SCALE undoes it through the scales). An e4m3
// NaN code (never written by append_kv) reads as 480 there.
#if __CUDA_ARCH__ >= 890
#define FP8_F16_SCALE 1.f
#else
#define FP8_F16_SCALE (KV_FP8 == 1 ? 256.f : 1.f)
#endif

// Two fp8 codes in the low 16 bits of `x` (the lower element in the low byte) -> f16x2.
__device__ __forceinline__ u32 f16x2_of_fp8x2(u32 x) {
#if __CUDA_ARCH__ >= 890
    u32 r;
    const u16 two = (u16)x;
#if KV_FP8 == 1
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(two));
#else
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r) : "h"(two));
#endif
    return r;
#else
    const u32 h = __byte_perm(x, 0u, 0x1404);
#if KV_FP8 == 1
    return (h & 0x80008000u) | ((h >> 1) & 0x3f803f80u);
#else
    return h;
#endif
#endif
}
