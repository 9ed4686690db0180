// Fused two-shot push allreduce + residual add + RMSNorm (issue 15): the reduce-scatter and
// all-gather of twoshot_push.cu with the epilogue of fused.cuh done once per element, by the
// rank that owns it, instead of by every rank.
//
// Units: a unit is one segment of one row (TPAR_NORM_THREADS quads; unit u = row * segments +
// segment), and each rank owns a contiguous range of units (owned_start / owner_of_line of
// layout.cuh, counted in units). Block b of a rank handles units b, b + grid, ... in every
// phase, thread t quad t of each, so a thread reads back only what it wrote itself or what
// arrived in its inbox: in place (y over x, residual_out over residual) stays safe.
//   Stage 1, reduce-scatter: every rank pushes each unit's x quads to the unit's owner as
//     16-byte LL lines (the data its own signal, with the call's identity), into its stage-one slot of
//     the owner's inbox at the quad's position in the launch (row r starts at quad
//     r * row_quads, as in fused_oneshot.cu). The owner sums in rank order (its own term from
//     its input), rounds once, adds its residual, rounds, and folds the segment's
//     sum-of-squares tree (fused.cuh, norm.rs); it then pushes the rounded residual_out quads
//     into every rank's gather slot (its own included) and the segment's sum, one LL line,
//     to every rank (below; its own through its own inbox too).
//   Stage 2, all-gather: every rank, per unit, reads the row's segment sums in segment order
//     (the same bits on every rank) for 1 / rms, and the unit's residual_out quads from its
//     gather slot, and stores residual_out and y.
// The residual is read only by a unit's owner: every rank gets the owner's residual_out, so
// ranks stay bitwise equal even if their residuals differed (in tensor parallelism they are
// the same replicated tensor).
//
// Where a segment sum goes: in rank p's inbox, in the owner's stage-one slot, at the first
// line of the unit's own quads. That line is free there: a rank pushes to p only the quads of
// units p owns (and never pushes to itself), and this unit is the owner's. So the launch
// carries as many rows as one-shot's (norm::rows_per_chunk) and the gather slot only quads.
//
// Every wait has the call's deadline (wait_unit, phases REDUCE_SCATTER and
// ALL_GATHER), the reduce-scatter's an eighth of the timeout earlier: a rank waiting in the
// all-gather for an owner that waits for a silent peer then finds the owner's error (the
// silent peer named) instead of timing out first and naming the owner. After a failed wait
// (deadline, mismatched header: the error word is set) a thread stops waiting and pushes
// nothing more, so the peers fail at their own deadline instead of taking its partial sums,
// but it reaches every barrier, so the kernel exits.
// A fused kernel: one wait site per group of peers (tuning.cuh, TPAR_WAIT_SITE_PER_GROUP).
#define TPAR_FUSED_KERNEL 1
#include "tpar_ll.cuh"

