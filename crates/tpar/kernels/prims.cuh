// prims.cuh: the steps every tpar algorithm is a sequence of. A call takes the next epoch
// (begin_epoch), pushes its call header to its peers (push_header), pushes its data, waits
// for its peers' lines (every wait is the one deadline loop below: on time, or the error word
// names the peer and the phase), reduces them in rank order, checks the peers' headers
// (check_header) and publishes the epoch (end_epoch). The algorithms in the .cu files choose
// which lines go where; how a step is done is written here once.
#pragma once

#include "abi.cuh"
#include "tuning.cuh"
#include "memorder.cuh"
#include "layout.cuh"
#include "dtype.cuh"

// ---- the call counter ----

// The call counter. Thread 0 of every block reads the last epoch, then arrives on the block
// counter; the last block to arrive has seen every block's arrival, so every block has read
// the epoch, and it may publish the new one. The add is issued at the start and its result
// used only at the end, so its round trip overlaps the call instead of following it, and it
// is relaxed: the add's address depends on the value read (its top bit, zero for any epoch below
// 2^63, which the assembler cannot fold away), so the GPU cannot perform the add before the read, and the publishing store
// depends on the add's result, and GPUs do not perform stores speculatively. No fence, no
// barrier at the end. A single-block grid needs no add at all. Every thread must call it.
struct EpochTicket {
    u64 epoch;
    u32 arrived;
};
__device__ __forceinline__ EpochTicket begin_epoch(const TparArgs& a) {
    __shared__ u64 shared_epoch;
    EpochTicket t;
    t.arrived = 0;
    pdl_wait();
    if (threadIdx.x == 0) {
        const u64 last = *(volatile u64*)a.state;
        shared_epoch = last + 1;
        if (gridDim.x > 1) {
            asm volatile(
                "{\n\t.reg .u64 zero, addr;\n\t"
                "shr.u64 zero, %1, 63;\n\t"
                "add.u64 addr, %2, zero;\n\t"
                "atom.relaxed.gpu.global.add.u32 %0, [addr], 1;\n\t}"
                : "=r"(t.arrived)
                : "l"(last), "l"(a.state + 1)
                : "memory");
        }
    }
    __syncthreads();
    t.epoch = shared_epoch;
    pdl_launch_dependents();
    return t;
}
__device__ __forceinline__ void end_epoch(const TparArgs& a, const EpochTicket& t) {
    if (threadIdx.x != 0) return;
    if (gridDim.x == 1) {
        *(volatile u64*)a.state = t.epoch;  // the block's threads read it before the barrier
    } else if (t.arrived == gridDim.x - 1) {
        *(volatile u32*)(a.state + 1) = 0;
        *(volatile u64*)a.state = t.epoch;
    }
}


// ---- errors and deadlines ----

__device__ TPAR_SLOW_PATH void report_error(const TparArgs& a, u32 code, u32 peer, u32 phase, u32 field,
                                             u32 detail) {
    // No atomics on host memory over PCIe: first writer usually wins, any writer is a valid report.
    if (ld_sys(a.error) == 0) {
        st_sys(a.error, (u64)code | ((u64)peer << 8) | ((u64)phase << 16) | ((u64)(field & 0xff) << 24) |
                            ((u64)detail << 32));
    }
}

// Spins until the line at `p` carries `tag`; false (with the error word set, or already set by
// someone else) when the deadline passes first.
// Between polls of host memory a waiting thread sleeps a little (32 ns, doubling to the
// maximum): thousands of spinning threads would otherwise flood the PCIe link that the data
// they wait for must cross.
__device__ TPAR_SLOW_PATH bool wait_line(const TparArgs& a, const u64* p, u32 tag, u32 peer, u32 phase,
                                          u64 start, u32* word) {
    u64 v = ld_sys(p);
    u32 spins = 0, pause = 32;
    const u32 max_pause = a.algo == TPAR_ALGO_HOST_STAGED ? TPAR_POLL_SLEEP_MAX_NS : TPAR_DEVICE_POLL_SLEEP_MAX_NS;
    const u32 free_spins = a.algo == TPAR_ALGO_HOST_STAGED ? TPAR_HOST_FREE_POLLS : TPAR_DEVICE_FREE_POLLS;
    while ((u32)(v >> 32) != tag) {
        if (max_pause > 0 && spins >= free_spins) {
            __nanosleep(pause);
            pause = pause < max_pause ? pause * 2 : max_pause;
        }
        if ((++spins & 255u) == 0) {
            if (now_ns() - start > a.timeout_ns) { report_error(a, TPAR_ERR_TIMEOUT, peer, phase, 0, 0); return false; }
            if (ld_sys(a.error) != 0) return false;
        }
        v = ld_sys(p);
    }
    *word = (u32)v;
    return true;
}

