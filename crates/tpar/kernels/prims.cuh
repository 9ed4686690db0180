// prims.cuh: the steps every tpar algorithm is a sequence of. A call takes the next epoch
// and pushes its call header to its peers (begin_call), pushes its data, waits for its peers'
// lines (every wait takes the one deadline step, keep_waiting: on time, or the error word
// names the peer and the phase), reduces them in rank order (reduce_line; oneshot_push.cu keeps its wide-line reduce inline, as
// its PTX must stay as measured), checks
// the peers' headers (check_header) and publishes the epoch (end_call). The algorithms in the
// .cu files choose which lines go where; how a step is done is written here once.
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
        st_sys(a.error, (u64)code | ((u64)peer << TPAR_ERR_PEER_SHIFT) | ((u64)phase << TPAR_ERR_PHASE_SHIFT) |
                            ((u64)(field & 0xff) << TPAR_ERR_FIELD_SHIFT) | ((u64)detail << TPAR_ERR_DETAIL_SHIFT));
    }
}

// How a wait polls: the first `free_polls` polls back to back, then with a pause between
// two polls of 32 ns doubling to `max_pause_ns` (0: never pause); the deadline and the error
// word are read once every `check_mask + 1` polls (a power of two).
struct PollPolicy {
    u32 max_pause_ns;
    u32 free_polls;
    u32 check_mask;
};

// The policy of waits for LL lines and headers. Between polls of host memory a waiting thread
// sleeps a little: thousands of spinning threads would otherwise flood the PCIe link that the
// data they wait for must cross; in device memory it polls back to back a while first (see
// tuning.cuh for both).
__device__ __forceinline__ PollPolicy ll_polls(const TparArgs& a) {
    PollPolicy policy;
    policy.max_pause_ns = a.algo == TPAR_ALGO_HOST_STAGED ? TPAR_POLL_SLEEP_MAX_NS : TPAR_DEVICE_POLL_SLEEP_MAX_NS;
    policy.free_polls = a.algo == TPAR_ALGO_HOST_STAGED ? TPAR_HOST_FREE_POLLS : TPAR_DEVICE_FREE_POLLS;
    policy.check_mask = 255u;
    return policy;
}

// The pull algorithm's flag waits, as they have always polled: back to back, the deadline read
// every 1024 polls.
__device__ __forceinline__ PollPolicy pull_flag_polls() {
    PollPolicy policy;
    policy.max_pause_ns = 0;
    policy.free_polls = 0;
    policy.check_mask = 1023u;
    return policy;
}

struct NoSlowCheck {
    __device__ bool operator()() const { return true; }
};

// The state of one wait, and the one step every wait takes between two polls that missed:
//   Wait w = begin_wait(policy);
//   while (!arrived) { if (!keep_waiting(a, w, start, peer, phase, slow_check)) return false; poll; }
// so the pauses, the deadline and the error word are handled here once for every wait.
struct Wait {
    PollPolicy policy;
    u32 spins, pause;
};
__device__ __forceinline__ Wait begin_wait(PollPolicy policy) {
    Wait w;
    w.policy = policy;
    w.spins = 0;
    w.pause = 32;
    return w;
}
// Pauses as the policy says, and on every deadline check first runs `slow_check()` (false: it
// found, and reported, a failure of its own), then past the deadline reports a timeout of
// `peer` in `phase`, and gives up quietly if the error word is already set (another thread
// failed: this call is over). False when the wait is over without its data; the error word is
// then set.
template <typename SlowCheck>
__device__ __forceinline__ bool keep_waiting(const TparArgs& a, Wait& w, u64 start, u32 peer, u32 phase,
                                             SlowCheck slow_check) {
    if (w.policy.max_pause_ns > 0 && w.spins >= w.policy.free_polls) {
        __nanosleep(w.pause);
        w.pause = w.pause < w.policy.max_pause_ns ? w.pause * 2 : w.policy.max_pause_ns;
    }
    if ((++w.spins & w.policy.check_mask) == 0) {
        if (!slow_check()) return false;
        if (now_ns() - start > a.timeout_ns) { report_error(a, TPAR_ERR_TIMEOUT, peer, phase, 0, 0); return false; }
        if (ld_sys(a.error) != 0) return false;
    }
    return true;
}

