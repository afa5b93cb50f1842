// append_kv: write the K and V rows of new tokens into their cache slots (16-bit caches; fp8
// caches: append_kv_fp8 below).
//
// One CTA per token; its threads copy the token's num_kv_heads rows of K and V in 16-byte
// pieces (row_vecs pieces per row). slot = block_id * block_size + offset; a slot < 0 (the
// null slot) or past the pool is skipped. The copy is byte-exact (no dtype conversion): the
// host wrapper checks that k/v have the pool's dtype. Cache addresses come from the layer's K or
// V slab base and the layout's byte strides.

typedef long long i64;

extern "C" __global__ void __launch_bounds__(128) append_kv(
    const char* __restrict__ k, i64 k_tok_stride, i64 k_head_stride,
    const char* __restrict__ v, i64 v_tok_stride, i64 v_head_stride,
    const i64* __restrict__ slot_mapping,
    char* __restrict__ k_base, char* __restrict__ v_base,
    i64 block_stride, i64 token_stride, i64 head_stride,
    int block_size, i64 num_slots, int num_heads, int row_vecs) {
    const i64 t = blockIdx.x;
    const i64 slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) return;
    const i64 dst = (slot / block_size) * block_stride + (slot % block_size) * token_stride;
    for (int i = threadIdx.x; i < num_heads * row_vecs; i += blockDim.x) {
        const int h = i / row_vecs;
        const int c = i % row_vecs;
        const i64 d = dst + h * head_stride + c * 16;
        *reinterpret_cast<uint4*>(k_base + d) =
            *reinterpret_cast<const uint4*>(k + t * k_tok_stride + h * k_head_stride + c * 16);
        *reinterpret_cast<uint4*>(v_base + d) =
            *reinterpret_cast<const uint4*>(v + t * v_tok_stride + h * v_head_stride + c * 16);
    }
}

// append_kv_fp8: the same walk for an fp8 cache, quantizing while writing. K/V come in as
// float16 (in_bf16 = 0) or bfloat16 (1); each element x is stored as fp8(x / scale), the division
// in float32 (IEEE, round to nearest), then round to nearest even, saturating to the largest
// finite value (infinities too), NaN -> 0x7f with its sign. fmt: 1 float8_e4m3fn, 2 float8_e5m2.
// Scales: k_scale[h * scale_head_stride] (stride 0: one per-tensor scale; 1: one per KV head).
// The conversion is integer arithmetic on the float32 bits, the same on every architecture, so
// the result is bit for bit the NumPy reference's (reference.quantize_fp8). One thread handles
// 8 elements: one 16-byte load of K (and of V), one 8-byte store each.

typedef unsigned int u32;
typedef unsigned long long u64;

// |x| as float32 bits `mag` -> fp8 code without sign, for a format of `mant` mantissa bits,
// exponent bias `bias`, largest finite code `max_code` and value `max_value`.
__device__ __forceinline__ u32 fp8_magnitude(u32 mag, int mant, int bias, u32 max_code,
                                             float max_value) {
    const float a = __uint_as_float(mag);
    if (a != a) return 0x7fu;                    // NaN
    if (a >= max_value) return max_code;          // saturate (infinity included)
    const int e = (int)(mag >> 23) - 127;
    const int min_normal_exp = 1 - bias;
    if (e < min_normal_exp) {
        // Subnormal target: a multiple of 2^(min_normal_exp - mant), rint = nearest even. The
        // result may be 1 << mant, which is the code of the smallest normal: still right.
        return (u32)__float2uint_rn(a * __int_as_float((127 + mant - min_normal_exp) << 23));
    }
    const int drop = 23 - mant;
    const u32 lsb = (mag >> drop) & 1u;
    const u32 rounded = (mag + ((1u << (drop - 1)) - 1u) + lsb) >> drop;
    const u32 code = rounded - ((u32)(127 - bias) << mant);
    return min(code, max_code);
}

