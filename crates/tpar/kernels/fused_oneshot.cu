// Fused one-shot push allreduce + residual add + RMSNorm (also host-staged, with the inboxes in
// pinned host memory). The push and the wait are one-shot's (16-byte LL lines, the data its
// own signal, carrying the call's identity; triple buffers), but the slot is laid out by rows: row r of the
// launch starts at quad r * row_quads, so rows never share a line.
//
// This file's kernels take whole blocks of TPAR_NORM_THREADS; up to 4 ranks, where the grid
// holds smaller blocks for every chunk of every row (a few tokens), the host launches
// fused_oneshot_small.cu instead (the same call on blocks of 128 or 256 threads), and also on
// whole blocks in launches of up to 8 rows that wait per peer (fused.rs, WHOLE_BLOCK_FEW_ROWS).
//
// A row is spread over `blocks_per_row` blocks, as the plain one-shot spreads its lines: block
// `part` of a row takes the row's segments part, part + blocks_per_row, ... (a segment is
// TPAR_NORM_THREADS quads, one per thread), so at one token the push and the wait use as many
// SMs as the plain allreduce of the same bytes (host-staged too: its inboxes are host memory,
// but the exchange below is not). The row's sum of squares needs every segment: each block
// publishes its segments' tree sums as LL lines in this rank's device state (fused.cuh,
// norm_exchange_lines) and reads all of them back in segment order, so every block and every
// rank get the same bits. The blocks of one row are co-resident (every block of the grid is,
// as the protocol requires), so this wait ends. With one block per row there is no exchange.
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
// Where the GPU has thread block clusters (sm_90+) the host may launch the cluster forms
// (tpar_fused_oneshot_clusters_*): a row's blocks are one cluster, each block stores its segment
// sums into every block's shared memory and one cluster barrier replaces the exchange through
// device memory; the sums, read in segment order, and so the bits, are the same.
// A fused kernel: one wait site per group of peers (tuning.cuh, TPAR_WAIT_SITE_PER_GROUP). It
// is also compiled with one site per peer (tpar_fused_oneshot_peer_sites_*), which the host
// launches at small world sizes (fused.rs, FUSED_PEER_SITE_RANKS, with the measurement).
#define TPAR_FUSED_KERNEL 1
#include "tpar_ll.cuh"

