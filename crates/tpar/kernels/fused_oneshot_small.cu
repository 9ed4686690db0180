// Fused one-shot push allreduce + residual add + RMSNorm on blocks smaller than
// TPAR_NORM_THREADS (fused.rs, fused_block_threads: 128 or 256 threads where the grid holds a
// block for every chunk of every row, up to FUSED_PEER_SITE_RANKS ranks): the same call as
// fused_oneshot.cu, with the same slot layout, results and errors, but a row is cut into chunks
// of the block's size in quads (a thread each), so that at one or two tokens the push and the
// wait use as many SMs as the plain allreduce of the same bytes. One wait site per peer
// (tuning.cuh, TPAR_WAIT_SITE_PER_GROUP; reduce_unit's argument).
//
// Block `part` of a row takes its chunks part, part + blocks_per_row, ... A block does not hold
// a whole segment of norm.rs's tree (16 warps of 32 quads), so each warp publishes its sum of
// squares as an LL line in this rank's device state at once, with no barrier (fused.cuh,
// norm_exchange_lines: one line per (row, warp of the row)), and warp 0 of every block reads
// all of them and folds them as the tree does: the same bits in every block and on every rank
// as fused_oneshot.cu's segment sums. With one block per row the sums stay in shared memory.
// Where the GPU has thread block clusters (sm_90+), the host may launch the cluster form
// instead (tpar_fused_oneshot_small_clusters_*: a row's blocks are one cluster): each warp stores its
// sum into every block's shared memory of the cluster and one cluster barrier replaces the
// exchange through device memory and its waits; the fold, and so the bits, are the same.
//
// A file of its own, so that fused_oneshot.cu (whole blocks) stays as it was, to the PTX: with
// this kernel compiled beside them in one file (its PTX then the same as here), the group-site
// kernel, whose own PTX barely changed, was 0.3-0.6 us slower at 8 ranks sharing one H100 x 1,
// 2 and 8 tokens (bench/results/2026-12-06-s15, calls 3, 5 and 6).
//
// The cluster forms against this file's exchange through device memory, one H200, hidden 8192
// bf16, ranks as streams, 2026-12-07 (bench/results/2026-12-07-s23, call 1, each way twice,
// TPAR_FUSED_CLUSTERS=0 in the same binary): 2 ranks x 1 / 2 / 4 / 8 tokens 3.50 / 3.46 / 3.70
// / 4.34 -> 3.36 / 3.43 / 3.47 / 4.01 us, 4 ranks x 1 / 2 4.39 / 4.57 -> 3.87 / 3.96 (against
// main's binary), and the whole-block form at 8 ranks x 1 / 2 6.15 / 6.43 -> 5.78 / 6.17; the
// allreduce alone took 2.07 / 2.09 / 2.17 / 2.40 at 2 ranks and 3.75 / 4.21 at 8.
#define TPAR_FUSED_KERNEL 1
#include "tpar_ll.cuh"

// Which quads of the launch's rows a thread takes: in rows first_row, first_row + row_stride,
// ... the block's chunks part, part + per_row, ... (`mine` of them; the host keeps per_row <=
// chunks, so every block has at least one), quad q0 + j * step of its j-th.
struct FusedSpread {
    u32 per_row, part, mine;
    u64 first_row, row_stride, q0, step;
};
__device__ __forceinline__ FusedSpread fused_spread(const TparNormArgs& n, u64 quads, u32 chunk) {
    FusedSpread s;
    const u32 chunks = (u32)((quads + chunk - 1) / chunk);
    s.per_row = n.blocks_per_row;
    s.part = blockIdx.x % s.per_row;
    s.first_row = blockIdx.x / s.per_row;
    s.row_stride = gridDim.x / s.per_row;
    s.mine = s.part < chunks ? (chunks - s.part + s.per_row - 1) / s.per_row : 0;
    s.q0 = (u64)s.part * chunk + threadIdx.x;
    s.step = (u64)s.per_row * chunk;
    return s;
}

// What a thread holds of its first quad, loaded before the call counter so that the loads
// overlap its round trip: its input, residual and weight (the weight is the same in every row).
struct FusedFirst {
    u32 x0, x1, r0, r1, w0, w1;
};

