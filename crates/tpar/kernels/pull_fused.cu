// Fused one-shot pull allreduce + residual add + RMSNorm (issue 15): oneshot_pull.cu's
// transport with the epilogue of fused.cuh, for machines where reading a peer's memory beats
// writing to it.
//
// One block per row (grid-stride over the launch's rows; the grid is the same on every rank,
// as for the plain pull). Each block copies its rows' x into this rank's own pull buffer
// (plain data, rotated by epoch; row r at quad r * row_quads), fences and raises its flag to
// the epoch; then thread r of the block waits for rank r's flag of the same block (acquire:
// that rank's rows of this block are then visible; the block's barrier passes that on to
// every thread), and thread t reads quads t, t + TPAR_NORM_THREADS, ... of each row from every
// rank in rank order (its own term from its input; the loads batched, see below), rounds the
// sum once, adds the residual, rounds, and folds the row's sum-of-squares tree (one block holds the whole row, as the
// separate norm kernel does), then stores residual_out and y. A thread reads back only what
// it wrote (residual_out) or what a peer published, so in place (y over x, residual_out over
// residual) is safe: peers read this rank's pull buffer, never its x.
//
// The flag waits take the call's deadline (keep_waiting) and compare the peer's call header
// with ours on every deadline check, so a mismatched call is named as one. After a failed
// wait the block stops reading its peers but reaches every barrier, so the kernel exits.
#include "tpar_ll.cuh"

// Peers whose quads a thread loads at once (with TPAR_NORM_BATCH segments of them).
#define TPAR_PULL_GROUP 4

// Waits until rank `peer`'s flag of this block reaches `epoch` (acquire).
__device__ __forceinline__ bool wait_pull_flag(const TparArgs& a, u32 peer, u64 epoch, u32 tag, int code,
                                               u64 start) {
    const u64* p = pull_flag(a.inboxes[peer], a, blockIdx.x);
    Wait w = begin_wait(pull_flag_polls());
    while ((i64)(ld_acquire_sys(p) - epoch) < 0) {
        if (!keep_waiting(a, w, start, peer, TPAR_PHASE_PULL_FLAG, HeaderMatches{a, epoch, tag, code, peer})) {
            return false;
        }
    }
    return true;
}