template <int DT>
__device__ void fused_twoshot(const TparFusedArgs& f) {
    const TparArgs& a = f.a;
    const TparNormArgs& n = f.n;
    const NormRow shape = norm_row<DT>(n.hidden);
    const u64 quads = shape.quads, words = shape.words, row_bytes = shape.bytes;
    const u32 segments = shape.segments;
    const u64 units = n.rows * segments;
    const u32 ranks = a.world_size;
    const u64 grid = gridDim.x;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 mine_begin = owned_start(units, ranks, a.rank);
    const u64 mine_end = owned_start(units, ranks, a.rank + 1);
    // The quad of this thread in unit u, counted from the launch's first row; >= the row's
    // quads (past its end) for threads of a short last segment.
    // Unit u's row and segment (a launch's units fit 32 bits: 32-bit division, see share_start).
    auto row_of = [&](u64 u) -> u64 { return (u32)u / segments; };
    auto segment_of = [&](u64 u) -> u64 { return (u32)u % segments; };
    auto quad_of = [&](u64 u) { return segment_of(u) * TPAR_NORM_THREADS + threadIdx.x; };
    auto line_of = [&](u64 u) { return 2 * (row_of(u) * quads + quad_of(u)); };  // of the payload
    auto x_of = [&](u64 u) { return (const char*)a.input + row_of(u) * row_bytes; };

    // Before the call counter: this block's first unit's x quad (pushed, or the own term).
    // After pdl_wait: the previous kernel may write it.
    pdl_wait();
    u32 x0 = 0, x1 = 0;
    if (blockIdx.x < units && quad_of(blockIdx.x) < quads) {
        load_pair<DT>(x_of(blockIdx.x), quad_of(blockIdx.x), n.hidden, words, &x0, &x1);
    }
    const Call call = begin_call(a, DT | TPAR_HEADER_FUSED);
    const u64 epoch = call.epoch;
    Call scatter = call;  // the reduce-scatter's waits end earlier: see the top of this file
    scatter.start = call.start - a.timeout_ns / 8;
    u64* const own = a.inboxes[a.rank];
    const u64 gather = gather_slot(a, epoch);
    // Unit u's segment sum, as a line offset in the owner's stage-one slot of every inbox (see
    // the top of this file).
    auto sum_line = [&](u32 owner, u64 u) {
        const u64 first_line = 2 * (row_of(u) * quads + segment_of(u) * TPAR_NORM_THREADS);
        return slot_payload(a, epoch, owner) + first_line;
    };

    // Stage 1: x to the owners.
    const u64 my_slot = slot_payload(a, epoch, a.rank);
    for (u64 u = blockIdx.x; u < units; u += grid) {
        const u32 owner = owner_of_line(units, ranks, u);
        if (owner == a.rank || quad_of(u) >= quads) continue;
        u32 p0 = x0, p1 = x1;
        if (u != blockIdx.x) load_pair<DT>(x_of(u), quad_of(u), n.hidden, words, &p0, &p1);
        push_unit(a, call, owner, my_slot + line_of(u), p0, p1);
    }

    // Stage 1, the owner: reduce, residual add, the segment's sum of squares; push both.
    bool ok = true;
    for (u64 u = mine_begin + (blockIdx.x + grid - mine_begin % grid) % grid; u < mine_end; u += grid) {
        const u64 q = quad_of(u);
        float partial = 0.f;
        if (q < quads) {
            u32 own0 = x0, own1 = x1, res0, res1;
            if (u != blockIdx.x) load_pair<DT>(x_of(u), q, n.hidden, words, &own0, &own1);
            load_pair<DT>((const char*)n.residual + row_of(u) * row_bytes, q, n.hidden, words, &res0, &res1);
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
            // After a failed wait the thread stops waiting but goes on to every barrier.
            if (ok) ok = reduce_unit<DT>(a, scatter, all_ranks(a), line_of(u) / 2, own0, own1,
                                         TPAR_PHASE_REDUCE_SCATTER, acc);
            round_quad<DT>(acc);  // the allreduce's result, rounded once
            u32 o0, o1;
            partial = residual_quad<DT>(acc, res0, res1, &o0, &o1);
            if (ok) {
                for (u32 p = 0; p < ranks; ++p) st_wide(a.inboxes[p] + gather + line_of(u), call.tag, call.id, o0, o1);
            }
        }
        norm_warp_fold(0, partial);
        const bool all_ok = __syncthreads_and(ok);
        if (warp == 0) {
            const float s = norm_segment_fold(0);
            if (lane == 0 && all_ok) {
                for (u32 p = 0; p < ranks; ++p) {
                    st_wide(a.inboxes[p] + sum_line(a.rank, u), call.tag, call.id, __float_as_uint(s), 0u);
                }
            }
        }
        __syncthreads();  // the warp sums are reused by the next unit
    }

    // Stage 2: every unit's residual_out from its owner, the row's 1 / rms, y.
    for (u64 u = blockIdx.x; u < units; u += grid) {
        const u64 row = row_of(u), q = quad_of(u);
        const u32 owner = owner_of_line(units, ranks, u);
        const u64* line = own + gather + line_of(u);
        Wide v = {0u, 0u, 0u, 0u};
        u32 wt0 = 0, wt1 = 0;
        if (q < quads) {
            v = ld_wide(line);
            load_pair<DT>(n.weight, q, n.hidden, words, &wt0, &wt1);
        }
        if (warp == 0) {
            u32 bits = 0;
            if (lane < segments) {
                const u64 k = row * segments + lane;  // the row's lane-th unit
                const u32 k_owner = owner_of_line(units, ranks, k);
                const u64* p = own + sum_line(k_owner, k);
                Wide s = ld_wide(p);
                if (!wide_has(s, call.tag, call.id) && ok) ok = wait_unit(a, call, p, k_owner, TPAR_PHASE_ALL_GATHER, &s);
                bits = s.w0;
            }
            const float i = norm_inv(__uint_as_float(bits), segments, n.hidden, n.eps);
            if (lane == 0) tpar_norm_inv = i;
        }
        if (q < quads && !wide_has(v, call.tag, call.id)) {
            Wide got = {0u, 0u, 0u, 0u};
            if (ok) ok = wait_unit(a, call, line, owner, TPAR_PHASE_ALL_GATHER, &got);
            v = got;
        }
        __syncthreads();
        const float inv = tpar_norm_inv;
        if (q < quads) {
            store_pair<DT>((char*)n.residual_out + row * row_bytes, q, n.hidden, words, v.w0, v.w1);
            float r[4];
            unpack_quad<DT>(v.w0, v.w1, r);
            u32 y0, y1;
            y_quad<DT>(r, wt0, wt1, inv, &y0, &y1);
            store_pair<DT>((char*)n.y + row * row_bytes, q, n.hidden, words, y0, y1);
        }
        __syncthreads();  // tpar_norm_inv is reused by the next unit
    }
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_fused_twoshot, fused_twoshot, TparFusedArgs)
