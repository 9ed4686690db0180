// The residual add + RMSNorm on its own, after a plain allreduce: what a fused call runs when
// its allreduce cannot be fused (two-shot, pull, NCCL, a row too large for a slot), and the
// unfused side of `tpar bench --fused`. One block per row (grid-stride over rows), the same
// arithmetic as the fused kernel (tpar_ll.cuh's fused block), so both paths agree to the bit.
#include "tpar_ll.cuh"

template <int DT>
__device__ void add_rms_norm(const TparNormArgs& n) {
    // May start beside the allreduce that produces `sum` (programmatic dependent launch).
    pdl_wait();
    pdl_launch_dependents();
    const u64 quads = norm_row_quads<DT>(n.hidden);
    const u64 words = words_for<DT>(n.hidden);
    for (u64 row = blockIdx.x; row < n.rows; row += gridDim.x) {
        float ss = 0.f;
        const u64 offset = row * n.hidden * elem_bytes<DT>();
        for (u64 q = threadIdx.x; q < quads; q += blockDim.x) {
            u32 s0, s1;
            load_pair<DT>((const char*)n.sum + offset, q, n.hidden, words, &s0, &s1);
            float s[4];
            unpack_quad<DT>(s0, s1, s);
            add_residual_quad<DT>(n, row, q, s, &ss);
        }
        norm_row<DT>(n, row, ss);
    }
}

extern "C" __global__ void __launch_bounds__(512) tpar_add_rms_norm_f32(TparNormArgs n) { add_rms_norm<TPAR_DTYPE_F32>(n); }
extern "C" __global__ void __launch_bounds__(512) tpar_add_rms_norm_f16(TparNormArgs n) { add_rms_norm<TPAR_DTYPE_F16>(n); }
extern "C" __global__ void __launch_bounds__(512) tpar_add_rms_norm_bf16(TparNormArgs n) { add_rms_norm<TPAR_DTYPE_BF16>(n); }
