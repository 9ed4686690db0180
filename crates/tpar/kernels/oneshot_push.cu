// One-shot push with the LL protocol: every rank stores its input, tagged, into its slot of
// every peer's inbox (posted writes), then polls only its own inbox until every slot carries
// this epoch's tag, and reduces in rank order, taking its own term straight from its input
// (the same thread read it for the push, so in-place calls stay safe). With the inboxes in
// pinned host memory mapped into every GPU this is also the host-staged algorithm.
//
// Lines are 16 bytes wide (two words, each beside the tag) when the slots are 16-byte aligned
// (payload_lines even), else 8 bytes. The call header travels beside the data but is checked
// only after the reduction, or while a wait is slow: the data is its own signal (bench/README.md,
// "anatomy of one call", has what each piece costs).
#include "tpar_ll.cuh"

template <int DT>
__device__ __forceinline__ bool oneshot_wide(const TparArgs& a, u64 epoch, u32 tag, u64 start) {
    const u64 words = words_for<DT>(a.count);
    const u64 pairs = (words + 1) / 2;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 my_slot = stage_one_slot(a, epoch, a.rank) + TPAR_HEADER_LINES;
    for (u64 q = tid; q < pairs; q += stride) {
        u32 w0, w1;
        load_pair<DT>(a.input, q, a.count, words, &w0, &w1);
        for (u32 p = 0; p < a.world_size; ++p) {
            if (p != a.rank) st_wide(a.inboxes[p] + my_slot + 2 * q, tag, w0, w1);
        }
    }
    const u64* inbox = a.inboxes[a.rank];
    for (u64 q = tid; q < pairs; q += stride) {
        Wide v[TPAR_MAX_RANKS];
        // Every peer's line is loaded before any is checked: their latencies overlap.
#pragma unroll
        for (u32 r = 0; r < TPAR_MAX_RANKS; ++r) {
            if (r < a.world_size && r != a.rank) v[r] = ld_wide(inbox + stage_one_slot(a, epoch, r) + TPAR_HEADER_LINES + 2 * q);
        }
        u32 own0, own1;
        load_pair<DT>(a.input, q, a.count, words, &own0, &own1);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (u32 r = 0; r < TPAR_MAX_RANKS; ++r) {
            if (r >= a.world_size) break;
            u32 w0 = own0, w1 = own1;
            if (r != a.rank) {
                if (!wide_has(v[r], tag) &&
                    !wait_wide(a, inbox + stage_one_slot(a, epoch, r) + TPAR_HEADER_LINES + 2 * q, tag, r,
                               TPAR_PHASE_ONE_SHOT, start, epoch, DT, &v[r])) {
                    return false;
                }
                w0 = v[r].w0;
                w1 = v[r].w1;
            }
            float x[4];
            Lanes<DT>::unpack(w0, x);
            Lanes<DT>::unpack(w1, x + Lanes<DT>::PER_WORD);
            for (int k = 0; k < 2 * Lanes<DT>::PER_WORD; ++k) acc[k] = (r == 0) ? x[k] : acc[k] + x[k];
        }
        store_pair<DT>(a.output, q, a.count, words, Lanes<DT>::pack(acc), Lanes<DT>::pack(acc + Lanes<DT>::PER_WORD));
    }
    return true;
}

template <int DT>
__device__ __forceinline__ bool oneshot_narrow(const TparArgs& a, u64 epoch, u32 tag, u64 start) {
    const u64 lines = words_for<DT>(a.count);
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 my_slot = stage_one_slot(a, epoch, a.rank) + TPAR_HEADER_LINES;
    for (u64 i = tid; i < lines; i += stride) {
        u64 line = pack_line(tag, load_word<DT>(a.input, i, a.count));
        for (u32 p = 0; p < a.world_size; ++p) {
            if (p != a.rank) st_sys(a.inboxes[p] + my_slot + i, line);
        }
    }
    if (!check_header(a, epoch, tag, DT, start)) return false;
    for (u64 i = tid; i < lines; i += stride) {
        float acc[2] = {0.f, 0.f};
        if (!reduce_line<DT>(a, epoch, tag, i, TPAR_PHASE_ONE_SHOT, start, load_word<DT>(a.input, i, a.count), acc)) return false;
        store_word<DT>(a.output, i, a.count, Lanes<DT>::pack(acc));
    }
    return true;
}

template <int DT>
__device__ void oneshot_push(const TparArgs& a) {
    const EpochTicket ticket = begin_epoch(a);
    const u64 epoch = ticket.epoch;
    const u32 tag = tag_for_epoch(epoch);
    const u64 start = now_ns();
    push_header(a, epoch, tag, DT);
    if (a.payload_lines % 2 == 0) {
        if (oneshot_wide<DT>(a, epoch, tag, start)) check_header_after(a, epoch, tag, DT, start);
    } else {
        oneshot_narrow<DT>(a, epoch, tag, start);
    }
    end_epoch(a, ticket);
}

extern "C" __global__ void __launch_bounds__(512) tpar_oneshot_push_f32(TparArgs a) { oneshot_push<TPAR_DTYPE_F32>(a); }
extern "C" __global__ void __launch_bounds__(512) tpar_oneshot_push_f16(TparArgs a) { oneshot_push<TPAR_DTYPE_F16>(a); }
extern "C" __global__ void __launch_bounds__(512) tpar_oneshot_push_bf16(TparArgs a) { oneshot_push<TPAR_DTYPE_BF16>(a); }