// Waits until the line at `p` carries `tag`, and gives its payload word.
__device__ TPAR_SLOW_PATH bool wait_line(const TparArgs& a, const u64* p, u32 tag, u32 peer, u32 phase,
                                          u64 start, u32* word) {
    u64 v = ld_sys(p);
    Wait w = begin_wait(ll_polls(a));
    while ((u32)(v >> 32) != tag) {
        if (!keep_waiting(a, w, start, peer, phase, NoSlowCheck())) return false;
        v = ld_sys(p);
    }
    *word = (u32)v;
    return true;
}

// Waits until the flag at `p`, written with release by its owner after its data, reaches
// `epoch` (acquire: the owner's data is then visible).
__device__ __forceinline__ bool wait_flag(const TparArgs& a, const u64* p, u64 epoch, u32 peer, u32 phase,
                                          u64 start) {
    Wait w = begin_wait(pull_flag_polls());
    while ((i64)(ld_acquire_sys(p) - epoch) < 0) {
        if (!keep_waiting(a, w, start, peer, phase, NoSlowCheck())) return false;
    }
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
    Wait w = begin_wait(ll_polls(a));
    for (;;) {
        load_header_words(a, epoch, peer, v);
        bool all = true;
        for (int i = 0; i < 4; ++i) all = all && (u32)(v[i] >> 32) == tag;
        if (all) break;
        if (!keep_waiting(a, w, start, peer, TPAR_PHASE_HEADER, NoSlowCheck())) return false;
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
// The slow check of a wait for a peer's data: the peer's header, compared with ours.
struct HeaderMatches {
    const TparArgs& a;
    u64 epoch;
    u32 tag;
    int dtype;
    u32 peer;
    __device__ bool operator()() const {
        u32 theirs = 0, field = header_difference(a, epoch, tag, dtype, peer, &theirs);
        if (field != 0) {
            report_error(a, TPAR_ERR_MISMATCH, peer, TPAR_PHASE_HEADER, field, theirs);
            return false;
        }
        return true;
    }
};
__device__ TPAR_SLOW_PATH bool wait_wide(const TparArgs& a, const u64* p, u32 tag, u32 peer, u32 phase, u64 start,
                                          u64 epoch, int dtype, Wide* out, u64* header_polls) {
    Wide v = ld_wide(p);
    Wait w = begin_wait(ll_polls(a));
    while (!wide_has(v, tag)) {
        if (!keep_waiting(a, w, start, peer, phase, HeaderMatches{a, epoch, tag, dtype, peer})) return false;
        // header_polls, when given, are block 0's thread `peer`'s words of that peer's header.
        if (header_polls) load_header_words(a, epoch, threadIdx.x, header_polls);
        v = ld_wide(p);
    }
    *out = v;
    return true;
}

// ---- a call's beginning and end ----

// What every call begins with (every thread must call it): the next epoch (see begin_epoch),
// its tag, the start of the call's deadline, and this rank's call header pushed to every peer
// (`header_code`: the dtype code, with flags such as TPAR_HEADER_FUSED for other calls).
struct Call {
    EpochTicket ticket;
    u64 epoch;
    u32 tag;
    u64 start;
};
__device__ __forceinline__ Call begin_call(const TparArgs& a, int header_code) {
    Call call;
    call.ticket = begin_epoch(a);
    call.epoch = call.ticket.epoch;
    call.tag = tag_for_epoch(call.epoch);
    call.start = now_ns();
    push_header(a, call.epoch, call.tag, header_code);
    return call;
}
// What every call ends with, failed or not (every thread must reach it): the epoch published.
__device__ __forceinline__ void end_call(const TparArgs& a, const Call& call) { end_epoch(a, call.ticket); }

// ---- reduction in rank order ----

// Wide line `line` (counted from the slot's start) of the stage-one slot of every peer of the
// group g .. g + TPAR_RANK_GROUP - 1 (this rank's own left out) into v: every load is issued
// before any is checked, so their latencies overlap; the groups bound the registers.
__device__ __forceinline__ void load_wide_group(const TparArgs& a, const u64* inbox, u64 epoch, u32 g, u64 line,
                                                Wide* v) {
#pragma unroll
    for (u32 k = 0; k < TPAR_RANK_GROUP; ++k) {
        const u32 r = g + k;
        if (r < a.world_size && r != a.rank) v[k] = ld_wide(inbox + stage_one_slot(a, epoch, r) + line);
    }
}

