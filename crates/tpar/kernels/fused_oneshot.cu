// Fused one-shot push allreduce + residual add + RMSNorm (also host-staged, with the inboxes in
// pinned host memory). The push and the wait are one-shot's (16-byte LL lines, the data its
// own signal, carrying the call's identity; triple buffers), but the slot is laid out by rows: row r of the
// launch starts at quad r * row_quads, so rows never share a line.
//
// A row is cut into chunks of the block's size in quads (a thread each) and spread over
// `blocks_per_row` blocks, as the plain one-shot spreads its lines: block `part` of a row takes
// its chunks part, part + blocks_per_row, ... The host picks the block size (fused.rs,
// fused_block_threads): at one or two tokens blocks of 128 threads, the plain allreduce's, so
// that the push and the wait use as many SMs as the allreduce of the same bytes; where the grid
// cannot hold that, whole blocks of TPAR_NORM_THREADS (host-staged always: its inboxes are
// host memory, but the exchange below is not). The row's sum of squares needs every quad, in
// norm.rs's tree (warps of 32 quads, segments of 16 warps, the segment sums in order), so the
// blocks of a row exchange sums as LL lines in this rank's device state (fused.cuh,
// norm_exchange_lines): whole blocks fold their segments themselves and publish segment sums;
// smaller blocks publish each warp's sum, and warp 0 of every block folds all of them. Every
// block and every rank get the same bits. The blocks of one row are co-resident (every block
// of the grid is, as the protocol requires), so these waits end. With one block per row the
// sums stay in shared memory.
//
// Latency: everything a thread needs that no peer produces (its input, residual and weight
// quads) is loaded before the call counter, so those loads overlap its round trip; the rounded
// residual_out stays in registers for y. Each further row a block takes costs the whole chain
// after its data again (trees, exchange, 1/rms, y), so the host gives every block one row
// where the grid allows (fused.rs, fused_shape). A block taking its rows in batches, one
// chain per batch, was faster where blocks take two rows but slower by 0.28 us where they
// take one, from its code alone (bench/results/2026-12-01-h200-s5-fused-grid).
//
// A failed wait (deadline, mismatched header) sets the error word; the thread then stops
// waiting but still publishes its sums and reaches every barrier, so the kernel exits.
// Compiled twice: tpar_fused_oneshot_* with one wait site per group of peers (a fused kernel:
// tuning.cuh, TPAR_WAIT_SITE_PER_GROUP) and whole blocks only, and
// tpar_fused_oneshot_peer_sites_* with one site per peer and the host's block size, which the
// host launches at small world sizes (fused.rs, FUSED_PEER_SITE_RANKS, with the measurements:
// at 8 ranks sharing one GPU the first was faster at 1, 2 and 8 tokens than a kernel that takes
// both block sizes, on whole blocks or on blocks of 256).
#define TPAR_FUSED_KERNEL 1
#include "tpar_ll.cuh"
// A sum of squares another block of the row published in `line` (bits beside the call's tag);
// 0 once a wait has failed.
__device__ __forceinline__ float row_sum(const TparArgs& a, const Call& call, const u64* line, bool* ok) {
    const u64 v = ld_sys(line);
    u32 bits = 0;
    if ((u32)(v >> 32) == call.tag) {
        bits = (u32)v;
    } else if (*ok) {
        *ok = wait_line(a, call, line, TPAR_PHASE_ONE_SHOT, &bits);
    }
    return __uint_as_float(bits);
}

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

// The thread's quads pushed to every rank, row by row; its first quad from `first`.
template <int DT>
__device__ __forceinline__ void fused_push_rows(const TparArgs& a, const TparNormArgs& n, const NormRow& shape,
                                                const FusedSpread& s, const Call& call, const FusedFirst& first) {
    const u32 everyone = all_ranks(a);
    const u64 my_slot = slot_payload(a, call.epoch, a.rank);
    for (u64 row = s.first_row; row < n.rows; row += s.row_stride) {
        const char* x = (const char*)a.input + row * shape.bytes;
        for (u32 j = 0; j < s.mine; ++j) {
            const u64 q = s.q0 + j * s.step;
            if (q >= shape.quads) continue;
            u32 p0 = first.x0, p1 = first.x1;
            if (row != s.first_row || j != 0) load_pair<DT>(x, q, n.hidden, shape.words, &p0, &p1);
            push_unit_to(a, call, everyone, my_slot + 2 * (row * shape.quads + q), p0, p1);
        }
    }
}