// Line `i` of every rank's stage-one slot, summed in rank order into `acc`; this rank's own
// term is `own` (read from its input, not through its inbox). All loads are issued before any
// is checked, so the peers' latencies overlap instead of adding up.
template <int DT>
__device__ __forceinline__ bool reduce_line(const TparArgs& a, u64 epoch, u32 tag, u64 i, u32 phase, u64 start,
                                            u32 own, float* acc) {
    const u64* inbox = a.inboxes[a.rank];
    u64 v[TPAR_MAX_RANKS];
#pragma unroll
    for (u32 r = 0; r < TPAR_MAX_RANKS; ++r) {
        if (r < a.world_size && r != a.rank) v[r] = ld_sys(inbox + stage_one_slot(a, epoch, r) + TPAR_HEADER_LINES + i);
    }
#pragma unroll
    for (u32 r = 0; r < TPAR_MAX_RANKS; ++r) {
        if (r >= a.world_size) break;
        u32 w = own;
        if (r != a.rank) {
            if ((u32)(v[r] >> 32) == tag) {
                w = (u32)v[r];
            } else if (!wait_line(a, inbox + stage_one_slot(a, epoch, r) + TPAR_HEADER_LINES + i, tag, r, phase, start, &w)) {
                return false;
            }
        }
        float x[2];
        Lanes<DT>::unpack(w, x);
        for (int k = 0; k < Lanes<DT>::PER_WORD; ++k) acc[k] = (r == 0) ? x[k] : acc[k] + x[k];
    }
    return true;
}

// ---- the call header ----

// Block 0 pushes this rank's header into stage-one slot `rank` of every peer's inbox.
__device__ __forceinline__ void push_header(const TparArgs& a, u64 epoch, u32 tag, int dtype) {
    if (blockIdx.x == 0 && threadIdx.x < TPAR_HEADER_LINES) {
        u64 line = pack_line(tag, header_word(a, threadIdx.x, dtype));
        for (u32 p = 0; p < a.world_size; ++p) {
            if (p != a.rank) st_sys(a.inboxes[p] + stage_one_slot(a, epoch, a.rank) + threadIdx.x, line);
        }
    }
}

// Words 2..5 of the peer's call header in this rank's inbox (the ones compared), all in flight
// at once.
__device__ __forceinline__ void load_header_words(const TparArgs& a, u64 epoch, u32 peer, u64* words) {
    const u64* slot = a.inboxes[a.rank] + stage_one_slot(a, epoch, peer);
    for (int i = 0; i < 4; ++i) words[i] = ld_sys(slot + 2 + i);
}

