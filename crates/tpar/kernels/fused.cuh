// fused.cuh: the epilogue of the fused allreduce + residual add + RMSNorm (fused_oneshot.cu,
// fused_norm.cu): its argument block, the quad arithmetic, the per-segment sum-of-squares tree
// and the exchange of segment sums between the blocks that share a row. Included by the
// umbrella tpar_ll.cuh after prims.cuh, whose primitives it uses.
#pragma once

#include "prims.cuh"

// ==== fused allreduce + residual add + RMSNorm (fused_oneshot.cu, fused_norm.cu) ====
// The exact semantics, and the CPU reference these must match bit for bit, are in
// crates/tpar/src/norm.rs. Every multiply and add below is an explicit _rn intrinsic: the
// compiler must not contract them into fused multiply-adds, or the reference would differ.
//
// A row is cut into segments of TPAR_NORM_THREADS quads; thread t of whichever block handles
// a segment owns quad t of it in every phase (push, reduce, residual add, y), so a thread reads
// back only what it wrote itself (in-place calls are safe). The row's sum of squares is the
// per-segment block tree of norm.rs, then the segment sums added in segment order: the same
// bits however many blocks share a row.

// Set in header word 4 by fused calls: a fused call and a plain allreduce of the same size
// lay their slots out differently, so they must be named as a mismatch, not mixed.
#define TPAR_HEADER_FUSED 0x10000

// Blocks of a norm kernel must have this many threads (the sum-of-squares tree assumes it);
// it is also the quads of one segment.
#define TPAR_NORM_THREADS 512
// The norm kernels are declared with every kernel's launch bound (TPAR_LAUNCH_BOUNDS, tuning.cuh).
static_assert(TPAR_NORM_THREADS == TPAR_THREADS, "the norm kernels' blocks are TPAR_THREADS threads");
// Segments the shared per-segment arrays hold: the fused kernel's longest row (16384 f32
// elements: 8192 quads); the separate norm kernel folds longer rows in groups of this many.
#define TPAR_NORM_MAX_SEGMENTS 16

// The epilogue's operands, for one launch (pointers already offset to its first row).
struct TparNormArgs {
    const void* sum;       // the rounded allreduce output (separate kernel only)
    const void* residual;
    void* residual_out;    // may equal residual
    const void* weight;
    void* y;               // may equal the input x; never residual or residual_out
    u64 hidden;
    u64 rows;
    float eps;
    u32 blocks_per_row;    // fused kernel: blocks sharing a row (>= 1; the grid a multiple of it)
};
struct TparFusedArgs {
    TparArgs a;
    TparNormArgs n;
};

template <int DT> __device__ __forceinline__ u64 elem_bytes() { return DT == TPAR_DTYPE_F32 ? 4 : 2; }
template <int DT> __device__ __forceinline__ u64 norm_row_quads(u64 hidden) { return (words_for<DT>(hidden) + 1) / 2; }
__device__ __forceinline__ u32 norm_segments(u64 quads) {
    return (u32)((quads + TPAR_NORM_THREADS - 1) / TPAR_NORM_THREADS);
}

// A row of `hidden` elements as the norm kernels walk it: its quads (units of two payload
// words), payload words, bytes and segments.
struct NormRow {
    u64 quads, words, bytes;
    u32 segments;
};
template <int DT> __device__ __forceinline__ NormRow norm_row(u64 hidden) {
    const u64 quads = norm_row_quads<DT>(hidden);
    return NormRow{quads, words_for<DT>(hidden), hidden * elem_bytes<DT>(), norm_segments(quads)};
}

// The quad's four (f16/bf16) or two (f32) elements as f32, from two payload words.
template <int DT> __device__ __forceinline__ void unpack_quad(u32 w0, u32 w1, float* v) {
    Lanes<DT>::unpack(w0, v);
    Lanes<DT>::unpack(w1, v + Lanes<DT>::PER_WORD);
}
template <int DT> __device__ __forceinline__ void pack_quad(const float* v, u32* w0, u32* w1) {
    *w0 = Lanes<DT>::pack(v);
    *w1 = Lanes<DT>::pack(v + Lanes<DT>::PER_WORD);
}
// Rounds each element to the dtype and back (exact for f32).
template <int DT> __device__ __forceinline__ void round_quad(float* v) {
    u32 w0, w1;
    pack_quad<DT>(v, &w0, &w1);
    unpack_quad<DT>(w0, w1, v);
}

