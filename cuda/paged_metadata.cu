// paged_metadata: a step's paged-attention metadata from the block tables, on the device, into
// buffers the caller owns (so a captured CUDA graph replays it with new tables and lengths):
//   - slot_mapping (int64): for the packed step's tokens, sequence s owning
//     qo_indptr[s]..qo_indptr[s+1] at positions seq_lens[s] - qo_len .. seq_lens[s] - 1,
//     slot = block_table[s][pos / block_size] * block_size + pos % block_size; -1 (the null
//     slot, skipped by append_kv) for the padding past qo_indptr[num_seqs] and for a position
//     outside the table row;
//   - FlashInfer's CSR of the pages: indptr (int32 [num_seqs + 1]) = prefix sums of
//     ceil(seq_lens / block_size) (at most `width` per row), indices (int32) = the rows' first
//     pages concatenated, -1 past indptr[num_seqs]; last_page_len (int32) = tokens in the last
//     page (1..block_size; 0 for an empty sequence).
// One CTA of 1024 threads: a metadata step is a few thousand entries at most, and one CTA
// makes the prefix sum a block scan (no second launch, no atomics). __syncthreads orders the
// block's own global writes, so the indices pass reads the indptr the scan wrote.
// qo_indptr == nullptr skips the slot mapping; indptr == nullptr skips the CSR.

typedef long long i64;

namespace {

constexpr int kThreads = 1024;

__device__ int pages_of(int len, int block_size, int width) {
    const int p = len > 0 ? (len + block_size - 1) / block_size : 0;
    return p < width ? p : width;
}

// Inclusive block-wide sum of v; every thread of the CTA must call it.
__device__ int block_inclusive_scan(int v, int* warp_sums) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int d = 1; d < 32; d <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += n;
    }
    if (lane == 31) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int w = warp_sums[lane];
        for (int d = 1; d < 32; d <<= 1) {
            const int n = __shfl_up_sync(0xffffffffu, w, d);
            if (lane >= d) w += n;
        }
        warp_sums[lane] = w;
    }
    __syncthreads();
    const int before = warp > 0 ? warp_sums[warp - 1] : 0;
    __syncthreads();  // warp_sums is reused by the next call
    return v + before;
}

__device__ void write_csr(const int* table, i64 table_stride, int width, const int* seq_lens,
                          int num_seqs, int block_size, int* indptr, int* indices,
                          i64 num_indices, int* last_page_len) {
    __shared__ int warp_sums[32];
    __shared__ int carry;
    if (threadIdx.x == 0) {
        carry = 0;
        indptr[0] = 0;
    }
    __syncthreads();
    for (int base = 0; base < num_seqs; base += kThreads) {
        const int s = base + threadIdx.x;
        const int len = s < num_seqs ? seq_lens[s] : 0;
        const int pages = s < num_seqs ? pages_of(len, block_size, width) : 0;
        const int incl = block_inclusive_scan(pages, warp_sums);
        if (s < num_seqs) {
            indptr[s + 1] = carry + incl;
            last_page_len[s] = pages > 0 ? len - (pages - 1) * block_size : 0;
            if (last_page_len[s] > block_size) last_page_len[s] = block_size;  // len past the row
        }
        __syncthreads();
        if (threadIdx.x == kThreads - 1) carry += incl;
        __syncthreads();
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int s = warp; s < num_seqs; s += kThreads / 32) {
        const int lo = indptr[s], hi = indptr[s + 1];
        for (int p = lane; p < hi - lo; p += 32) {
            if (lo + p < num_indices) indices[lo + p] = table[(i64)s * table_stride + p];
        }
    }
    for (i64 i = (i64)indptr[num_seqs] + threadIdx.x; i < num_indices; i += kThreads) {
        indices[i] = -1;
    }
}

__device__ void write_slots(const int* table, i64 table_stride, int width, const int* seq_lens,
                            const int* qo_indptr, int num_seqs, int block_size, i64* slot_mapping,
                            i64 num_slots) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int s = warp; s < num_seqs; s += kThreads / 32) {
        const int lo = qo_indptr[s], n = qo_indptr[s + 1] - lo;
        const int start = seq_lens[s] - n;
        for (int k = lane; k < n; k += 32) {
            const int pos = start + k;
            const int page = pos >= 0 ? pos / block_size : width;
            const i64 slot = page < width
                ? (i64)table[(i64)s * table_stride + page] * block_size + pos % block_size
                : -1;
            if (lo + k >= 0 && lo + k < num_slots) slot_mapping[lo + k] = slot;
        }
    }
    const i64 end = qo_indptr[num_seqs] > 0 ? qo_indptr[num_seqs] : 0;
    for (i64 i = end + threadIdx.x; i < num_slots; i += kThreads) slot_mapping[i] = -1;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(1024) paged_metadata(
    const int* __restrict__ block_table, i64 table_stride, int width,
    const int* __restrict__ seq_lens, int num_seqs, int block_size,
    const int* __restrict__ qo_indptr, i64* __restrict__ slot_mapping, i64 num_slots,
    int* indptr, int* __restrict__ indices, i64 num_indices, int* __restrict__ last_page_len) {
    if (indptr != nullptr) {
        write_csr(block_table, table_stride, width, seq_lens, num_seqs, block_size, indptr,
                  indices, num_indices, last_page_len);
    }
    if (qo_indptr != nullptr) {
        write_slots(block_table, table_stride, width, seq_lens, qo_indptr, num_seqs, block_size,
                    slot_mapping, num_slots);
    }
}