// Block 0, thread `peer`: compares the peer's header with ours (words 2..5: count, dtype and
// algorithm, chunk) and reports the first word that differs with the peer's value. The four
// words are polled together: waiting for each in turn cost a round trip apiece in host memory.
__device__ TPAR_SLOW_PATH bool check_header(const TparArgs& a, u64 epoch, u32 tag, int dtype, u64 start) {
    if (blockIdx.x != 0 || threadIdx.x >= a.world_size || threadIdx.x == a.rank) return true;
    u32 peer = threadIdx.x;
    u64 v[4];
    if (a.algo != TPAR_ALGO_HOST_STAGED && !TPAR_HEADER_BATCH_POLL) {
        const u64* slot = a.inboxes[a.rank] + stage_one_slot(a, epoch, peer);
        load_header_words(a, epoch, peer, v);  // all in flight at once, then each awaited
        for (int i = 2; i <= 5; ++i) {
            u32 w = (u32)v[i - 2];
            if ((u32)(v[i - 2] >> 32) != tag && !wait_line(a, slot + i, tag, peer, TPAR_PHASE_HEADER, start, &w)) return false;
            if (w != header_word(a, i, dtype)) {
                report_error(a, TPAR_ERR_MISMATCH, peer, TPAR_PHASE_HEADER, i, w);
                return false;
            }
        }
        return true;
    }
    u32 spins = 0, pause = 32;
    const bool host = a.algo == TPAR_ALGO_HOST_STAGED;
    const u32 max_pause = host ? TPAR_POLL_SLEEP_MAX_NS : TPAR_DEVICE_POLL_SLEEP_MAX_NS;
    const u32 free_spins = host ? TPAR_HOST_FREE_POLLS : TPAR_DEVICE_FREE_POLLS;
    for (;;) {
        load_header_words(a, epoch, peer, v);
        bool all = true;
        for (int i = 0; i < 4; ++i) all = all && (u32)(v[i] >> 32) == tag;
        if (all) break;
        if (max_pause > 0 && spins >= free_spins) {
            __nanosleep(pause);
            pause = pause < max_pause ? pause * 2 : max_pause;
        }
        if ((++spins & 255u) == 0) {
            if (now_ns() - start > a.timeout_ns) { report_error(a, TPAR_ERR_TIMEOUT, peer, TPAR_PHASE_HEADER, 0, 0); return false; }
            if (ld_sys(a.error) != 0) return false;
        }
    }
    for (int i = 2; i <= 5; ++i) {
        u32 w = (u32)v[i - 2];
        if (w != header_word(a, i, dtype)) {
            report_error(a, TPAR_ERR_MISMATCH, peer, TPAR_PHASE_HEADER, i, w);
            return false;
        }
    }
    return true;
}

// The peer's call header in this rank's inbox, if it has arrived for this epoch: 0 when it
// matches ours (or has not arrived yet), else the first differing word's index with the
// peer's value in *theirs.
__device__ TPAR_SLOW_PATH u32 header_difference(const TparArgs& a, u64 epoch, u32 tag, int dtype, u32 peer,
                                                 u32* theirs) {
    const u64* slot = a.inboxes[a.rank] + stage_one_slot(a, epoch, peer);
    u64 v[4];
    for (int i = 0; i < 4; ++i) v[i] = ld_sys(slot + 2 + i);
    for (int i = 2; i <= 5; ++i) {
        if ((u32)(v[i - 2] >> 32) != tag) return 0;
        if ((u32)v[i - 2] != header_word(a, i, dtype)) {
            *theirs = (u32)v[i - 2];
            return (u32)i;
        }
    }
    return 0;
}

// Spins until the wide line at `p` carries `tag` in both halves. The first polls run without
// pause (see TPAR_DEVICE_FREE_POLLS); once the wait is slow, the peer's header is compared
// with ours on every deadline check, so a mismatched call (different size, dtype or algorithm,
// whose lines never come) is named as such instead of timing out.
__device__ TPAR_SLOW_PATH bool wait_wide(const TparArgs& a, const u64* p, u32 tag, u32 peer, u32 phase, u64 start,
                                          u64 epoch, int dtype, Wide* out, u64* header_polls) {
    Wide v = ld_wide(p);
    u32 spins = 0, pause = 32;
    const bool host = a.algo == TPAR_ALGO_HOST_STAGED;
    const u32 max_pause = host ? TPAR_POLL_SLEEP_MAX_NS : TPAR_DEVICE_POLL_SLEEP_MAX_NS;
    const u32 free_spins = host ? TPAR_HOST_FREE_POLLS : TPAR_DEVICE_FREE_POLLS;
    while (!wide_has(v, tag)) {
        if (max_pause > 0 && spins >= free_spins) {
            __nanosleep(pause);
            pause = pause < max_pause ? pause * 2 : max_pause;
        }
        if ((++spins & 255u) == 0) {
            u32 theirs = 0, field = header_difference(a, epoch, tag, dtype, peer, &theirs);
            if (field != 0) {
                report_error(a, TPAR_ERR_MISMATCH, peer, TPAR_PHASE_HEADER, field, theirs);
                return false;
            }
            if (now_ns() - start > a.timeout_ns) { report_error(a, TPAR_ERR_TIMEOUT, peer, phase, 0, 0); return false; }
            if (ld_sys(a.error) != 0) return false;
        }
        // header_polls, when given, are block 0's thread `peer`'s words of that peer's header.
        if (header_polls) load_header_words(a, epoch, threadIdx.x, header_polls);
        v = ld_wide(p);
    }
    *out = v;
    return true;
}
