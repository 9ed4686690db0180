// Fused one-shot push allreduce + residual add + RMSNorm (also host-staged, with the inboxes in
// pinned host memory). The push and the wait are one-shot's (16-byte LL lines, the data its
// own signal, tags by epoch, triple buffers), but the slot is laid out by rows: row r of the
// launch starts at quad r * row_quads, so a block owns whole rows, pushes them, reduces them
// in rank order, and finishes the norm of each row without leaving the block. Thread t of a
// block handles quads t, t + 512, ... of each of its rows in every phase, so it reads back
// only what it wrote itself (in-place calls are safe) and the sum of squares has the fixed
// order of crates/tpar/src/norm.rs.
//
// A failed wait (deadline, mismatched header) sets the error word; the thread then stops
// waiting but still reaches every barrier of its block, so the kernel exits.
#include "tpar_ll.cuh"

template <int DT>
__device__ void fused_oneshot(const TparFusedArgs& f) {
    const TparArgs& a = f.a;
    const TparNormArgs& n = f.n;
    const EpochTicket ticket = begin_epoch(a);
    const u64 epoch = ticket.epoch;
    const u32 tag = tag_for_epoch(epoch);
    const u64 start = now_ns();
    const int code = DT | TPAR_HEADER_FUSED;
    push_header(a, epoch, tag, code);
    const u64 quads = norm_row_quads<DT>(n.hidden);
    const u64 words = words_for<DT>(n.hidden);
    const u64 my_slot = stage_one_slot(a, epoch, a.rank) + TPAR_HEADER_LINES;
    for (u64 row = blockIdx.x; row < n.rows; row += gridDim.x) {
        const char* x = (const char*)a.input + row * n.hidden * elem_bytes<DT>();
        for (u64 q = threadIdx.x; q < quads; q += blockDim.x) {
            u32 w0, w1;
            load_pair<DT>(x, q, n.hidden, words, &w0, &w1);
            for (u32 p = 0; p < a.world_size; ++p) {
                if (p != a.rank) st_wide(a.inboxes[p] + my_slot + 2 * (row * quads + q), tag, w0, w1);
            }
        }
    }
    const u64* inbox = a.inboxes[a.rank];
    bool ok = true;
    for (u64 row = blockIdx.x; row < n.rows; row += gridDim.x) {
        const char* x = (const char*)a.input + row * n.hidden * elem_bytes<DT>();
        float ss = 0.f;
        for (u64 q = threadIdx.x; q < quads; q += blockDim.x) {
            u32 own0, own1;
            load_pair<DT>(x, q, n.hidden, words, &own0, &own1);
            const u64 line = TPAR_HEADER_LINES + 2 * (row * quads + q);
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
            for (u32 g = 0; g < a.world_size; g += TPAR_RANK_GROUP) {
                Wide v[TPAR_RANK_GROUP];
#pragma unroll
                for (u32 k = 0; k < TPAR_RANK_GROUP; ++k) {
                    const u32 r = g + k;
                    if (r < a.world_size && r != a.rank) v[k] = ld_wide(inbox + stage_one_slot(a, epoch, r) + line);
                }
#pragma unroll
                for (u32 k = 0; k < TPAR_RANK_GROUP; ++k) {
                    const u32 r = g + k;
                    if (r >= a.world_size) break;
                    u32 w0 = own0, w1 = own1;
                    if (r != a.rank) {
                        if (!wide_has(v[k], tag)) {
                            Wide got = {0u, 0u, 0u, 0u};
                            if (ok) {
                                ok = wait_wide(a, inbox + stage_one_slot(a, epoch, r) + line, tag, r,
                                               TPAR_PHASE_ONE_SHOT, start, epoch, code, &got, nullptr);
                            }
                            v[k] = got;
                        }
                        w0 = v[k].w0;
                        w1 = v[k].w1;
                    }
                    float xv[4];
                    unpack_quad<DT>(w0, w1, xv);
                    for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) acc[e] = (r == 0) ? xv[e] : acc[e] + xv[e];
                }
            }
            round_quad<DT>(acc);  // the allreduce's result, rounded once
            add_residual_quad<DT>(n, row, q, acc, &ss);
        }
        norm_row<DT>(n, row, ss);
    }
    if (ok) check_header(a, epoch, tag, code, start);
    end_epoch(a, ticket);
}

extern "C" __global__ void __launch_bounds__(512) tpar_fused_oneshot_f32(TparFusedArgs f) { fused_oneshot<TPAR_DTYPE_F32>(f); }
extern "C" __global__ void __launch_bounds__(512) tpar_fused_oneshot_f16(TparFusedArgs f) { fused_oneshot<TPAR_DTYPE_F16>(f); }
extern "C" __global__ void __launch_bounds__(512) tpar_fused_oneshot_bf16(TparFusedArgs f) { fused_oneshot<TPAR_DTYPE_BF16>(f); }