// Quad q of `row` once its lines arrive: the allreduce in rank order (rounded once, left in
// `acc`), plus the residual (rounded), stored as residual_out. Returns the thread's partial of
// the sum of squares. After a failed wait the thread stops waiting but goes on to every barrier.
template <int DT, bool SITE_PER_GROUP>
__device__ __forceinline__ float fused_reduce_quad(const TparArgs& a, const TparNormArgs& n, const NormRow& shape,
                                                   const FusedSpread& s, const Call& call, const FusedFirst& first,
                                                   u64 row, u32 j, u64 q, bool* ok, float* acc) {
    u32 own0 = first.x0, own1 = first.x1, res0 = first.r0, res1 = first.r1;
    if (row != s.first_row || j != 0) {
        load_pair<DT>((const char*)a.input + row * shape.bytes, q, n.hidden, shape.words, &own0, &own1);
        load_pair<DT>((const char*)n.residual + row * shape.bytes, q, n.hidden, shape.words, &res0, &res1);
    }
    for (int e = 0; e < 4; ++e) acc[e] = 0.f;
    if (*ok) *ok = reduce_unit<DT, SITE_PER_GROUP>(a, call, all_ranks(a), row * shape.quads + q, own0, own1, TPAR_PHASE_ONE_SHOT, acc);
    round_quad<DT>(acc);
    u32 o0, o1;
    const float partial = residual_quad<DT>(acc, res0, res1, &o0, &o1);
    store_pair<DT>((char*)n.residual_out + row * shape.bytes, q, n.hidden, shape.words, o0, o1);
    return partial;
}

// y for the thread's quads of `row`, with the block's 1/rms: its first quad's residual_out
// from registers (`kept`), the others read back (this thread wrote them).
template <int DT>
__device__ __forceinline__ void fused_y_row(const TparNormArgs& n, const NormRow& shape, const FusedSpread& s,
                                            const FusedFirst& first, u64 row, const float* kept, float inv) {
    const char* residual_out = (const char*)n.residual_out + row * shape.bytes;
    char* y = (char*)n.y + row * shape.bytes;
    for (u32 j = 0; j < s.mine; ++j) {
        const u64 q = s.q0 + j * s.step;
        if (q >= shape.quads) continue;
        float v[4];
        u32 wt0 = first.w0, wt1 = first.w1;
        if (j == 0) {
            for (int e = 0; e < 4; ++e) v[e] = kept[e];
        } else {
            u32 v0, v1;
            load_pair<DT>(residual_out, q, n.hidden, shape.words, &v0, &v1);
            unpack_quad<DT>(v0, v1, v);
            load_pair<DT>(n.weight, q, n.hidden, shape.words, &wt0, &wt1);
        }
        u32 y0, y1;
        y_quad<DT>(v, wt0, wt1, inv, &y0, &y1);
        store_pair<DT>(y, q, n.hidden, shape.words, y0, y1);
    }
}

