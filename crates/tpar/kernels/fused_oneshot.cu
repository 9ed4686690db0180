// Fused one-shot push allreduce + residual add + RMSNorm (also host-staged, with the inboxes in
// pinned host memory). The push and the wait are one-shot's (16-byte LL lines, the data its
// own signal, tags by epoch, triple buffers), but the slot is laid out by rows: row r of the
// launch starts at quad r * row_quads, so rows never share a line.
//
// A row is spread over `blocks_per_row` blocks, as the plain one-shot spreads its lines: block
// `part` of a row takes the row's segments part, part + blocks_per_row, ... (a segment is
// TPAR_NORM_THREADS quads, one per thread), so at one token the push and the wait use as many
// SMs as the plain allreduce of the same bytes. The row's sum of squares needs every segment:
// each block publishes its segments' tree sums as LL lines in this rank's own inbox (tpar_ll.cuh,
// norm_exchange_lines) and reads all of them back in segment order, so every block and every
// rank get the same bits. The blocks of one row are co-resident (every block of the grid is,
// as the protocol requires), so this wait ends. With one block per row there is no exchange.
//
// Latency: everything a thread needs that no peer produces (its input, residual and weight
// quads) is loaded before the call counter, so those loads overlap its round trip; the rounded
// residual_out stays in registers for y. Each further loop trip costs a memory round trip.
//
// A failed wait (deadline, mismatched header) sets the error word; the thread then stops
// waiting but still publishes its sums and reaches every barrier, so the kernel exits.
#include "tpar_ll.cuh"