// Step 2 for one quad, in registers: v = round(s + residual) from the rounded sums `s` (left
// in `s`, as f32) and the residual's words; its words in *o0, *o1 (to store as residual_out).
// Returns the thread's partial of the segment: 0 + v0*v0 + v1*v1 + ... in element order.
template <int DT>
__device__ __forceinline__ float residual_quad(float* s, u32 r0, u32 r1, u32* o0, u32* o1) {
    float r[4];
    unpack_quad<DT>(r0, r1, r);
    for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) s[e] = __fadd_rn(s[e], r[e]);
    pack_quad<DT>(s, o0, o1);
    unpack_quad<DT>(*o0, *o1, s);
    float p = 0.f;
    for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) p = __fadd_rn(p, __fmul_rn(s[e], s[e]));
    return p;
}

// Step 4 for one quad: y = round(round(v * inv) * weight), as words.
template <int DT>
__device__ __forceinline__ void y_quad(const float* v, u32 w0, u32 w1, float inv, u32* y0, u32* y1) {
    float w[4], t[4];
    unpack_quad<DT>(w0, w1, w);
    for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) t[e] = __fmul_rn(v[e], inv);
    round_quad<DT>(t);
    for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) t[e] = __fmul_rn(t[e], w[e]);
    pack_quad<DT>(t, y0, y1);
}

