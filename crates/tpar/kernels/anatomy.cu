// The anatomy of one allreduce call, for `tpar bench --anatomy`: a ladder of kernels that
// each add one piece of the one-shot push call of commit 44ef54a to the one before, so that
// timing each in a graph chain shows what each piece costs. Not loaded by communicators.
//   0 empty (griddepcontrol only)
//   1 + read and publish the call counter (published by the last block to arrive)
//   2 + push the call header to every peer and wait for and check theirs
//   3 + one line to each peer and the wait for each peer's line
//   4 + the payload in 8-byte LL lines instead of that line (the 44ef54a design: header checked
//       before the data, per-element loads)
//   5 + the end-of-call bookkeeping of 44ef54a (barrier, fence, atomic add at the end)
// Each is timed with and without programmatic dependent launch: the kernels are the same.
#include "tpar_ll.cuh"

// The bookkeeping of the first kernels (kept for `tpar bench --anatomy`, which times what it
// cost): every block reads the epoch before any block can finish, and the last block to
// finish publishes it after a fence and an atomic add at the end of the call.
__device__ __forceinline__ u64 begin_epoch_at_end(const TparArgs& a) {
    pdl_wait();
    u64 e = *(volatile u64*)a.state + 1;
    pdl_launch_dependents();
    return e;
}
__device__ __forceinline__ void end_epoch_at_end(const TparArgs& a, u64 epoch) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        u32 done = atomicAdd((u32*)(a.state + 1), 1u);
        if (done == gridDim.x - 1) {
            *(volatile u32*)(a.state + 1) = 0;
            *(volatile u64*)a.state = epoch;
            __threadfence();
        }
    }
}

template <int RUNG>
__device__ void anatomy(const TparArgs& a) {
    if (RUNG == 0) {
        pdl_wait();
        pdl_launch_dependents();
        return;
    }
    EpochTicket ticket;
    u64 epoch;
    if (RUNG >= 5) {
        epoch = begin_epoch_at_end(a);
    } else {
        ticket = begin_epoch(a);
        epoch = ticket.epoch;
    }
    const u32 tag = tag_for_epoch(epoch);
    const u64 start = now_ns();
    const u64 lines = words_for<TPAR_DTYPE_BF16>(a.count);
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 my_slot = stage_one_slot(a, epoch, a.rank) + TPAR_HEADER_LINES;
    const bool one_line_thread = blockIdx.x == 0 && threadIdx.x < a.world_size && threadIdx.x != a.rank;

    if (RUNG >= 2) push_header(a, epoch, tag, TPAR_DTYPE_BF16);
    if (RUNG == 3 && one_line_thread) st_sys(a.inboxes[threadIdx.x] + my_slot, pack_line(tag, a.rank));
    if (RUNG >= 4) {
        for (u64 i = tid; i < lines; i += stride) {
            u64 line = pack_line(tag, load_word<TPAR_DTYPE_BF16>(a.input, i, a.count));
            for (u32 p = 0; p < a.world_size; ++p) {
                if (p != a.rank) st_sys(a.inboxes[p] + my_slot + i, line);
            }
        }
    }
    if (RUNG >= 2 && !check_header(a, epoch, tag, TPAR_DTYPE_BF16, start)) goto done;
    if (RUNG == 3 && one_line_thread) {
        u32 w;
        const u64* p = a.inboxes[a.rank] + stage_one_slot(a, epoch, threadIdx.x) + TPAR_HEADER_LINES;
        if (!wait_line(a, p, tag, threadIdx.x, TPAR_PHASE_ONE_SHOT, start, &w)) goto done;
    }
    if (RUNG >= 4) {
        for (u64 i = tid; i < lines; i += stride) {
            float acc[2] = {0.f, 0.f};
            if (!reduce_line<TPAR_DTYPE_BF16>(a, epoch, tag, i, TPAR_PHASE_ONE_SHOT, start,
                                              load_word<TPAR_DTYPE_BF16>(a.input, i, a.count), acc))
                goto done;
            store_word<TPAR_DTYPE_BF16>(a.output, i, a.count, Lanes<TPAR_DTYPE_BF16>::pack(acc));
        }
    }
done:
    if (RUNG >= 5) {
        end_epoch_at_end(a, epoch);
    } else {
        end_epoch(a, ticket);
    }
}

TPAR_KERNELS_PER_RUNG(tpar_anatomy, anatomy, TparArgs)