// Adds the rank-ordered sum of quad `line` (of every peer's slot, own term from `own`) into
// acc; false once a wait has failed (acc then holds what arrived, zeros for the rest).
// `header_polls` (block 0's thread `peer`, first quad): that peer's header words, loaded with
// the data and with every poll of it, as in oneshot_push.cu, so that checking the header
// after the call costs no round trip of its own.
template <int DT>
__device__ __forceinline__ bool reduce_quad(const TparArgs& a, u64 epoch, u32 tag, u64 start, int code, u64 line,
                                            u32 own0, u32 own1, bool ok, float* acc, u64* header_polls) {
    const u64* inbox = a.inboxes[a.rank];
    for (u32 g = 0; g < a.world_size; g += TPAR_RANK_GROUP) {
        Wide v[TPAR_RANK_GROUP];
#pragma unroll
        for (u32 k = 0; k < TPAR_RANK_GROUP; ++k) {
            const u32 r = g + k;
            if (r < a.world_size && r != a.rank) v[k] = ld_wide(inbox + stage_one_slot(a, epoch, r) + line);
        }
        // After the data's loads: the words land in a stack array, and the store of a word
        // waits for its load, which would otherwise hold back the data's loads by a round trip.
        if (g == 0 && header_polls) load_header_words(a, epoch, threadIdx.x, header_polls);
#pragma unroll
        for (u32 k = 0; k < TPAR_RANK_GROUP; ++k) {
            const u32 r = g + k;
            if (r >= a.world_size) break;
            u32 w0 = own0, w1 = own1;
            if (r != a.rank) {
                if (!wide_has(v[k], tag)) {
                    Wide got = {0u, 0u, 0u, 0u};
                    if (ok) {
                        ok = wait_wide(a, inbox + stage_one_slot(a, epoch, r) + line, tag, r, TPAR_PHASE_ONE_SHOT,
                                       start, epoch, code, &got, header_polls);
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
    return ok;
}

template <int DT>
__device__ void fused_oneshot(const TparFusedArgs& f) {
    const TparArgs& a = f.a;
    const TparNormArgs& n = f.n;
    const u64 quads = norm_row_quads<DT>(n.hidden);
    const u64 words = words_for<DT>(n.hidden);
    const u64 row_bytes = n.hidden * elem_bytes<DT>();
    const u32 segments = norm_segments(quads);
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
    const EpochTicket ticket = begin_epoch(a);
    const u64 epoch = ticket.epoch;
    const u32 tag = tag_for_epoch(epoch);
    const u64 start = now_ns();
    const int code = DT | TPAR_HEADER_FUSED;
    push_header(a, epoch, tag, code);
    const u64 my_slot = stage_one_slot(a, epoch, a.rank) + TPAR_HEADER_LINES;
    for (u64 row = first_row; row < n.rows; row += row_stride) {
        const char* x = (const char*)a.input + row * row_bytes;
        for (u32 j = 0; j < mine; ++j) {
            const u64 q = q0 + (u64)j * per_row * TPAR_NORM_THREADS;
            if (q >= quads) continue;
            u32 p0 = x0, p1 = x1;
            if (row != first_row || j != 0) load_pair<DT>(x, q, n.hidden, words, &p0, &p1);
            for (u32 p = 0; p < a.world_size; ++p) {
                if (p != a.rank) st_wide(a.inboxes[p] + my_slot + 2 * (row * quads + q), tag, p0, p1);
            }
        }
    }
    u64* const exchange = norm_exchange_lines(a, epoch);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool checks_header = blockIdx.x == 0 && threadIdx.x < a.world_size && threadIdx.x != a.rank;
    u64 header[4] = {0, 0, 0, 0};
    bool ok = true;
    // The reduce and residual add of one row (its quads of this block): residual_out stored,
    // the thread's partial of its j-th segment folded by its warp into warp sums `slot` + j;
    // the first segment's residual_out left in `first` for y.
    auto reduce_row = [&](u64 row, u32 slot, float* first) {
        const char* x = (const char*)a.input + row * row_bytes;
        const char* residual = (const char*)n.residual + row * row_bytes;
        char* residual_out = (char*)n.residual_out + row * row_bytes;
        for (u32 j = 0; j < mine; ++j) {
            const u64 q = q0 + (u64)j * per_row * TPAR_NORM_THREADS;
            float partial = 0.f;
            if (q < quads) {
                const bool prefetched = row == first_row && j == 0;
                u32 own0 = x0, own1 = x1, res0 = r0, res1 = r1;
                if (!prefetched) {
                    load_pair<DT>(x, q, n.hidden, words, &own0, &own1);
                    load_pair<DT>(residual, q, n.hidden, words, &res0, &res1);
                }
                float acc[4] = {0.f, 0.f, 0.f, 0.f};
                ok = reduce_quad<DT>(a, epoch, tag, start, code, TPAR_HEADER_LINES + 2 * (row * quads + q), own0, own1,
                                     ok, acc, prefetched && checks_header ? header : nullptr);
                round_quad<DT>(acc);  // the allreduce's result, rounded once
                u32 o0, o1;
                partial = residual_quad<DT>(acc, res0, res1, &o0, &o1);
                store_pair<DT>(residual_out, q, n.hidden, words, o0, o1);
                if (j == 0) {
                    for (int e = 0; e < 4; ++e) first[e] = acc[e];
                }
            }
            norm_warp_fold(slot + j, partial);
        }
    };
    // Step 4 of one row with its inverse RMS.
    auto y_row = [&](u64 row, float inv, bool use_first, const float (&first)[4]) {
        const char* residual_out = (const char*)n.residual_out + row * row_bytes;
        char* y = (char*)n.y + row * row_bytes;
        for (u32 j = 0; j < mine; ++j) {
            const u64 q = q0 + (u64)j * per_row * TPAR_NORM_THREADS;
            if (q >= quads) continue;
            float v[4];
            u32 wt0 = w0, wt1 = w1;
            if (j == 0 && use_first) {
                for (int e = 0; e < 4; ++e) v[e] = first[e];
            } else {
                u32 v0, v1;  // written by this thread above
                load_pair<DT>(residual_out, q, n.hidden, words, &v0, &v1);
                unpack_quad<DT>(v0, v1, v);
                if (j != 0) load_pair<DT>(n.weight, q, n.hidden, words, &wt0, &wt1);
            }
            u32 y0, y1;
            y_quad<DT>(v, wt0, wt1, inv, &y0, &y1);
            store_pair<DT>(y, q, n.hidden, words, y0, y1);
        }
    };
    if (per_row == 1) {
        // The whole row in this block: its segment sums stay in shared memory.
        for (u64 row = first_row; row < n.rows; row += row_stride) {
            float first[4] = {0.f, 0.f, 0.f, 0.f};
            reduce_row(row, 0, first);
            __syncthreads();
            if (warp < mine) {
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
            y_row(row, tpar_norm_inv, true, first);
            __syncthreads();  // the shared sums are reused by the next row
        }
    } else {
        // Every row's reduce first, publishing its segment sums, so that the exchange of one
        // row overlaps the reduce of the next; then y, rows in pairs (one exchange round trip
        // per pair, lanes 0-15 reading the first row's sums and 16-31 the second's). A block
        // has at most 8 segments of a row here (per_row >= 2), so two rows' warp sums fit the
        // shared slots and alternate without a barrier between rows.
        float first0[4] = {0.f, 0.f, 0.f, 0.f}, first1[4] = {0.f, 0.f, 0.f, 0.f};
        u32 k = 0;
        for (u64 row = first_row; row < n.rows; row += row_stride, ++k) {
            float kept[4];
            const u32 slot = (k & 1) * (TPAR_NORM_MAX_SEGMENTS / 2);
            reduce_row(row, slot, kept);
            for (int e = 0; e < 4; ++e) {
                if (k == 0) first0[e] = kept[e];
                if (k == 1) first1[e] = kept[e];
            }
            __syncthreads();
            if (warp < mine) {
                const float s = norm_segment_fold(slot + warp);
                if (lane == 0) {
                    st_sys(exchange + row * segments + part + warp * per_row, pack_line(tag, __float_as_uint(s)));
                }
            }
        }
        k = 0;
        for (u64 row = first_row; row < n.rows; row += 2 * row_stride, k += 2) {
            // Every warp reads the sums itself: no barrier between the exchange and y.
            const u32 half = lane >> 4, segment = lane & 15;
            const u64 r = row + half * row_stride;
            u32 bits = 0;
            if (segment < segments && r < n.rows) {
                const u64* p = exchange + r * segments + segment;
                const u64 v = ld_sys(p);
                if ((u32)(v >> 32) == tag) {
                    bits = (u32)v;
                } else if (ok) {
                    ok = wait_line(a, p, tag, a.rank, TPAR_PHASE_ONE_SHOT, start, &bits);
                }
            }
            const float i = norm_inv(__uint_as_float(bits), segments, n.hidden, n.eps, 16);
            const float inv0 = __shfl_sync(0xffffffffu, i, 0), inv1 = __shfl_sync(0xffffffffu, i, 16);
            y_row(row, inv0, k == 0, first0);
            if (row + row_stride < n.rows) y_row(row + row_stride, inv1, k == 0, first1);
        }
    }
    if (checks_header && ok) {
        // Compared from the words polled with the data; a header not seen yet is awaited.
        bool seen = true;
        for (int i = 2; i <= 5; ++i) seen = seen && (u32)(header[i - 2] >> 32) == tag;
        if (!seen) {
            check_header(a, epoch, tag, code, start);
        } else {
            for (int i = 2; i <= 5; ++i) {
                if ((u32)header[i - 2] != header_word(a, i, code)) {
                    report_error(a, TPAR_ERR_MISMATCH, threadIdx.x, TPAR_PHASE_HEADER, i, (u32)header[i - 2]);
                    break;
                }
            }
        }
    }
    end_epoch(a, ticket);
}

extern "C" __global__ void __launch_bounds__(512) tpar_fused_oneshot_f32(TparFusedArgs f) { fused_oneshot<TPAR_DTYPE_F32>(f); }
extern "C" __global__ void __launch_bounds__(512) tpar_fused_oneshot_f16(TparFusedArgs f) { fused_oneshot<TPAR_DTYPE_F16>(f); }
extern "C" __global__ void __launch_bounds__(512) tpar_fused_oneshot_bf16(TparFusedArgs f) { fused_oneshot<TPAR_DTYPE_BF16>(f); }
