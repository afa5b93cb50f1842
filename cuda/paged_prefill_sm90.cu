// Paged prefill (extend) attention for Hopper (sm_90a): wgmma (warpgroup MMA, operands in
// shared memory), a producer warpgroup and two consumer warpgroups synchronised by mbarriers.
// Same function, parameters, work items, row mapping and KV splits as paged_prefill.cu (read its
// header first); only the CTA's inner machinery differs.
//
// CTA = 3 warpgroups (384 threads), 128 query rows (row r = (query token q0 + r / gh, query head
// qh0 + r % gh)):
//   warpgroup 0, the producer (setmaxnreg down to PRODUCER_REGS): gathers the K and V tiles of
//     BN tokens through the block table into STAGES shared-memory stages, in one of two ways
//     (KV_TMA, compile time):
//     - KV_TMA 0: 16-byte cp.async, each thread copying its rows' 16-byte chunks.
//     - KV_TMA 1 (BLOCK_SIZE >= 8): TMA per page. The host encodes two tensor maps (k_map,
//       v_map, __grid_constant__ parameters) over the whole pool, 5-D: head_dim, KV head,
//       token in block, layer, block; box = 64 columns (128 bytes) x BOX_TOKENS tokens with
//       the 128-byte swizzle, so a box lands exactly in the swizzled layout below (a box
//       starts at a multiple of BOX_TOKENS * 128 bytes: 1024-aligned when BOX_TOKENS >= 8).
//       Lane 0 of producer warp 0 issues the HEAD_DIM / 64 K boxes and V boxes of each of the
//       tile's pages (cp.async.bulk.tensor, completing bytes on the stage's `full` barrier,
//       which it arms with the tile's bytes first), taking page p's id from lane p by a
//       shuffle; a block id outside 0..num_blocks-1 (or -1 past the
//       table) is outside the map and reads zeros. The tile holding kv_end (keys past it may
//       be any bits in the pool, NaN included, and 0 * NaN would reach O through P V) goes
//       the cp.async way, which zero-fills rows past kv_end.
//     The block-table entries of a tile (TILE_PAGES of them) are read
//     one tile ahead, spread over the lanes of each producer warp (PAGES_PER_LANE each), and
//     handed to the copying lanes by shuffles: no table read waits on the copy path. Per stage
//     it waits for the stage's `empty` barrier, issues the copies and then
//     cp.async.mbarrier.arrive.noinc on the stage's `full` barrier (count: its 128 threads), so
//     the barrier completes when the copies have landed and the producer never waits on them:
//     all STAGES tiles can be in flight. On a TMA tile every producer thread arrives plainly
//     instead (lane 0 with the expected bytes), so the count stays 128 for both kinds of tile.
//   warpgroups 1, 2, the consumers (setmaxnreg up to CONSUMER_REGS), 64 rows each: Q by cp.async
//     once; per tile j: wait `full`, fence.proxy.async (the cp.async writes came through the
//     generic proxy, wgmma reads shared memory through the async proxy), then one "GEMM block":
//     S(j) (64 x BN) = Q K^T by wgmma (A and B from shared memory, K-major) and, in the same
//     block, O (64 x D) += P(j-1) V(j-1) by wgmma with P from registers (the accumulator layout
//     of S is, per warp, the m16n8k16 A layout) and V from shared memory (MN-major,
//     imm-trans-b). It waits for S(j) only (wgmma.wait_group 1), runs the causal / length mask
//     and online softmax of tile j (log2 domain, as paged_prefill.cu) while P(j-1) V(j-1) is
//     still on the tensor cores, then waits for that, releases stage j-1 (each warp's lane 0
//     arrives on `empty`, count 8) and packs P(j). O is rescaled by tile j's correction just
//     before the next block issues P(j) V(j). A last block issues P(n-1) V(n-1).
//     Ping-pong: the two consumers take turns issuing their GEMM blocks (named barriers 3 and
//     4, 256 threads: a consumer syncs on its own and arrives on the other's once it has
//     issued), so one's softmax runs while the other's GEMMs occupy the tensor cores (FA3's
//     schedule). Consumer 2 opens by arriving on consumer 1's barrier and skips the arrival
//     after its last block, so every barrier phase completes and none is left half-arrived.
//
// Shared-memory tiles use the 128-byte swizzle of the wgmma descriptors: a row of HEAD_DIM
// 16-bit elements is cut into HEAD_DIM / 64 column blocks of 128 bytes; block c of a tile of R
// rows starts at c * R * 128 bytes, row r at r * 128 inside it, and its 16-byte chunk k at
// ((k ^ (r & 7)) * 16). Every tile starts at a 1024-byte boundary (one swizzle atom: 8 rows).
// Descriptors: K-major (Q, K): stride byte offset 1024 (8-row groups), each k16 step adds 32
// bytes inside the atom (HEAD_DIM > 64: the next column block past 4 steps). MN-major (V):
// leading byte offset = one column block (BN * 128 bytes, the next 64 output columns), stride
// byte offset 1024 (the next 8 keys), each k16 step adds 16 rows (2048 bytes).
//
// Compile-time constants (NVRTC -D): KV_BF16, HEAD_DIM (64|128|256), BLOCK_SIZE (power of two),
// BN (KV tile tokens: 64 or 128), STAGES (2..3; the consumers hold two stages at a time, so 3
// lets the producer run a tile ahead), KV_TMA (0|1, default 0). Build for sm_90a (wgmma,
// setmaxnreg, cp.async.bulk.tensor).

