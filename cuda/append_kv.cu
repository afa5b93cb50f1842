// append_kv: write the K and V rows of new tokens into their cache slots.
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