// Quad q of `row` once its lines arrive: the allreduce in rank order (rounded once, left in
// `acc`), plus the residual (rounded), stored as residual_out. Returns the thread's partial of
// the sum of squares. After a failed wait the thread stops waiting but goes on to every barrier.
template <int DT>
__device__ __forceinline__ float fused_reduce_quad(const TparArgs& a, const TparNormArgs& n, const NormRow& shape,
                                                   const FusedSpread& s, const Call& call, const FusedFirst& first,
                                                   u64 row, u32 j, u64 q, bool* ok, float* acc) {
    u32 own0 = first.x0, own1 = first.x1, res0 = first.r0, res1 = first.r1;
    if (row != s.first_row || j != 0) {
        load_pair<DT>((const char*)a.input + row * shape.bytes, q, n.hidden, shape.words, &own0, &own1);
        load_pair<DT>((const char*)n.residual + row * shape.bytes, q, n.hidden, shape.words, &res0, &res1);
    }
    for (int e = 0; e < 4; ++e) acc[e] = 0.f;
    if (*ok) *ok = reduce_unit<DT, false>(a, call, all_ranks(a), row * shape.quads + q, own0, own1, TPAR_PHASE_ONE_SHOT, acc);
    round_quad<DT>(acc);
    u32 o0, o1;
    const float partial = residual_quad<DT>(acc, res0, res1, &o0, &o1);
    store_pair<DT>((char*)n.residual_out + row * shape.bytes, q, n.hidden, shape.words, o0, o1);
    return partial;
}