template <int DT>
__device__ void fused_pull(const TparFusedArgs& f) {
    const TparArgs& a = f.a;
    const TparNormArgs& n = f.n;
    const u64 quads = norm_row_quads<DT>(n.hidden);
    const u64 words = words_for<DT>(n.hidden);
    const u64 row_bytes = n.hidden * elem_bytes<DT>();
    const u32 segments = norm_segments(quads);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int code = DT | TPAR_HEADER_FUSED;
    const Call call = begin_call(a, code);
    const u64 epoch = call.epoch;

    // This block's rows into this rank's pull buffer, as quads (two payload words each).
    u64* const mine = (u64*)pull_data(a.inboxes[a.rank], a, epoch);
    for (u64 row = blockIdx.x; row < n.rows; row += gridDim.x) {
        const char* x = (const char*)a.input + row * row_bytes;
        for (u64 q = threadIdx.x; q < quads; q += TPAR_NORM_THREADS) {
            u32 w0, w1;
            load_pair<DT>(x, q, n.hidden, words, &w0, &w1);
            mine[row * quads + q] = ((u64)w1 << 32) | w0;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        st_release_sys(pull_flag(a.inboxes[a.rank], a, blockIdx.x), epoch);
    }
    bool ok = true;
    if (threadIdx.x < a.world_size && threadIdx.x != a.rank) {
        ok = wait_pull_flag(a, threadIdx.x, epoch, call.tag, code, call.start);
    }
    const bool all_ok = __syncthreads_and(ok);

    // Per row, a thread's quads in batches of TPAR_NORM_BATCH segments: the batch's residual
    // and own input quads, then the peers' quads in groups of TPAR_PULL_GROUP ranks, every load
    // of a group issued before any is used, so a batch costs one round trip per group instead
    // of one per segment and rank (a remote read each, on separate GPUs). With the row in one
    // batch (8192 f16/bf16), residual_out and the weight stay in registers for y.
    const bool one_batch = segments <= TPAR_NORM_BATCH;
    for (u64 row = blockIdx.x; row < n.rows; row += gridDim.x) {
        const char* x = (const char*)a.input + row * row_bytes;
        const char* residual = (const char*)n.residual + row * row_bytes;
        char* residual_out = (char*)n.residual_out + row * row_bytes;
        float v[TPAR_NORM_BATCH][4];
        u32 wt[TPAR_NORM_BATCH][2];
        for (u32 base = 0; base < segments; base += TPAR_NORM_BATCH) {
            u32 own[TPAR_NORM_BATCH][2], res[TPAR_NORM_BATCH][2];
#pragma unroll
            for (u32 b = 0; b < TPAR_NORM_BATCH; ++b) {
                const u64 q = (u64)(base + b) * TPAR_NORM_THREADS + threadIdx.x;
                own[b][0] = own[b][1] = res[b][0] = res[b][1] = wt[b][0] = wt[b][1] = 0;
                if (base + b < segments && q < quads) {
                    load_pair<DT>(x, q, n.hidden, words, &own[b][0], &own[b][1]);
                    load_pair<DT>(residual, q, n.hidden, words, &res[b][0], &res[b][1]);
                    if (one_batch) load_pair<DT>(n.weight, q, n.hidden, words, &wt[b][0], &wt[b][1]);
                }
            }
            for (u32 g = 0; g < a.world_size; g += TPAR_PULL_GROUP) {
                u64 got[TPAR_NORM_BATCH][TPAR_PULL_GROUP];
#pragma unroll
                for (u32 b = 0; b < TPAR_NORM_BATCH; ++b) {
                    const u64 q = (u64)(base + b) * TPAR_NORM_THREADS + threadIdx.x;
#pragma unroll
                    for (u32 k = 0; k < TPAR_PULL_GROUP; ++k) {
                        const u32 r = g + k;
                        got[b][k] = 0;
                        if (all_ok && r < a.world_size && r != a.rank && base + b < segments && q < quads) {
                            got[b][k] = ld_sys((const u64*)pull_data(a.inboxes[r], a, epoch) + row * quads + q);
                        }
                    }
                }
#pragma unroll
                for (u32 b = 0; b < TPAR_NORM_BATCH; ++b) {
#pragma unroll
                    for (u32 k = 0; k < TPAR_PULL_GROUP; ++k) {
                        const u32 r = g + k;
                        if (r >= a.world_size) break;
                        const u32 w0 = r == a.rank ? own[b][0] : (u32)got[b][k];
                        const u32 w1 = r == a.rank ? own[b][1] : (u32)(got[b][k] >> 32);
                        float xv[4];
                        unpack_quad<DT>(w0, w1, xv);
                        for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) v[b][e] = (r == 0) ? xv[e] : v[b][e] + xv[e];
                    }
                }
            }
#pragma unroll
            for (u32 b = 0; b < TPAR_NORM_BATCH; ++b) {
                if (base + b >= segments) break;  // uniform across the block
                const u64 q = (u64)(base + b) * TPAR_NORM_THREADS + threadIdx.x;
                float partial = 0.f;
                if (q < quads) {
                    round_quad<DT>(v[b]);  // the allreduce's result, rounded once
                    u32 o0, o1;
                    partial = residual_quad<DT>(v[b], res[b][0], res[b][1], &o0, &o1);
                    store_pair<DT>(residual_out, q, n.hidden, words, o0, o1);
                }
                norm_warp_fold(base + b, partial);
            }
        }
        __syncthreads();
        if (warp < segments) {
            const float s = norm_segment_fold(warp);
            if (lane == 0) tpar_norm_segment_sums[warp] = s;
        }
        __syncthreads();
        if (warp == 0) {
            const float sum = lane < segments ? tpar_norm_segment_sums[lane] : 0.f;
            const float i = norm_inv(sum, segments, n.hidden, n.eps);
            if (lane == 0) tpar_norm_inv = i;
        }
        __syncthreads();
        const float inv = tpar_norm_inv;
        char* y = (char*)n.y + row * row_bytes;
        store_y_batches<DT>(n, residual_out, y, quads, words, segments, inv, v, wt);
        __syncthreads();  // the shared sums are reused by the next row
    }
    if (all_ok) check_header(a, epoch, call.tag, code, call.start);
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_fused_pull, fused_pull, TparFusedArgs)
