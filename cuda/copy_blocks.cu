// copy_blocks: copy whole KV blocks (every layer, K and V) from src to dst, for copy-on-write.
//
// A block is one contiguous region of block_bytes at block_stride (layout `block` stride), so a
// pair is one flat copy. Grid: (pair, chunk); each thread moves 16-byte pieces, grid-striding
// over the block; a tail shorter than 16 bytes (never seen with the supported head sizes, but
// allowed by the layout) is copied byte by byte. The host wrapper rejects ids outside the pool
// and pair sets whose result would depend on the copy order.

typedef long long i64;

extern "C" __global__ void __launch_bounds__(256) copy_blocks(
    char* __restrict__ base, const i64* __restrict__ pairs, i64 block_stride, i64 block_bytes) {
    const i64 src = pairs[2 * (i64)blockIdx.x];
    const i64 dst = pairs[2 * (i64)blockIdx.x + 1];
    const char* s = base + src * block_stride;
    char* d = base + dst * block_stride;
    const i64 vecs = block_bytes / 16;
    const i64 step = (i64)gridDim.y * blockDim.x;
    for (i64 i = (i64)blockIdx.y * blockDim.x + threadIdx.x; i < vecs; i += step) {
        reinterpret_cast<uint4*>(d)[i] = reinterpret_cast<const uint4*>(s)[i];
    }
    if (blockIdx.y == 0 && threadIdx.x == 0) {
        for (i64 b = vecs * 16; b < block_bytes; ++b) d[b] = s[b];
    }
}

// move_blocks: copy n whole blocks between two regions, block i from
// src_base + src_id(i) * src_stride to dst_base + dst_id(i) * dst_stride, where a null id list
// means the identity (id(i) = i). With a pool's slab on one side and a contiguous staging buffer
// on the other it is the gather that packs a KV transfer's blocks and the scatter that unpacks
// them. Grid: (block, chunk), as copy_blocks; block_bytes and both strides are multiples of 16.
extern "C" __global__ void __launch_bounds__(256) move_blocks(
    const char* __restrict__ src_base, const int* __restrict__ src_ids, i64 src_stride,
    char* __restrict__ dst_base, const int* __restrict__ dst_ids, i64 dst_stride, i64 block_bytes) {
    const i64 i = blockIdx.x;
    const i64 src = src_ids ? (i64)src_ids[i] : i;
    const i64 dst = dst_ids ? (i64)dst_ids[i] : i;
    const uint4* s = reinterpret_cast<const uint4*>(src_base + src * src_stride);
    uint4* d = reinterpret_cast<uint4*>(dst_base + dst * dst_stride);
    const i64 vecs = block_bytes / 16;
    const i64 step = (i64)gridDim.y * blockDim.x;
    for (i64 v = (i64)blockIdx.y * blockDim.x + threadIdx.x; v < vecs; v += step) d[v] = s[v];
}

// move_rows: copy `rows` rows of row_bytes from each of n blocks, row r of block i from
// src_base + src_id(i) * src_block + src_offset + r * src_pitch to
// dst_base + dst_id(i) * dst_block + dst_offset + r * dst_pitch (a null id list: the identity).
// A tensor-parallel shard's KV heads are such rows: one per (layer, K|V, token) of a block,
// packed in a staging buffer on one side (pitch = row_bytes) and at a head offset of a wider
// block on the other. Grid: (block, chunk); row_bytes, the pitches and offsets are multiples
// of 16.
extern "C" __global__ void __launch_bounds__(256) move_rows(
    const char* __restrict__ src_base, const int* __restrict__ src_ids, i64 src_block,
    i64 src_offset, i64 src_pitch, char* __restrict__ dst_base, const int* __restrict__ dst_ids,
    i64 dst_block, i64 dst_offset, i64 dst_pitch, i64 rows, i64 row_bytes) {
    const i64 i = blockIdx.x;
    const i64 src = src_ids ? (i64)src_ids[i] : i;
    const i64 dst = dst_ids ? (i64)dst_ids[i] : i;
    const char* s = src_base + src * src_block + src_offset;
    char* d = dst_base + dst * dst_block + dst_offset;
    const i64 per_row = row_bytes / 16;
    const i64 vecs = rows * per_row;
    const i64 step = (i64)gridDim.y * blockDim.x;
    for (i64 v = (i64)blockIdx.y * blockDim.x + threadIdx.x; v < vecs; v += step) {
        const i64 r = v / per_row;
        const i64 c = (v - r * per_row) * 16;
        *reinterpret_cast<uint4*>(d + r * dst_pitch + c) =
            *reinterpret_cast<const uint4*>(s + r * src_pitch + c);
    }
}