// The kernel: blocks of the host's size, smaller than TPAR_NORM_THREADS (a multiple of 32
// dividing it, so that a warp's 32 quads are one warp of the row's tree), or of
// TPAR_NORM_THREADS in launches of a few rows (fused.rs, WHOLE_BLOCK_FEW_ROWS).
template <int DT, bool CLUSTER>
__device__ void fused_oneshot_small(const TparFusedArgs& f) {
    trap_without_clusters<CLUSTER>();
    const TparArgs& a = f.a;
    const TparNormArgs& n = f.n;
    const NormRow shape = norm_row<DT>(n.hidden);
    const u32 segments = shape.segments;
    const FusedSpread s = fused_spread(n, shape.quads, blockDim.x);

    // Before the call counter: the first row's input and residual and the weight of the first
    // chunk. After pdl_wait: the previous kernel may write them.
    pdl_wait();
    FusedFirst first = {0, 0, 0, 0, 0, 0};
    if (s.first_row < n.rows && s.mine > 0 && s.q0 < shape.quads) {
        load_pair<DT>((const char*)a.input + s.first_row * shape.bytes, s.q0, n.hidden, shape.words, &first.x0, &first.x1);
        load_pair<DT>((const char*)n.residual + s.first_row * shape.bytes, s.q0, n.hidden, shape.words, &first.r0, &first.r1);
        load_pair<DT>(n.weight, s.q0, n.hidden, shape.words, &first.w0, &first.w1);
    }
    const Call call = begin_call(a, DT | TPAR_HEADER_FUSED);
    fused_push_rows<DT>(a, n, shape, call, all_ranks(a), s.first_row, s.row_stride, s.q0, s.step, s.mine, first.x0, first.x1);

    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 row_warps = norm_row_warps(shape.quads);
    // Where one block has the whole row, or the row's blocks are one cluster, the warps exchange
    // their sums in shared memory.
    const bool shared_row = s.per_row == 1 || CLUSTER;
    bool ok = true;
    for (u64 row = s.first_row; row < n.rows; row += s.row_stride) {
        u64* const row_lines = norm_exchange_lines(a) + row * row_warps;  // one per warp of the row
        float kept[4] = {0.f, 0.f, 0.f, 0.f};  // residual_out of the first chunk, for y
        for (u32 j = 0; j < s.mine; ++j) {
            const u64 q = s.q0 + j * s.step;
            float partial = 0.f;
            if (q < shape.quads) {
                float acc[4];
                partial = fused_reduce_quad<DT>(a, n, shape, s, call, first, row, j, q, &ok, acc);
                if (j == 0) {
                    for (int e = 0; e < 4; ++e) kept[e] = acc[e];
                }
            }
            // The warp's sum of squares, the tree's first level, published at once for the row
            // (warps past the row publish nothing).
            const float warp_sum = butterfly_sum(partial);
            const u32 row_warp = (u32)((q - lane) / 32);
            if (CLUSTER) {
#if TPAR_HAS_CLUSTERS
                // Lane b stores the sum into block b of the cluster (the row's block b: the
                // cluster is the row's per_row consecutive blocks).
                if (lane < s.per_row && row_warp < row_warps) {
                    cluster_store_f32(&tpar_norm_warp_sums[row_warp / 16][row_warp % 16], lane, warp_sum);
                }
#endif
            } else if (lane == 0 && row_warp < row_warps) {
                if (shared_row) {
                    tpar_norm_warp_sums[row_warp / 16][row_warp % 16] = warp_sum;
                } else {
                    st_sys(row_lines + row_warp, pack_line(call.tag, __float_as_uint(warp_sum)));
                }
            }
        }
        // The warp sums of the row are folded as norm.rs's tree (each segment's 16, two segments
        // at a time, then the segment sums in order). Where they are in shared memory every warp
        // folds them itself (the same bits), with no barrier to hand 1/rms on and none after the
        // last row, which nothing reuses them for: one H100, hidden 8192 bf16, ranks as streams,
        // 2026-12-07 (bench/results/2026-12-07-s23, calls 3, 5 and 6, each way twice, against
        // warp 0 folding for the block), 2 ranks x 1 / 2 / 4 tokens 3.58 / 3.68 / 3.73 -> 3.45 /
        // 3.55 / 3.60 us, 8 ranks x 1 token 5.61 -> 5.48. Warp 0 waits for the lines of the
        // exchange through device memory and hands 1/rms on. fused_oneshot.cu's whole blocks
        // keep warp 0's fold: tried there (fba6698, TPAR_FUSED_FOLD_EVERY_WARP), 8 ranks x 8
        // tokens took 15.88 -> 16.36 us (bench/README.md, "Twenty-third session"). Every thread
        // folding the sums itself from float4 broadcast loads, with no shuffle, and the cluster
        // form's sums as LL lines in shared memory instead of its barrier were slower together
        // (branch s25-fold, one H100: 2 x 1 / 2 / 4 tokens 3.46 / 3.57 / 3.65 -> 3.55 / 3.77 /
        // 3.81 us, 8 x 1 5.47 -> 5.57; bench/results/2026-12-07-s25).
        if (shared_row) block_or_cluster_sync(CLUSTER);
        float inv = 0.f;
        if (warp == 0 || shared_row) {
            // The cluster form folds two pairs of segments a step (all four of hidden 8192
            // bf16), with no branch between their folds, so that the two chains of shuffles
            // overlap: one H100, hidden 8192 bf16, ranks as streams, 2026-12-07
            // (bench/results/2026-12-07-s26, call 1, against main's kernels in one call), 2
            // ranks x 1 / 2 / 4 tokens 3.46 / 3.54 / 3.62 -> 3.38 / 3.46 / 3.54 us, 8 ranks x 1
            // 5.47-5.49 -> 5.41-5.42; the rest within 0.05. The form that waits for lines in
            // device memory keeps a pair a step (the wait inlined twice: a larger kernel, not
            // measured).
            constexpr u32 PAIRS_A_STEP = CLUSTER ? 2 : 1;
            float ss = 0.f;
            for (u32 pair = 0; 2 * pair < segments; pair += PAIRS_A_STEP) {
                float v[PAIRS_A_STEP];
#pragma unroll
                for (u32 h = 0; h < PAIRS_A_STEP; ++h) {
                    const u32 row_warp = (2 * (pair + h) + (lane >> 4)) * 16 + (lane & 15);
                    v[h] = 0.f;
                    if (row_warp < row_warps) {
                        v[h] = shared_row ? tpar_norm_warp_sums[row_warp / 16][row_warp % 16] : exchange_sum(a, call, row_lines + row_warp, &ok);
                    }
                }
#pragma unroll
                for (u32 h = 0; h < PAIRS_A_STEP; ++h) v[h] = norm_segment_pair_fold(v[h]);
#pragma unroll
                for (u32 h = 0; h < PAIRS_A_STEP; ++h) {
                    const u32 first = 2 * (pair + h);  // the pair's first segment
                    const float even = __shfl_sync(0xffffffffu, v[h], 0), odd = __shfl_sync(0xffffffffu, v[h], 16);
                    if (first < segments) ss = first == 0 ? even : __fadd_rn(ss, even);
                    if (first + 1 < segments) ss = __fadd_rn(ss, odd);
                }
            }
            inv = norm_inv_of_sum(ss, n.hidden, n.eps);
            if (lane == 0 && !shared_row) tpar_norm_inv = inv;
        }
        if (!shared_row) {
            __syncthreads();
            inv = tpar_norm_inv;
        }
        const char* residual_out = (const char*)n.residual_out + row * shape.bytes;
        fused_y_row<DT>(n, shape, row, residual_out, s.q0, s.step, s.mine, kept, first.w0, first.w1, inv);
        // The shared sums and 1/rms are reused by the next row (none after the last); in a
        // cluster other blocks store into them, so the whole cluster must be past this row's fold.
        if (row + s.row_stride < n.rows) block_or_cluster_sync(CLUSTER);
    }
    end_call(a, call);
}

template <int DT>
__device__ void fused_oneshot_small_blocks(const TparFusedArgs& f) {
    fused_oneshot_small<DT, false>(f);
}
template <int DT>
__device__ void fused_oneshot_small_clusters(const TparFusedArgs& f) {
    fused_oneshot_small<DT, true>(f);
}

TPAR_KERNELS_PER_DTYPE(tpar_fused_oneshot_small_blocks, fused_oneshot_small_blocks, TparFusedArgs)
TPAR_KERNELS_PER_DTYPE(tpar_fused_oneshot_small_clusters, fused_oneshot_small_clusters, TparFusedArgs)