#if !defined(KV_BF16) || !defined(HEAD_DIM) || !defined(BLOCK_SIZE) || !defined(BN) || \
    !defined(STAGES)
#error "paged_prefill_sm90.cu needs KV_BF16, HEAD_DIM, BLOCK_SIZE, BN and STAGES defined"
#endif

#ifndef KV_TMA
#define KV_TMA 0
#endif

#include "decode_common.cuh"
#include "mma_common.cuh"
#include "wgmma_sm90.cuh"

#define NTHREADS 384
#define MROWS 128                    // query rows per CTA: two consumer warpgroups of 64
#define CH (HEAD_DIM / 8)            // 16-byte chunks per row
#define ROWB (HEAD_DIM * 2)
#define Q_BYTES (MROWS * ROWB)
#define KV_TILE_BYTES (BN * ROWB)
#define STAGE_BYTES (2 * KV_TILE_BYTES)  // K tile, then V tile
#define KSTEPS (HEAD_DIM / 16)       // k16 steps of S = Q K^T
#define PSTEPS (BN / 16)             // k16 steps of O += P V
#define S_REGS (BN / 2)              // S accumulators per thread (64 x BN over 128 threads)
#define O_REGS (HEAD_DIM / 2)
// Registers per thread: every warp starts with ENTRY_REGS (ptxas's allocation under
// __launch_bounds__(384, 1): 65536 / 384 rounded down to 8); setmaxnreg.inc of the consumers
// only takes what the producer's setmaxnreg.dec gave back, so the consumers' growth must fit
// in the producer's release (static_assert below), else they wait forever.
#define ENTRY_REGS 168
// With TMA the producer holds both loads' state (at 40 ptxas spilled 8-40 bytes of it): 56 for
// it, 224 for the consumers (no spill at any head dim either way).
#define PRODUCER_REGS (KV_TMA ? 56 : 40)
#define CONSUMER_REGS (KV_TMA ? 224 : 232)
#define PROD_THREADS 128
#define PROD_RPI (PROD_THREADS / CH)  // tile rows one pass of the producer covers
// Block-table entries one KV tile spans (tiles start at multiples of BN), and per producer lane.
#define TILE_PAGES (BLOCK_SIZE >= BN ? 1 : BN / BLOCK_SIZE)
#define PAGES_PER_LANE ((TILE_PAGES + 31) / 32)
// Tokens of one TMA box: a page, or the tile when a page holds more than a tile.
#define BOX_TOKENS (BLOCK_SIZE >= BN ? BN : BLOCK_SIZE)
#define BOX_BYTES (BOX_TOKENS * 128)

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "HEAD_DIM must be 64, 128 or 256");
static_assert(BN == 64 || BN == 128, "BN must be 64 or 128");
static_assert((BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0 && BLOCK_SIZE >= 1, "BLOCK_SIZE: power of two");
static_assert(BN % PROD_RPI == 0 && STAGES >= 2 && STAGES <= 3, "tile shape");
// A producer row's table entry sits in register (row / BLOCK_SIZE) / 32 of some lane; with
// PROD_RPI dividing 32 * BLOCK_SIZE that index does not depend on the thread's first row.
static_assert((32 * BLOCK_SIZE) % PROD_RPI == 0 && PROD_RPI <= 32, "page-id layout");
// TMA: a box must start on a swizzle atom (8 rows of 128 bytes), and warp 0's lanes cover the
// tile's pages.
static_assert(!KV_TMA || (BOX_TOKENS >= 8 && TILE_PAGES <= 32), "KV_TMA needs BLOCK_SIZE >= 8");
static_assert(PROD_THREADS * (ENTRY_REGS - PRODUCER_REGS) >= 2 * 128 * (CONSUMER_REGS - ENTRY_REGS),
              "the consumers' setmaxnreg.inc needs the registers the producer gives back");

// Byte offset of (row, 16-byte chunk) in a swizzled tile of `rows` rows.
__device__ __forceinline__ unsigned swz128(int rows, int row, int chunk) {
    return (unsigned)((chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// A wgmma shared-memory descriptor, 128-byte swizzle (layout type 1 in bits 62-63).
__device__ __forceinline__ unsigned long long gmma_desc(unsigned saddr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((saddr & 0x3FFFF) >> 4) |
           ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }

// The accumulators are written by wgmma behind the compiler's back between issue and wait: tie
// them to the wait so no use moves above it.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" :: "r"(bar) : "memory");
}
// Wait until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" :: "r"(bar), "r"(parity) : "memory");
}
// The barrier's arrival once every cp.async this thread issued before has landed; noinc: the
// arrival is one of the count the barrier was initialised with.
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
// pid[k] for a run-time k by selects (an indexed register array would go to local memory).
template <int N>
__device__ __forceinline__ int pick(const int (&pid)[N], int k) {
    int v = pid[0];
#pragma unroll
    for (int i = 1; i < N; ++i) v = k == i ? pid[i] : v;
    return v;
}
// The opaque 128-byte CUtensorMap the host encodes (cuTensorMapEncodeTiled), passed by value.
struct alignas(64) TmaMap {
    unsigned long long opaque[16];
};
// Arrival that also expects `bytes` more to land through complete_tx before the phase completes.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
// One box of a 5-D tensor map -> shared memory at dst; its bytes complete on barrier bar.
__device__ __forceinline__ void tma_load_5d(unsigned dst, const TmaMap* map, unsigned bar, int c0,
                                            int c1, int c2, int c3, int c4) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1),
           "r"(c2), "r"(c3), "r"(c4)
        : "memory");
}
// Named barriers of the ping-pong (ids 3, 4; 256 threads: both consumer warpgroups).
__device__ __forceinline__ void named_sync(int id) {
    asm volatile("bar.sync %0, 256;" :: "r"(id) : "memory");
}
__device__ __forceinline__ void named_arrive(int id) {
    asm volatile("bar.arrive %0, 256;" :: "r"(id) : "memory");
}
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

