// One-shot push with the LL protocol: every rank stores its input, tagged, into its slot of
// every peer's inbox (posted writes), then polls only its own inbox until every slot carries
// this epoch's tag, and reduces in rank order, taking its own term straight from its input
// (the same thread read it for the push, so in-place calls stay safe). With the inboxes in
// pinned host memory mapped into every GPU this is also the host-staged algorithm.
#include "tpar_ll.cuh"

template <int DT>
__device__ void oneshot_push(const TparArgs& a) {
    const u64 epoch = begin_epoch(a);
    const u32 tag = tag_for_epoch(epoch);
    const u64 start = now_ns();
    const u64 lines = words_for<DT>(a.count);
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 my_slot = stage_one_slot(a, epoch, a.rank) + TPAR_HEADER_LINES;

    push_header(a, epoch, tag, DT);
    for (u64 i = tid; i < lines; i += stride) {
        u64 line = pack_line(tag, load_word<DT>(a.input, i, a.count));
        for (u32 p = 0; p < a.world_size; ++p) {
            if (p != a.rank) st_sys(a.inboxes[p] + my_slot + i, line);
        }
    }

    if (!check_header(a, epoch, tag, DT, start)) goto done;
    for (u64 i = tid; i < lines; i += stride) {
        float acc[2] = {0.f, 0.f};
        if (!reduce_line<DT>(a, epoch, tag, i, TPAR_PHASE_ONE_SHOT, start, load_word<DT>(a.input, i, a.count), acc)) goto done;
        store_word<DT>(a.output, i, a.count, Lanes<DT>::pack(acc));
    }
done:
    end_epoch(a, epoch);
}

extern "C" __global__ void __launch_bounds__(512) tpar_oneshot_push_f32(TparArgs a) { oneshot_push<TPAR_DTYPE_F32>(a); }
extern "C" __global__ void __launch_bounds__(512) tpar_oneshot_push_f16(TparArgs a) { oneshot_push<TPAR_DTYPE_F16>(a); }
extern "C" __global__ void __launch_bounds__(512) tpar_oneshot_push_bf16(TparArgs a) { oneshot_push<TPAR_DTYPE_BF16>(a); }
