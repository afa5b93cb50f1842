// Read-bandwidth ceiling: every thread streams 16-byte pieces (ld.global.cs, evict-first),
// grid-striding over the buffer, and folds them into one word so the loads cannot be dropped.
typedef unsigned long long u64;

extern "C" __global__ void read_ceiling(const uint4* __restrict__ buf, u64 n_vec, unsigned* sink) {
    unsigned acc = 0;
    const u64 step = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * step < n_vec; i += 4 * step) {
        const uint4 a = __ldcs(buf + i), b = __ldcs(buf + i + step);
        const uint4 c = __ldcs(buf + i + 2 * step), d = __ldcs(buf + i + 3 * step);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n_vec; i += step) {
        const uint4 a = __ldcs(buf + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // practically never: keeps the loads alive
}