#define WGMMA_SS(n, d, a, b, acc) wgmma_ss_n##n(d, a, b, acc)
#define WGMMA_RS(n, d, a, b) wgmma_rs_n##n(d, a, b)
#define SS_N(n, d, a, b, acc) WGMMA_SS(n, d, a, b, acc)
#define RS_N(n, d, a, b) WGMMA_RS(n, d, a, b)

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) paged_prefill_sm90(
    const u16* __restrict__ q, i64 q_tok_stride, i64 q_head_stride,
    u16* __restrict__ out, i64 out_tok_stride, i64 out_head_stride,
    float* __restrict__ part_o, float* __restrict__ part_lse,
    const char* __restrict__ k_base, const char* __restrict__ v_base,
    i64 block_stride, i64 token_stride, i64 head_stride, int num_blocks,
    const int* __restrict__ block_tables, i64 bt_stride, int bt_width,
    const int* __restrict__ seq_lens, const int* __restrict__ qo_indptr,
    const int2* __restrict__ work, int total_q, int num_q_heads, int group, int gh,
    int q_tile_tokens, int causal, float scale_log2,
    const __grid_constant__ TmaMap k_map, const __grid_constant__ TmaMap v_map, int layer) {
    const int2 item = work[blockIdx.x];
    const int seq = item.x;
    const int qt0 = item.y;
    const int n_htiles = group / gh;
    const int kvh = blockIdx.y / n_htiles;
    const int qh0 = kvh * group + (blockIdx.y % n_htiles) * gh;
    const int split = blockIdx.z;
    const int num_splits = gridDim.z;

    const int qo_begin = qo_indptr[seq];
    const int qo_len = qo_indptr[seq + 1] - qo_begin;
    const int len = seq_lens[seq];
    const int prefix = max(len - qo_len, 0);
    const int q_tokens = min(min(q_tile_tokens, qo_len - qt0), total_q - qo_begin - qt0);

    const int kv_total = causal ? min(len, prefix + qt0 + q_tokens) : len;
    const int n_tiles_all = (kv_total + BN - 1) / BN;
    const int tiles_per_split = (n_tiles_all + num_splits - 1) / num_splits;
    const int kv_begin = split * tiles_per_split * BN;
    const int kv_end = min(kv_total, kv_begin + tiles_per_split * BN);
    const int n_tiles = kv_end > kv_begin ? (kv_end - kv_begin + BN - 1) / BN : 0;
    const int kv_nomask = causal ? min(kv_end, prefix + qt0 + 1) : kv_end;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int wg = warp >> 2;  // 0 producer, 1 and 2 consumers

    extern __shared__ unsigned char smem[];
    // Swizzle atoms need 1024-byte alignment: the host asks for 1024 bytes more than it uses.
    const unsigned s_raw = (unsigned)__cvta_generic_to_shared(smem);
    const unsigned s_q = (s_raw + 1023u) & ~1023u;
    const unsigned s_kv = s_q + Q_BYTES;                       // STAGES x (K tile, V tile)
    const unsigned s_bar = s_kv + STAGES * STAGE_BYTES;        // full[STAGES], empty[STAGES]
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(s_bar + 8 * s, PROD_THREADS);  // one cp.async arrival per producer thread
            mbar_init(s_bar + 8 * (STAGES + s), 8);  // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        // ---------------------------------------------------------------- producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(PRODUCER_REGS));
        const int chunk = tid % CH;
        const int row0 = tid / CH;
        const int* bt = block_tables + (i64)seq * bt_stride;
        const char* k_lane = k_base + kvh * head_stride + chunk * 16;
        const char* v_lane = v_base + kvh * head_stride + chunk * 16;
        // Lane l holds the table entries l, l + 32, ... of the tile starting at token t0 (-1 past
        // the table or the keys: those rows read zeros).
        auto load_pages = [&](int t0, int (&pid)[PAGES_PER_LANE]) {
#pragma unroll
            for (int k = 0; k < PAGES_PER_LANE; ++k) {
                const int p = 32 * k + lane;
                const int gp = t0 / BLOCK_SIZE + p;
                const bool ok = p < TILE_PAGES && gp < bt_width && gp * BLOCK_SIZE < kv_end;
                pid[k] = ok ? __ldg(bt + gp) : -1;
            }
        };
        int pid[PAGES_PER_LANE];
        if (n_tiles > 0) load_pages(kv_begin, pid);
        for (int j = 0; j < n_tiles; ++j) {
            const int s = j % STAGES;
            const int t0 = kv_begin + j * BN;
            int cur[PAGES_PER_LANE];
#pragma unroll
            for (int k = 0; k < PAGES_PER_LANE; ++k) cur[k] = pid[k];
            // The next tile's entries: in flight while this tile's stage frees and copies issue.
            if (j + 1 < n_tiles) load_pages(t0 + BN, pid);
            if (j >= STAGES) mbar_wait(s_bar + 8 * (STAGES + s), ((j / STAGES) - 1) & 1);
            const unsigned sk = s_kv + (unsigned)(s * STAGE_BYTES);
            if (KV_TMA && t0 + BN <= kv_end) {
                // Warp-uniform: the whole producer takes the same kind of tile.
                if (warp == 0) {
                    if (lane == 0) mbar_arrive_expect_tx(s_bar + 8 * s, STAGE_BYTES);
                    else mbar_arrive(s_bar + 8 * s);
                    const int tok = BLOCK_SIZE >= BN ? (t0 & (BLOCK_SIZE - 1)) : 0;
#pragma unroll 1
                    for (int p = 0; p < TILE_PAGES; ++p) {
                        const int b = __shfl_sync(0xffffffffu, cur[0], p);  // page p's id
                        if (lane == 0) {
#pragma unroll
                            for (int c = 0; c < HEAD_DIM / 64; ++c) {
                                const unsigned at = sk + (unsigned)(p * BOX_BYTES + c * BN * 128);
                                tma_load_5d(at, &k_map, s_bar + 8 * s, 64 * c, kvh, tok, layer, b);
                                tma_load_5d(at + KV_TILE_BYTES, &v_map, s_bar + 8 * s, 64 * c, kvh, tok, layer, b);
                            }
                        }
                    }
                } else {
                    mbar_arrive(s_bar + 8 * s);
                }
                continue;
            }
// 4 rows per step: fully unrolled, the compiler keeps every row's addresses live across the
// tile loop and spills them out of the producer's PRODUCER_REGS.
#pragma unroll 4
            for (int i = 0; i < BN / PROD_RPI; ++i) {
                const int row = i * PROD_RPI + row0;
                const int t = t0 + row;
                const int p = BLOCK_SIZE >= BN ? 0 : row / BLOCK_SIZE;  // entry within the tile
                const int b = __shfl_sync(0xffffffffu, pick(cur, (i * PROD_RPI) / (32 * BLOCK_SIZE)), p & 31);
                const bool ok = t < kv_end && (unsigned)b < (unsigned)num_blocks;  // else zeros
                const i64 off = ok ? (i64)b * block_stride + (i64)(t & (BLOCK_SIZE - 1)) * token_stride : 0;
                const unsigned dst = sk + swz128(BN, row, chunk);
                cp_async16(dst, k_lane + off, ok);
                cp_async16(dst + KV_TILE_BYTES, v_lane + off, ok);
            }
            cp_async_mbar_arrive(s_bar + 8 * s);
        }
        asm volatile("cp.async.wait_all;" ::: "memory");  // no copy of this thread in flight at exit
        return;
    }

    // -------------------------------------------------------------------- consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(CONSUMER_REGS));
    const int ctid = tid - 128 * wg;  // thread within the consumer warpgroup
    const int cwarp = ctid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int row_base = 64 * (wg - 1);  // this warpgroup's first CTA row
    const int my_turn = 2 + wg;          // named barrier 3 (consumer 1) or 4 (consumer 2)
    const int their_turn = 5 - wg;

    // Q rows of this warpgroup -> shared memory (padding rows zero-filled).
    {
        const int chunk = ctid % CH;
#pragma unroll
        for (int i = 0; i < 64 / (128 / CH); ++i) {
            const int row = row_base + i * (128 / CH) + ctid / CH;
            const int t = row / gh;
            const bool ok = row < q_tile_tokens * gh && t < q_tokens;
            const u16* src = q + (i64)(qo_begin + qt0 + t) * q_tok_stride +
                             (i64)(qh0 + row % gh) * q_head_stride + chunk * 8;
            cp_async16(s_q + swz128(MROWS, row, chunk),
                       ok ? reinterpret_cast<const char*>(src) : reinterpret_cast<const char*>(q), ok);
        }
        cp_async_commit();
        cp_async_wait<0>();
        fence_async_smem();
        asm volatile("bar.sync %0, 128;" :: "r"(wg) : "memory");  // ids 1, 2: one per warpgroup
    }

    int lim[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row_base + cwarp * 16 + gid + 8 * h;
        lim[h] = causal ? min(kv_end, prefix + qt0 + row / gh + 1) : kv_end;
    }

    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float alpha[2] = {1.f, 1.f};  // the correction O takes before the next P V
    float o[O_REGS];
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
    float sacc[S_REGS];
    u32 pa[PSTEPS][4];

    auto wait_full = [&](int j) {
        mbar_wait(s_bar + 8 * (j % STAGES), (j / STAGES) & 1);
        fence_async_smem();  // the producer's cp.async writes, seen by this thread's wgmma
    };
    auto issue_s = [&](int j) {  // S = Q K(j)^T
        const unsigned sk = s_kv + (unsigned)((j % STAGES) * STAGE_BYTES);
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            const unsigned long long qd =
                gmma_desc(s_q + (kk >> 2) * (MROWS * 128) + row_base * 128 + (kk & 3) * 32, 16, 1024);
            const unsigned long long kd =
                gmma_desc(sk + (kk >> 2) * (BN * 128) + (kk & 3) * 32, 16, 1024);
            SS_N(BN, sacc, qd, kd, kk > 0);
        }
    };
    auto issue_pv = [&](int j) {  // O += P V(j): k16 step kt = keys 16kt .. 16kt + 15
        const unsigned sv = s_kv + (unsigned)((j % STAGES) * STAGE_BYTES) + KV_TILE_BYTES;
#pragma unroll
        for (int kt = 0; kt < PSTEPS; ++kt) {
            const unsigned long long vd = gmma_desc(sv + kt * 16 * 128, BN * 128, 1024);
            RS_N(HEAD_DIM, o, pa[kt], vd);
        }
    };
    auto rescale_o = [&]() {
#pragma unroll
        for (int i = 0; i < O_REGS; ++i) o[i] *= alpha[(i >> 1) & 1];
    };
    // Mask and online softmax of tile j on sacc (S -> P, unnormalised); sets alpha and l.
    auto softmax = [&](int j) {
        const int t0 = kv_begin + j * BN;
        const bool masked = t0 + BN > kv_nomask;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = m[h];
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float x = sacc[nt * 4 + 2 * h + e] * scale_log2;
                    if (masked && t0 + nt * 8 + 2 * tig + e >= lim[h]) x = NEG_INF;
                    sacc[nt * 4 + 2 * h + e] = x;
                    mx = fmaxf(mx, x);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float base = (mx == NEG_INF) ? 0.f : mx;  // a row with no key yet stays empty
            alpha[h] = exp2f(m[h] - base);
            m[h] = mx;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = exp2f(sacc[nt * 4 + 2 * h + e] - base);
                    sacc[nt * 4 + 2 * h + e] = p;
                    sum += p;
                }
            l[h] = l[h] * alpha[h] + sum;  // this lane's part; the quad is summed at the end
        }
    };
    // P (the S accumulators, S column tiles 2kt, 2kt + 1) -> the A fragments of O += P V.
    auto pack_p = [&]() {
#pragma unroll
        for (int kt = 0; kt < PSTEPS; ++kt) {
            pa[kt][0] = pack2(sacc[8 * kt + 0], sacc[8 * kt + 1]);
            pa[kt][1] = pack2(sacc[8 * kt + 2], sacc[8 * kt + 3]);
            pa[kt][2] = pack2(sacc[8 * kt + 4], sacc[8 * kt + 5]);
            pa[kt][3] = pack2(sacc[8 * kt + 6], sacc[8 * kt + 7]);
        }
    };
    auto release = [&](int j) {  // this warp is done with stage j % STAGES
        __syncwarp();
        if (lane == 0) mbar_arrive(s_bar + 8 * (STAGES + j % STAGES));
    };

    if (n_tiles > 0) {
        if (wg == 2) named_arrive(their_turn);  // consumer 1 issues first
        // Block 0: S(0) alone.
        wait_full(0);
        named_sync(my_turn);
        wgmma_fence();
        issue_s(0);
        wgmma_commit();
        named_arrive(their_turn);
        wgmma_wait0();
        fence_regs(sacc);
        softmax(0);
        pack_p();
    }
    for (int j = 1; j < n_tiles; ++j) {
        // Block j: S(j) and P(j-1) V(j-1); tile j's softmax overlaps the second.
        wait_full(j);
        named_sync(my_turn);
        wgmma_fence();
        issue_s(j);
        wgmma_commit();
        rescale_o();  // while S(j) runs; O is no wgmma's until P(j-1) V(j-1) issues
        wgmma_fence();
        issue_pv(j - 1);
        wgmma_commit();
        named_arrive(their_turn);
        wgmma_wait1();
        fence_regs(sacc);
        softmax(j);
        wgmma_wait0();
        fence_regs(o);
        release(j - 1);
        pack_p();
    }
    if (n_tiles > 0) {
        // Last block: P(n-1) V(n-1). Consumer 2 is the last to issue: nobody waits for its turn.
        rescale_o();
        named_sync(my_turn);
        wgmma_fence();
        issue_pv(n_tiles - 1);
        wgmma_commit();
        if (wg == 1) named_arrive(their_turn);
        wgmma_wait0();
        fence_regs(o);
    }

    // Epilogue: this thread holds rows gid, gid + 8 of its warp, columns 8n + 2tig + {0,1}.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float lsum = l[h];
        lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
        lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
        const int row = row_base + cwarp * 16 + gid + 8 * h;
        const int t = row / gh;
        if (row >= q_tile_tokens * gh || t >= q_tokens) continue;
        const int tok = qo_begin + qt0 + t;
        const int qh = qh0 + row % gh;
        const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
        if (part_o == nullptr) {
            u16* dst = out + (i64)tok * out_tok_stride + (i64)qh * out_head_stride + 2 * tig;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n)
                *reinterpret_cast<u32*>(dst + 8 * n) = pack2(o[4 * n + 2 * h] * inv, o[4 * n + 2 * h + 1] * inv);
        } else {
            const i64 prow = ((i64)split * total_q + tok) * num_q_heads + qh;
            float* dst = part_o + prow * HEAD_DIM + 2 * tig;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n)
                *reinterpret_cast<float2*>(dst + 8 * n) = float2{o[4 * n + 2 * h] * inv, o[4 * n + 2 * h + 1] * inv};
            if (tig == 0) part_lse[prow] = lsum > 0.f ? m[h] + log2f(lsum) : NEG_INF;
        }
    }
}