// The kernel. WHOLE_BLOCKS: blocks of TPAR_NORM_THREADS, each folding its segments and
// exchanging segment sums; else blocks of the host's size, smaller (blockDim.x, a multiple of
// 32 dividing TPAR_NORM_THREADS: a warp's 32 quads are one warp of the row's tree), exchanging
// warp sums.
template <int DT, bool SITE_PER_GROUP, bool WHOLE_BLOCKS>
__device__ void fused_oneshot(const TparFusedArgs& f) {
    const TparArgs& a = f.a;
    const TparNormArgs& n = f.n;
    const NormRow shape = norm_row<DT>(n.hidden);
    const u32 segments = shape.segments;
    const u32 chunk = WHOLE_BLOCKS ? TPAR_NORM_THREADS : blockDim.x;
    const FusedSpread s = fused_spread(n, shape.quads, chunk);

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
    fused_push_rows<DT>(a, n, shape, s, call, first);

    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 row_warps = norm_row_warps(shape.quads);
    // Where one block has the whole row its warps exchange their sums in shared memory.
    const bool shared_row = s.per_row == 1;
    bool ok = true;
    for (u64 row = s.first_row; row < n.rows; row += s.row_stride) {
        // The row's exchange lines: one per segment (whole blocks) or per warp of the row.
        u64* const row_lines = norm_exchange_lines(a) + row * (WHOLE_BLOCKS ? segments : row_warps);
        float kept[4] = {0.f, 0.f, 0.f, 0.f};  // residual_out of the first chunk, for y
        for (u32 j = 0; j < s.mine; ++j) {
            const u64 q = s.q0 + j * s.step;
            float partial = 0.f;
            if (q < shape.quads) {
                float acc[4];
                partial = fused_reduce_quad<DT, SITE_PER_GROUP>(a, n, shape, s, call, first, row, j, q, &ok, acc);
                if (j == 0) {
                    for (int e = 0; e < 4; ++e) kept[e] = acc[e];
                }
            }
            if (WHOLE_BLOCKS) {
                norm_warp_fold(j, partial);
            } else {
                // The warp's sum of squares, the tree's first level, published at once for the
                // row (warps past the row publish nothing).
                const float warp_sum = butterfly_sum(partial);
                const u32 row_warp = (u32)((q - lane) / 32);
                if (lane == 0 && row_warp < row_warps) {
                    if (shared_row) {
                        tpar_norm_warp_sums[row_warp / 16][row_warp % 16] = warp_sum;
                    } else {
                        st_sys(row_lines + row_warp, pack_line(call.tag, __float_as_uint(warp_sum)));
                    }
                }
            }
        }
        if (WHOLE_BLOCKS) {
            // Warp w folds the block's w-th segment; its sum goes to shared memory (one block a
            // row) or to the row's line of that segment, and warp 0 reads them in order.
            __syncthreads();
            if (shared_row) {
                float sum = 0.f;
                if (warp < s.mine) sum = norm_segment_fold(warp);
                if (lane == 0 && warp < s.mine) tpar_norm_segment_sums[warp] = sum;
                __syncthreads();
                if (warp == 0) {
                    const float v = lane < segments ? tpar_norm_segment_sums[lane] : 0.f;
                    const float i = norm_inv(v, segments, n.hidden, n.eps);
                    if (lane == 0) tpar_norm_inv = i;
                }
            } else {
                if (warp < s.mine) {
                    const float sum = norm_segment_fold(warp);
                    if (lane == 0) st_sys(row_lines + s.part + warp * s.per_row, pack_line(call.tag, __float_as_uint(sum)));
                }
                if (warp == 0) {
                    const float v = lane < segments ? row_sum(a, call, row_lines + lane, &ok) : 0.f;
                    const float i = norm_inv(v, segments, n.hidden, n.eps);
                    if (lane == 0) tpar_norm_inv = i;
                }
            }
        } else {
            // Warp 0 folds every warp sum of the row as norm.rs's tree (each segment's 16, two
            // segments at a time, then the segment sums in order).
            if (shared_row) __syncthreads();
            if (warp == 0) {
                float ss = 0.f;
                for (u32 pair = 0; 2 * pair < segments; ++pair) {
                    const u32 row_warp = (2 * pair + (lane >> 4)) * 16 + (lane & 15);
                    float v = 0.f;
                    if (row_warp < row_warps) {
                        v = shared_row ? tpar_norm_warp_sums[row_warp / 16][row_warp % 16] : row_sum(a, call, row_lines + row_warp, &ok);
                    }
                    v = norm_segment_pair_fold(v);
                    const float even = __shfl_sync(0xffffffffu, v, 0), odd = __shfl_sync(0xffffffffu, v, 16);
                    ss = pair == 0 ? even : __fadd_rn(ss, even);
                    if (2 * pair + 1 < segments) ss = __fadd_rn(ss, odd);
                }
                const float i = norm_inv_of_sum(ss, n.hidden, n.eps);
                if (lane == 0) tpar_norm_inv = i;
            }
        }
        __syncthreads();
        fused_y_row<DT>(n, shape, s, first, row, kept, tpar_norm_inv);
        __syncthreads();  // the shared sums and 1/rms are reused by the next row
    }
    end_call(a, call);
}

template <int DT> __device__ __forceinline__ void fused_oneshot_group_sites(const TparFusedArgs& f) {
    fused_oneshot<DT, TPAR_WAIT_SITE_PER_GROUP != 0, true>(f);
}
template <int DT> __device__ __forceinline__ void fused_oneshot_peer_sites(const TparFusedArgs& f) {
    fused_oneshot<DT, false, true>(f);
}
template <int DT> __device__ __forceinline__ void fused_oneshot_small_blocks(const TparFusedArgs& f) {
    fused_oneshot<DT, false, false>(f);
}

TPAR_KERNELS_PER_DTYPE(tpar_fused_oneshot, fused_oneshot_group_sites, TparFusedArgs)
TPAR_KERNELS_PER_DTYPE(tpar_fused_oneshot_peer_sites, fused_oneshot_peer_sites, TparFusedArgs)
TPAR_KERNELS_PER_DTYPE(tpar_fused_oneshot_small_blocks, fused_oneshot_small_blocks, TparFusedArgs)