// A thread's quads of a launch's rows, in both fused one-shot kernels: rows first_row,
// first_row + row_stride, ...; in each, quads q0, q0 + step, ... (`mine` of them, those below
// the row's quads). Its first quad of its first row is loaded before the call counter, so
// its input (x0, x1), residual_out (`kept`) and weight (w0, w1) come from registers; the
// others are loaded where they are used.
//
// The thread's input quads pushed to the ranks of `everyone` (all_ranks), row by row.
template <int DT>
__device__ __forceinline__ void fused_push_rows(const TparArgs& a, const TparNormArgs& n, const NormRow& shape,
                                                const Call& call, u32 everyone, u64 first_row, u64 row_stride,
                                                u64 q0, u64 step, u32 mine, u32 x0, u32 x1) {
    const u64 my_slot = slot_payload(a, call.epoch, a.rank);
    for (u64 row = first_row; row < n.rows; row += row_stride) {
        const char* x = (const char*)a.input + row * shape.bytes;
        for (u32 j = 0; j < mine; ++j) {
            const u64 q = q0 + j * step;
            if (q >= shape.quads) continue;
            u32 p0 = x0, p1 = x1;
            if (row != first_row || j != 0) load_pair<DT>(x, q, n.hidden, shape.words, &p0, &p1);
            push_unit_to(a, call, everyone, my_slot + 2 * (row * shape.quads + q), p0, p1);
        }
    }
}
// y for the thread's quads of `row`, with the row's 1/rms `inv`: the first quad's residual_out
// and weight from registers, the others read back from the row's `residual_out` (this thread
// wrote them).
template <int DT>
__device__ __forceinline__ void fused_y_row(const TparNormArgs& n, const NormRow& shape, u64 row,
                                            const char* residual_out, u64 q0, u64 step, u32 mine, const float* kept,
                                            u32 w0, u32 w1, float inv) {
    char* y = (char*)n.y + row * shape.bytes;
    for (u32 j = 0; j < mine; ++j) {
        const u64 q = q0 + j * step;
        if (q >= shape.quads) continue;
        float v[4];
        u32 wt0 = w0, wt1 = w1;
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

__device__ __forceinline__ float butterfly_sum(float p) {
    for (int offset = 16; offset >= 1; offset >>= 1) p = __fadd_rn(p, __shfl_xor_sync(0xffffffffu, p, offset));
    return p;
}

// The block's per-segment trees. Every thread calls `norm_warp_fold` with its partial of the
// block's j-th segment of the row (0 where it has no quad); after a __syncthreads, warp j
// folds the 16 warp sums of segment j with `norm_segment_fold` (lanes 16..31 holding 0).
__shared__ float tpar_norm_warp_sums[TPAR_NORM_MAX_SEGMENTS][TPAR_NORM_THREADS / 32];
__shared__ float tpar_norm_segment_sums[TPAR_NORM_MAX_SEGMENTS];
__shared__ float tpar_norm_inv;

__device__ __forceinline__ void norm_warp_fold(u32 j, float p) {
    p = butterfly_sum(p);
    if ((threadIdx.x & 31) == 0) tpar_norm_warp_sums[j][threadIdx.x >> 5] = p;
}
// Warp `j`'s lanes, after the barrier: the sum of the block's j-th segment (every lane).
__device__ __forceinline__ float norm_segment_fold(u32 j) {
    const u32 lane = threadIdx.x & 31;
    return butterfly_sum(lane < TPAR_NORM_THREADS / 32 ? tpar_norm_warp_sums[j][lane] : 0.f);
}
// The segment trees of two segments at once, from warp sums: lanes 0-15 hold the 16 warp sums
// of one segment and lanes 16-31 those of the next (0 for warps past the row). Lane 0 returns
// the first segment's sum and lane 16 the second's, the same bits as norm_segment_fold: its
// first step (offset 16) adds the zero lanes 16-31, here the explicit + 0, and the four steps
// after it stay within each half.
__device__ __forceinline__ float norm_segment_pair_fold(float v) {
    v = __fadd_rn(v, 0.f);
    for (int offset = 8; offset >= 1; offset >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}
// Warps of a row of `quads` quads: 32 quads each, the unit whose sum the fused one-shot's
// blocks exchange (a segment is 16 of them).
__device__ __forceinline__ u32 norm_row_warps(u64 quads) { return (u32)((quads + 31) / 32); }

// 1 / sqrt(ss / hidden + eps), correctly rounded, from the row's sum of squares `ss`: the
// steps after the row's last line, so each is the shortest form with norm.rs's bits. Where
// `hidden` is a power of two, ss / hidden is ss times its reciprocal, which is exact (2^-k), so
// the one rounding of the product is the quotient's; __frcp_rn is 1 / x correctly rounded, as
// __fdiv_rn(1, x) is, without the general division's steps.
// TPAR_NORM_INV_FORM (experiment): bit 0 the reciprocal by __frcp_rn, bit 1 the power-of-two mean.
#ifndef TPAR_NORM_INV_FORM
#define TPAR_NORM_INV_FORM 3
#endif
__device__ __forceinline__ float norm_inv_of_sum(float ss, u64 hidden, float eps) {
    float mean;
    if (TPAR_NORM_INV_FORM & 2) {
        const bool power_of_two = (hidden & (hidden - 1)) == 0 && hidden != 0;
        const int k = 63 - __clzll((long long)hidden);
        mean = power_of_two ? __fmul_rn(ss, __int_as_float((127 - k) << 23)) : __fdiv_rn(ss, (float)hidden);
    } else {
        mean = __fdiv_rn(ss, (float)hidden);
    }
    const float root = __fsqrt_rn(__fadd_rn(mean, eps));
    return (TPAR_NORM_INV_FORM & 1) ? __frcp_rn(root) : __fdiv_rn(1.f, root);
}
// Warp 0, with lane k holding segment k's sum (k < segments): the segment sums added in
// order, then 1 / sqrt(ss / hidden + eps), correctly rounded; the same in every lane.
__device__ __forceinline__ float norm_inv(float segment_sum, u32 segments, u64 hidden, float eps) {
    float ss = __shfl_sync(0xffffffffu, segment_sum, 0);
    for (u32 k = 1; k < segments; ++k) ss = __fadd_rn(ss, __shfl_sync(0xffffffffu, segment_sum, k));
    return norm_inv_of_sum(ss, hidden, eps);
}

// Sums that blocks sharing a row exchange: LL lines (the sum's bits beside the epoch's tag), one
// per (row, segment) of a fused one-shot launch on whole blocks (fused_oneshot.cu) or per (row,
// warp of the row) on smaller blocks (fused_oneshot_small.cu), in this rank's device state after
// its two words (abi.cuh): device memory whatever the inboxes are (host-staged's are host memory),
// written and read by this rank's kernels only, which run one at a time (each takes the epoch the
// one before it published). Tags make a reset unnecessary, as for the data; the host keeps a
// launch's rows x row warps within TPAR_STATE_EXCHANGE_LINES.
__device__ __forceinline__ u64* norm_exchange_lines(const TparArgs& a) { return a.state + 2; }
// The sum another block of the row published in exchange line `line` (its bits once the line
// carries this call's tag); 0 once a wait has failed (`*ok` false, the error word set).
__device__ __forceinline__ float exchange_sum(const TparArgs& a, const Call& call, const u64* line, bool* ok) {
    const u64 v = ld_sys(line);
    u32 bits = 0;
    if ((u32)(v >> 32) == call.tag) {
        bits = (u32)v;
    } else if (*ok) {
        *ok = wait_line(a, call, line, TPAR_PHASE_ONE_SHOT, &bits);
    }
    return __uint_as_float(bits);
}
