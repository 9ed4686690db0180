// The residual add + RMSNorm on its own, after a plain allreduce: what a fused call runs when
// its allreduce cannot be fused (two-shot, pull, NCCL, a row too large for a slot), and the
// unfused side of `tpar bench --fused`. One block per row (grid-stride over rows), the same
// arithmetic and sum-of-squares order as the fused kernel (fused.cuh), so both
// paths agree to the bit.
//
// Latency-bound at decode sizes (one row of 8192 is 2048 quads, four per thread): a thread
// loads the sum, residual and weight of up to TPAR_NORM_BATCH segments at once, so a row costs
// one memory round trip instead of one per quad, and keeps residual_out in registers for y
// when the row fits one batch.
#include "tpar_ll.cuh"

// Segments whose operands a thread holds in registers at once (8192 f16/bf16 in one batch).
#define TPAR_NORM_BATCH 4

template <int DT>
__device__ void add_rms_norm(const TparNormArgs& n) {
    // May start beside the allreduce that produces `sum` (programmatic dependent launch).
    pdl_wait();
    pdl_launch_dependents();
    const NormRow shape = norm_row<DT>(n.hidden);
    const u64 quads = shape.quads, words = shape.words, row_bytes = shape.bytes;
    const u32 segments = shape.segments;
    const bool one_batch = segments <= TPAR_NORM_BATCH;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (u64 row = blockIdx.x; row < n.rows; row += gridDim.x) {
        const char* sum = (const char*)n.sum + row * row_bytes;
        const char* residual = (const char*)n.residual + row * row_bytes;
        char* residual_out = (char*)n.residual_out + row * row_bytes;
        char* y = (char*)n.y + row * row_bytes;
        float v[TPAR_NORM_BATCH][4];
        u32 wt[TPAR_NORM_BATCH][2];
        // The row's sum of squares, the segment sums added in order (thread 0's running total).
        float ss = 0.f;
        for (u32 base = 0; base < segments; base += TPAR_NORM_BATCH) {
            u32 s[TPAR_NORM_BATCH][2], r[TPAR_NORM_BATCH][2];
#pragma unroll
            for (u32 b = 0; b < TPAR_NORM_BATCH; ++b) {
                const u64 q = (u64)(base + b) * TPAR_NORM_THREADS + threadIdx.x;
                s[b][0] = s[b][1] = r[b][0] = r[b][1] = wt[b][0] = wt[b][1] = 0;
                if (base + b < segments && q < quads) {
                    load_pair<DT>(sum, q, n.hidden, words, &s[b][0], &s[b][1]);
                    load_pair<DT>(residual, q, n.hidden, words, &r[b][0], &r[b][1]);
                    if (one_batch) load_pair<DT>(n.weight, q, n.hidden, words, &wt[b][0], &wt[b][1]);
                }
            }
#pragma unroll
            for (u32 b = 0; b < TPAR_NORM_BATCH; ++b) {
                if (base + b >= segments) break;  // uniform across the block
                const u64 q = (u64)(base + b) * TPAR_NORM_THREADS + threadIdx.x;
                float partial = 0.f;
                if (q < quads) {
                    unpack_quad<DT>(s[b][0], s[b][1], v[b]);
                    u32 o0, o1;
                    partial = residual_quad<DT>(v[b], r[b][0], r[b][1], &o0, &o1);
                    store_pair<DT>(residual_out, q, n.hidden, words, o0, o1);
                }
                norm_warp_fold((base + b) % TPAR_NORM_MAX_SEGMENTS, partial);
            }
            // A row of any length: its segments are folded in groups of TPAR_NORM_MAX_SEGMENTS
            // (the shared arrays' size; f32 rows above 16384 and f16/bf16 rows above 32768
            // have more), each group's sums added to the total in segment order.
            const u32 done = min(base + TPAR_NORM_BATCH, segments);
            if (done % TPAR_NORM_MAX_SEGMENTS == 0 || done == segments) {
                const u32 first = (done - 1) / TPAR_NORM_MAX_SEGMENTS * TPAR_NORM_MAX_SEGMENTS;
                __syncthreads();
                if (warp < done - first) {
                    const float sum_of_segment = norm_segment_fold(warp);
                    if (lane == 0) tpar_norm_segment_sums[warp] = sum_of_segment;
                }
                __syncthreads();
                if (threadIdx.x == 0) {
                    for (u32 k = first; k < done; ++k) {
                        const float segment_sum = tpar_norm_segment_sums[k - first];
                        ss = k == 0 ? segment_sum : __fadd_rn(ss, segment_sum);
                    }
                }
            }
        }
        if (threadIdx.x == 0) tpar_norm_inv = norm_inv_of_sum(ss, n.hidden, n.eps);
        __syncthreads();
        const float inv = tpar_norm_inv;
        for (u32 base = 0; base < segments; base += TPAR_NORM_BATCH) {
            if (!one_batch) {
                // Reloaded: residual_out was written by this thread above.
#pragma unroll
                for (u32 b = 0; b < TPAR_NORM_BATCH; ++b) {
                    const u64 q = (u64)(base + b) * TPAR_NORM_THREADS + threadIdx.x;
                    if (base + b < segments && q < quads) {
                        u32 v0, v1;
                        load_pair<DT>(residual_out, q, n.hidden, words, &v0, &v1);
                        unpack_quad<DT>(v0, v1, v[b]);
                        load_pair<DT>(n.weight, q, n.hidden, words, &wt[b][0], &wt[b][1]);
                    }
                }
            }
#pragma unroll
            for (u32 b = 0; b < TPAR_NORM_BATCH; ++b) {
                const u64 q = (u64)(base + b) * TPAR_NORM_THREADS + threadIdx.x;
                if (base + b < segments && q < quads) {
                    u32 y0, y1;
                    y_quad<DT>(v[b], wt[b][0], wt[b][1], inv, &y0, &y1);
                    store_pair<DT>(y, q, n.hidden, words, y0, y1);
                }
            }
        }
        __syncthreads();  // the shared sums are reused by the next row
    }
}

extern "C" __global__ void TPAR_LAUNCH_BOUNDS tpar_add_rms_norm_f32(TPAR_PARAM TparNormArgs n) { add_rms_norm<TPAR_DTYPE_F32>(n); }
extern "C" __global__ void TPAR_LAUNCH_BOUNDS tpar_add_rms_norm_f16(TPAR_PARAM TparNormArgs n) { add_rms_norm<TPAR_DTYPE_F16>(n); }
extern "C" __global__ void TPAR_LAUNCH_BOUNDS tpar_add_rms_norm_bf16(TPAR_PARAM TparNormArgs n) { add_rms_norm<TPAR_DTYPE_BF16>(n); }
