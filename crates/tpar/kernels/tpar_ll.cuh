// tpar_ll.cuh: the one header every tpar kernel includes. It pulls in the shared headers, one
// concern each, in dependency order:
//   abi.cuh       the argument block, codes, limits and error word the host mirrors
//   tuning.cuh    compile-time knobs of the waits (overridable with TPAR_KERNEL_DEFINES)
//   memorder.cuh  loads and stores with their memory order, the clock, PDL ordering
//   layout.cuh    the LL line, tags by epoch, the inbox layout and the call header's words
//   dtype.cuh     payload words <-> elements, in f32
//   prims.cuh     the steps every algorithm is a sequence of (epoch, push, wait, reduce, check)
// and ends with the fused allreduce + RMSNorm block, kept here until it moves into its own
// header.
#pragma once

#include "abi.cuh"
#include "tuning.cuh"
#include "memorder.cuh"
#include "layout.cuh"
#include "dtype.cuh"
#include "prims.cuh"

// ==== fused allreduce + residual add + RMSNorm (fused_oneshot.cu, fused_norm.cu) ====
// The exact semantics, and the CPU reference these must match bit for bit, are in
// crates/tpar/src/norm.rs. Every multiply and add below is an explicit _rn intrinsic: the
// compiler must not contract them into fused multiply-adds, or the reference would differ.

// Set in header word 4 by fused calls: a fused call and a plain allreduce of the same size
// lay their slots out differently, so they must be named as a mismatch, not mixed.
#define TPAR_HEADER_FUSED 0x10000

// Blocks of a norm kernel must have this many threads (the sum-of-squares tree assumes it).
#define TPAR_NORM_THREADS 512

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
    u32 pad;
};
struct TparFusedArgs {
    TparArgs a;
    TparNormArgs n;
};

template <int DT> __device__ __forceinline__ u64 elem_bytes() { return DT == TPAR_DTYPE_F32 ? 4 : 2; }
template <int DT> __device__ __forceinline__ u64 norm_row_quads(u64 hidden) { return (words_for<DT>(hidden) + 1) / 2; }

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

// Step 2 for one quad: residual_out = round(s + residual) from the rounded sums `s`; stores
// it and adds its squares, in element order, to the thread's partial `ss`.
template <int DT>
__device__ __forceinline__ void add_residual_quad(const TparNormArgs& n, u64 row, u64 q, float* s, float* ss) {
    const u64 words = words_for<DT>(n.hidden);
    const u64 offset = row * n.hidden * elem_bytes<DT>();
    u32 r0, r1;
    load_pair<DT>((const char*)n.residual + offset, q, n.hidden, words, &r0, &r1);
    float r[4];
    unpack_quad<DT>(r0, r1, r);
    for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) s[e] = __fadd_rn(s[e], r[e]);
    u32 o0, o1;
    pack_quad<DT>(s, &o0, &o1);
    unpack_quad<DT>(o0, o1, s);
    store_pair<DT>((char*)n.residual_out + offset, q, n.hidden, words, o0, o1);
    for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) *ss = __fadd_rn(*ss, __fmul_rn(s[e], s[e]));
}

__device__ __forceinline__ float butterfly_sum(float p) {
    for (int offset = 16; offset >= 1; offset >>= 1) p = __fadd_rn(p, __shfl_xor_sync(0xffffffffu, p, offset));
    return p;
}

// Steps 3 and 4 for one row, after every thread of the block has added its quads into `ss`:
// the block's fixed-order sum, the inverse RMS, and y from the stored residual_out (each thread
// reads back only what it wrote). Every thread of the block must call it.
template <int DT> __device__ __forceinline__ void norm_row(const TparNormArgs& n, u64 row, float ss) {
    __shared__ float warp_sums[32];
    __shared__ float row_inv;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    ss = butterfly_sum(ss);
    if (lane == 0) warp_sums[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float w = lane < (blockDim.x >> 5) ? warp_sums[lane] : 0.f;
        w = butterfly_sum(w);
        if (lane == 0) row_inv = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(w, (float)n.hidden), n.eps)));
    }
    __syncthreads();
    const float inv = row_inv;
    const u64 words = words_for<DT>(n.hidden);
    const u64 quads = norm_row_quads<DT>(n.hidden);
    const u64 offset = row * n.hidden * elem_bytes<DT>();
    for (u64 q = threadIdx.x; q < quads; q += blockDim.x) {
        u32 v0, v1, w0, w1;
        load_pair<DT>((const char*)n.residual_out + offset, q, n.hidden, words, &v0, &v1);
        load_pair<DT>(n.weight, q, n.hidden, words, &w0, &w1);
        float v[4], w[4];
        unpack_quad<DT>(v0, v1, v);
        unpack_quad<DT>(w0, w1, w);
        for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) v[e] = __fmul_rn(v[e], inv);
        round_quad<DT>(v);
        for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) v[e] = __fmul_rn(v[e], w[e]);
        u32 y0, y1;
        pack_quad<DT>(v, &y0, &y1);
        store_pair<DT>((char*)n.y + offset, q, n.hidden, words, y0, y1);
    }
    __syncthreads();  // warp_sums and row_inv are reused by the next row
}
// ==== end of the fused block ====