template <int DT, bool SITE_PER_GROUP, bool CLUSTER>
__device__ void fused_oneshot(const TparFusedArgs& f) {
    trap_without_clusters<CLUSTER>();
    const TparArgs& a = f.a;
    const TparNormArgs& n = f.n;
    const NormRow shape = norm_row<DT>(n.hidden);
    const u64 quads = shape.quads, words = shape.words, row_bytes = shape.bytes;
    const u32 segments = shape.segments;
    const u32 per_row = n.blocks_per_row;
    const u32 part = blockIdx.x % per_row;
    const u64 first_row = blockIdx.x / per_row;
    const u64 row_stride = gridDim.x / per_row;
    // This block's segments of each row: part, part + per_row, ... (the host keeps
    // per_row <= segments, so every block has at least one).
    const u32 mine = part < segments ? (segments - part + per_row - 1) / per_row : 0;
    const u64 q0 = (u64)part * TPAR_NORM_THREADS + threadIdx.x;  // the thread's quad of its first segment

    // Before the call counter: the first row's input and residual and the weight of the first
    // segment (the same for every row). After pdl_wait: the previous kernel may write them.
    pdl_wait();
    u32 x0 = 0, x1 = 0, r0 = 0, r1 = 0, w0 = 0, w1 = 0;
    if (first_row < n.rows && mine > 0 && q0 < quads) {
        load_pair<DT>((const char*)a.input + first_row * row_bytes, q0, n.hidden, words, &x0, &x1);
        load_pair<DT>((const char*)n.residual + first_row * row_bytes, q0, n.hidden, words, &r0, &r1);
        load_pair<DT>(n.weight, q0, n.hidden, words, &w0, &w1);
    }
    const Call call = begin_call(a, DT | TPAR_HEADER_FUSED);
    const u32 tag = call.tag;
    const u32 everyone = all_ranks(a);
    fused_push_rows<DT>(a, n, shape, call, everyone, first_row, row_stride, q0, (u64)per_row * TPAR_NORM_THREADS, mine, x0, x1);
    u64* const exchange = norm_exchange_lines(a);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    bool ok = true;
    for (u64 row = first_row; row < n.rows; row += row_stride) {
        const char* x = (const char*)a.input + row * row_bytes;
        const char* residual = (const char*)n.residual + row * row_bytes;
        char* residual_out = (char*)n.residual_out + row * row_bytes;
        float first[4] = {0.f, 0.f, 0.f, 0.f};  // residual_out of the first segment, for y
        for (u32 j = 0; j < mine; ++j) {
            const u64 q = q0 + (u64)j * per_row * TPAR_NORM_THREADS;
            float partial = 0.f;
            if (q < quads) {
                u32 own0 = x0, own1 = x1, res0 = r0, res1 = r1;
                if (row != first_row || j != 0) {
                    load_pair<DT>(x, q, n.hidden, words, &own0, &own1);
                    load_pair<DT>(residual, q, n.hidden, words, &res0, &res1);
                }
                float acc[4] = {0.f, 0.f, 0.f, 0.f};
                // After a failed wait the thread stops waiting but goes on to every barrier.
                if (ok) ok = reduce_unit<DT, SITE_PER_GROUP>(a, call, everyone, row * quads + q, own0, own1, TPAR_PHASE_ONE_SHOT, acc);
                round_quad<DT>(acc);  // the allreduce's result, rounded once
                u32 o0, o1;
                partial = residual_quad<DT>(acc, res0, res1, &o0, &o1);
                store_pair<DT>(residual_out, q, n.hidden, words, o0, o1);
                if (j == 0) {
                    for (int e = 0; e < 4; ++e) first[e] = acc[e];
                }
            }
            norm_warp_fold(j, partial);
        }
        __syncthreads();
        float inv;
        if (per_row == 1) {
            // Warp j folds segment j, warp 0 the segment sums. Every thread folding all of them
            // itself from shared memory was slower: 8 ranks x 4 / 8 tokens 12.14 / 16.03 ->
            // 12.49 / 16.35 us on one H100 (branch s25-fold, bench/results/2026-12-07-s25).
            float s = 0.f;
            if (warp < mine) s = norm_segment_fold(warp);
            if (lane == 0 && warp < mine) tpar_norm_segment_sums[warp] = s;
            __syncthreads();
            if (warp == 0) {
                const float sum = lane < segments ? tpar_norm_segment_sums[lane] : 0.f;
                const float i = norm_inv(sum, segments, n.hidden, n.eps);
                if (lane == 0) tpar_norm_inv = i;
            }
        } else if (CLUSTER) {
#if TPAR_HAS_CLUSTERS
            // Lane b stores the block's segment sums into block b of the cluster (the row's
            // block b), then every block reads all of them in segment order.
            if (warp < mine) {
                const float s = norm_segment_fold(warp);
                if (lane < per_row) cluster_store_f32(&tpar_norm_segment_sums[part + warp * per_row], lane, s);
            }
            cluster_sync();
            if (warp == 0) {
                const float sum = lane < segments ? tpar_norm_segment_sums[lane] : 0.f;
                const float i = norm_inv(sum, segments, n.hidden, n.eps);
                if (lane == 0) tpar_norm_inv = i;
            }
#endif
        } else {
            // Publish this block's segment sums, then read every segment's in order.
            if (warp < mine) {
                const float s = norm_segment_fold(warp);
                if (lane == 0) {
                    st_sys(exchange + row * segments + part + warp * per_row, pack_line(tag, __float_as_uint(s)));
                }
            }
            if (warp == 0) {
                const float s = lane < segments ? exchange_sum(a, call, exchange + row * segments + lane, &ok) : 0.f;
                const float i = norm_inv(s, segments, n.hidden, n.eps);
                if (lane == 0) tpar_norm_inv = i;
            }
        }
        __syncthreads();
        inv = tpar_norm_inv;
        fused_y_row<DT>(n, shape, row, residual_out, q0, (u64)per_row * TPAR_NORM_THREADS, mine, first, w0, w1, inv);
        // The shared sums are reused by the next row; in a cluster other blocks store into
        // them, so the whole cluster must be past this row's fold.
        block_or_cluster_sync(CLUSTER && per_row > 1 && row + row_stride < n.rows);
    }
    end_call(a, call);
}

template <int DT> __device__ __forceinline__ void fused_oneshot_group_sites(const TparFusedArgs& f) {
    fused_oneshot<DT, TPAR_WAIT_SITE_PER_GROUP != 0, false>(f);
}
template <int DT> __device__ __forceinline__ void fused_oneshot_peer_sites(const TparFusedArgs& f) {
    fused_oneshot<DT, false, false>(f);
}
template <int DT> __device__ __forceinline__ void fused_oneshot_group_sites_clusters(const TparFusedArgs& f) {
    fused_oneshot<DT, TPAR_WAIT_SITE_PER_GROUP != 0, true>(f);
}
template <int DT> __device__ __forceinline__ void fused_oneshot_peer_sites_clusters(const TparFusedArgs& f) {
    fused_oneshot<DT, false, true>(f);
}

TPAR_KERNELS_PER_DTYPE(tpar_fused_oneshot, fused_oneshot_group_sites, TparFusedArgs)
TPAR_KERNELS_PER_DTYPE(tpar_fused_oneshot_peer_sites, fused_oneshot_peer_sites, TparFusedArgs)
TPAR_KERNELS_PER_DTYPE(tpar_fused_oneshot_clusters, fused_oneshot_group_sites_clusters, TparFusedArgs)
TPAR_KERNELS_PER_DTYPE(tpar_fused_oneshot_peer_sites_clusters, fused_oneshot_peer_sites_clusters, TparFusedArgs)