__device__ __forceinline__ u32 to_fp8(float x, int fmt) {
    const u32 b = __float_as_uint(x);
    const u32 sign = (b >> 24) & 0x80u;
    const u32 mag = b & 0x7fffffffu;
    const u32 m = fmt == 1 ? fp8_magnitude(mag, 3, 7, 0x7eu, 448.f)
                           : fp8_magnitude(mag, 2, 15, 0x7bu, 57344.f);
    return sign | m;
}

__device__ __forceinline__ float elem_to_f32(unsigned short h, int in_bf16) {
    if (in_bf16) return __uint_as_float((u32)h << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// 8 elements (16 bytes) -> 8 fp8 codes (8 bytes), element 0 in the lowest byte.
__device__ __forceinline__ u64 quantize8(uint4 in, float scale, int in_bf16, int fmt) {
    const u32 w[4] = {in.x, in.y, in.z, in.w};
    u64 r = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const unsigned short h = (unsigned short)(w[i >> 1] >> (16 * (i & 1)));
        const float x = __fdiv_rn(elem_to_f32(h, in_bf16), scale);
        r |= (u64)to_fp8(x, fmt) << (8 * i);
    }
    return r;
}

extern "C" __global__ void __launch_bounds__(128) append_kv_fp8(
    const char* __restrict__ k, i64 k_tok_stride, i64 k_head_stride,
    const char* __restrict__ v, i64 v_tok_stride, i64 v_head_stride,
    const i64* __restrict__ slot_mapping,
    char* __restrict__ k_base, char* __restrict__ v_base,
    i64 block_stride, i64 token_stride, i64 head_stride,
    int block_size, i64 num_slots, int num_heads, int row_vecs,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, int scale_head_stride,
    int in_bf16, int fmt) {
    const i64 t = blockIdx.x;
    const i64 slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) return;
    const i64 dst = (slot / block_size) * block_stride + (slot % block_size) * token_stride;
    for (int i = threadIdx.x; i < num_heads * row_vecs; i += blockDim.x) {
        const int h = i / row_vecs;
        const int c = i % row_vecs;
        const i64 d = dst + h * head_stride + c * 8;
        const uint4 kin =
            *reinterpret_cast<const uint4*>(k + t * k_tok_stride + h * k_head_stride + c * 16);
        const uint4 vin =
            *reinterpret_cast<const uint4*>(v + t * v_tok_stride + h * v_head_stride + c * 16);
        *reinterpret_cast<u64*>(k_base + d) =
            quantize8(kin, k_scale[h * scale_head_stride], in_bf16, fmt);
        *reinterpret_cast<u64*>(v_base + d) =
            quantize8(vin, v_scale[h * scale_head_stride], in_bf16, fmt);
    }
}

// append_latent: write new tokens' MLA latent rows (c_kv then k_pe, row_vecs 16-byte pieces of
// 16-bit input, i.e. 8 * row_vecs elements) into one layer of an MLA group: slot = page *
// block_size + offset, the row at base + page * page_stride + offset * token_stride; a slot < 0
// or past the pool is skipped. fmt 0: a 16-bit cache, copied byte for byte; fmt 1 / 2: an fp8
// cache (e4m3 / e5m2), each element stored as fp8(x / scale[0]) exactly as append_kv_fp8 does
// (the layer's one scale; in_bf16 says what the input holds).
extern "C" __global__ void __launch_bounds__(128) append_latent(
    const char* __restrict__ latent, i64 tok_stride, const i64* __restrict__ slot_mapping,
    char* __restrict__ base, i64 page_stride, i64 token_stride, int block_size, i64 num_slots,
    int row_vecs, const float* __restrict__ scale, int in_bf16, int fmt) {
    const i64 t = blockIdx.x;
    const i64 slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) return;
    char* dst = base + (slot / block_size) * page_stride + (slot % block_size) * token_stride;
    const char* src = latent + t * tok_stride;
    for (int c = threadIdx.x; c < row_vecs; c += blockDim.x) {
        const uint4 in = *reinterpret_cast<const uint4*>(src + c * 16);
        if (fmt == 0) {
            *reinterpret_cast<uint4*>(dst + c * 16) = in;
        } else {
            *reinterpret_cast<u64*>(dst + c * 8) = quantize8(in, scale[0], in_bf16, fmt);
        }
    }
}
