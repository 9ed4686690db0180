// prims.cuh: the steps every tpar algorithm is a sequence of, as NCCL writes its prims. A call
// takes the next epoch and pushes its call header beside its data (begin_call; the header is
// never waited for: the call's identity travels in every line, layout.cuh); then it pushes
// units to a set of peers (push_unit_to), waits for and reduces units from a set of peers in
// rank order (reduce_unit), gathers units that one owner reduced (gather_unit), or, in the pull
// algorithms, publishes plain data behind a flag (publish_flag) and reads it after the flag
// (wait_flag); and it publishes its epoch at the end (end_call). The push kernels walk their
// input with input_units, the pull kernels publish theirs with publish_input. Every wait takes
// the one deadline step, keep_waiting: on time, or the error word names the peer and the
// phase, and a wait that is slow compares the peer's call header with ours so that a
// mismatched call is named as such. The algorithms in the .cu files choose which units go
// where; how a step is done is written here once.
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
// 2^63, which the assembler cannot fold away), so the GPU cannot perform the add before the
// read, and the publishing store depends on the add's result, and GPUs do not perform stores
// speculatively. No fence, no barrier at the end. A single-block grid needs no add at all.
// Every thread must call it.
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

__device__ TPAR_COLD void report_error(const TparArgs& a, u32 code, u32 peer, u32 phase, u32 field,
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

// The policy of waits for LL lines. Between polls of host memory a waiting thread sleeps a
// little: thousands of spinning threads would otherwise flood the PCIe link that the data they
// wait for must cross; in device memory it polls back to back a while first (see tuning.cuh
// for both).
__device__ __forceinline__ PollPolicy ll_polls(bool host) {
    PollPolicy policy;
    policy.max_pause_ns = host ? TPAR_POLL_SLEEP_MAX_NS : TPAR_DEVICE_POLL_SLEEP_MAX_NS;
    policy.free_polls = host ? TPAR_HOST_FREE_POLLS : TPAR_DEVICE_FREE_POLLS;
    policy.check_mask = 255u;
    return policy;
}

// The pull algorithms' flag waits, as they have always polled: back to back, the deadline read
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
//   while (!arrived) { if (!keep_waiting(a, call, w, peer, phase, slow_check)) return false; poll; }
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
// ---- a call's beginning and end, and its header ----

// One call of a kernel: its epoch (begin_epoch), the tag of the epoch, the identity every line
// of the call carries beside the tag (tag ^ call_hash), when its deadline started, and the
// code its header carries (the dtype, with flags such as TPAR_HEADER_FUSED).
struct Call {
    EpochTicket ticket;
    u64 epoch;
    u32 tag;
    u32 id;
    u64 start;
    int code;
};

// Where lines travel: this rank writes rank `to`'s lines into `send_inbox(a, to)` and finds
// rank `from`'s in `recv_inbox(a, from)`. The host resolves both per pair in the argument
// block, so a line costs no test: `inboxes` holds, for the islands kernels whose exchange
// between islands goes through host memory, the host inboxes of the other islands' ranks, and
// `recv_inboxes` this rank's own inbox per sender. Only the islands kernels define
// TPAR_ISLANDS_KERNEL before including this header; every other kernel reads its own inbox
// from `inboxes` (measured: larger argument reads cost registers and spills in the one-shot
// kernels). The islands kernel tested the islands of every line's pair before: one H200, 8
// ranks as streams, bf16, 2026-12-02, the same call (bench/README.md, "Ninth session"), 4+4
// at 4 / 32 / 64 KiB took 7.12 / 7.10 / 8.36 us with the test and 6.41 / 6.45 / 7.99 without.
#ifndef TPAR_ISLANDS_KERNEL
#define TPAR_ISLANDS_KERNEL 0
#endif
__device__ __forceinline__ u64* send_inbox(const TparArgs& a, u32 to) { return a.inboxes[to]; }
__device__ __forceinline__ u64* recv_inbox(const TparArgs& a, u32 from) {
    return TPAR_ISLANDS_KERNEL ? a.recv_inboxes[from] : a.inboxes[a.rank];
}
// Whether lines from `peer` reach this rank through host memory (polled with pauses).
__device__ __forceinline__ bool from_host(const TparArgs& a, u32 peer) {
    if (!TPAR_ISLANDS_KERNEL) return a.algo == TPAR_ALGO_HOST_STAGED;
    return a.recv_inboxes[peer] != a.inboxes[a.rank];
}

// Word 7 of a rank's call header is 0 while the call runs; a rank that gives up rewrites the
// header's last line with TPAR_NOTICE | code << 8 | the rank that caused it, so that peers
// waiting for it name the cause instead of it (keep_waiting, HeaderMatches).
#define TPAR_NOTICE 0x80000000u
// This rank's notice (0 while no thread has given up): the code and the rank its error word names.
__device__ TPAR_COLD u32 own_notice(const TparArgs& a) {
    const u64 error = ld_sys(a.error);
    if (error == 0) return 0u;
    return TPAR_NOTICE | ((u32)(error & 0xff) << 8) | (u32)((error >> TPAR_ERR_PEER_SHIFT) & 0xff);
}

// This rank's call header (4 LL lines) into stage-one slot `rank` of every peer's inbox, by the
// calling thread. Only a thread whose wait has turned slow pushes it (keep_waiting), or one
// that found a peer's call different (wait_flag): a call whose lines all arrive in time never
// writes it, and a peer reads it only to name a mismatch or to see that this rank began the
// call. Pushing it at the start of every call cost 0.4-0.5 us at 2 ranks on one H200
// (2026-12-02, bench/README.md).
__device__ TPAR_COLD void push_header(const TparArgs& a, const Call call) {
    for (u32 line = 0; line < TPAR_HEADER_LINES / 2; ++line) {
        const u32 w0 = header_word(a, 2 * line, call.code);
        // Word 7 carries this rank's notice if it has given up meanwhile: a header pushed by
        // a thread whose wait turned slow after another thread gave up must not erase it.
        const u32 w1 = 2 * line + 1 == 7 ? own_notice(a) : header_word(a, 2 * line + 1, call.code);
        for (u32 p = 0; p < a.world_size; ++p) {
            if (p != a.rank) {
                st_wide(send_inbox(a, p) + stage_one_slot(a, call.epoch, a.rank) + 2 * line, call.tag, call.id,
                        w0, w1);
            }
        }
    }
}

// What every call begins with (every thread must call it): the next epoch (see begin_epoch),
// its tag and identity, the start of the call's deadline (`code`: the dtype code, with flags
// such as TPAR_HEADER_FUSED for other calls, for the header a slow wait pushes).
__device__ __forceinline__ Call begin_call(const TparArgs& a, int code) {
    Call call;
    call.ticket = begin_epoch(a);
    call.epoch = call.ticket.epoch;
    call.tag = tag_for_epoch(call.epoch);
    call.id = call.tag ^ a.call_hash;
    call.start = now_ns();
    call.code = code;
    return call;
}
// What every call ends with, failed or not (every thread must reach it): the epoch published.
__device__ __forceinline__ void end_call(const TparArgs& a, const Call& call) { end_epoch(a, call.ticket); }

// ---- giving up, and telling the peers why ----

__device__ __forceinline__ const u64* peer_header(const TparArgs& a, const Call& call, u32 peer) {
    return recv_inbox(a, peer) + stage_one_slot(a, call.epoch, peer);
}
// Whether `peer`'s call header of this epoch has arrived (it began this call).
__device__ TPAR_COLD bool header_arrived(const TparArgs& a, const Call call, u32 peer) {
    return ld_wide(peer_header(a, call, peer) + 2).t0 == call.tag;
}
// `peer`'s notice of this epoch (0: none).
__device__ TPAR_COLD u32 notice_of(const TparArgs& a, const Call call, u32 peer) {
    const Wide v = ld_wide(peer_header(a, call, peer) + 6);
    return v.t0 == call.tag && (v.w1 & TPAR_NOTICE) ? v.w1 : 0u;
}
__device__ __forceinline__ void push_notice(const TparArgs& a, const Call& call, u32 word) {
    for (u32 p = 0; p < a.world_size; ++p) {
        if (p != a.rank) {
            st_wide(send_inbox(a, p) + stage_one_slot(a, call.epoch, a.rank) + 6, call.tag, call.id, a.call_hash,
                    word);
        }
    }
}
// Reports the failure in this rank's error word and tells every peer (its header's last line).
// Another thread of this rank may be pushing the header right now, having read the error word
// before it was set (push_header): the notice is pushed again once such a push has landed, so
// that the last write of that line carries it. (3 processes sharing one H200, 2026-12-02: in the
// ring's mismatch row the header of a later slow wait erased the notice, and the third rank
// timed out instead of naming the mismatch.)
__device__ TPAR_COLD void give_up(const TparArgs& a, const Call call, u32 code, u32 peer, u32 phase, u32 field,
                                       u32 detail) {
    report_error(a, code, peer, phase, field, detail);
    const u32 word = own_notice(a);  // the first report wins; this one may have lost
    push_notice(a, call, word);
    __nanosleep(4000);
    push_notice(a, call, word);
}

// The step of a wait that missed for a while (every `check_mask + 1` polls), out of line: the
// first time, this rank's call header is pushed (the wait is slow: a peer may need it to name
// a mismatch, or to see that this rank began the call); then `slow_check()` (false: it found,
// and reported, a failure of its own); then, past the deadline, it gives up on `peer` in
// `phase` (give_up: the error word, and a notice to the peers), and it gives up quietly if the
// error word is already set (another thread failed: this call is over). A peer whose header has
// arrived began this call and may itself be waiting for a third rank: it gets a grace of an
// eighth of the deadline to say so (its notice, which the slow check reads), so that every rank
// names the rank that was the cause, not the one it happened to wait for.
template <typename SlowCheck>
__device__ TPAR_COLD bool slow_step(const TparArgs& a, const Call call, bool first, u32 peer, u32 phase,
                                       SlowCheck slow_check) {
    // A rank that has given up (another thread's error) is done with this call: it pushes no
    // header, which would overwrite its notice to the peers.
    if (ld_sys(a.error) != 0) return false;
    if (first) push_header(a, call);
    if (!slow_check()) return false;
    const u64 waited = now_ns() - call.start;
    if (waited > a.timeout_ns) {
        const bool grace = peer != a.rank && waited <= a.timeout_ns + a.timeout_ns / 8 && header_arrived(a, call, peer);
        if (!grace) {
            give_up(a, call, TPAR_ERR_TIMEOUT, peer, phase, 0, 0);
            return false;
        }
    }
    return ld_sys(a.error) == 0;
}
// Pauses as the policy says, and every `check_mask + 1` polls takes the slow step (above).
// False when the wait is over without its data; the error word is then set.
template <typename SlowCheck>
__device__ __forceinline__ bool keep_waiting(const TparArgs& a, const Call& call, Wait& w, u32 peer, u32 phase,
                                             SlowCheck slow_check) {
    if (w.policy.max_pause_ns > 0 && w.spins >= w.policy.free_polls) {
        __nanosleep(w.pause);
        w.pause = w.pause < w.policy.max_pause_ns ? w.pause * 2 : w.policy.max_pause_ns;
    }
    if ((++w.spins & w.policy.check_mask) == 0) {
        return slow_step(a, call, w.spins == w.policy.check_mask + 1, peer, phase, slow_check);
    }
    return true;
}

// The peer's call header in this rank's inbox, if it has arrived for this epoch (its first
// halves carry the epoch's tag; the identity may differ, which is the point): 0 when it matches
// ours or has not arrived, else the index of the first word that differs, with the peer's value
// in *theirs. The op (dtype, algorithm, fused) is compared first, so that a count that differs
// is read knowing what the count counts; then count, chunk and call hash.
__device__ TPAR_COLD u32 header_difference(const TparArgs& a, const Call call, u32 peer, u32* theirs) {
    const u64* slot = recv_inbox(a, peer) + stage_one_slot(a, call.epoch, peer);
    u32 words[8];
    for (int line = 1; line < TPAR_HEADER_LINES / 2; ++line) {
        const Wide v = ld_wide(slot + 2 * line);
        if (v.t0 != call.tag) return 0;
        words[2 * line] = v.w0;
        words[2 * line + 1] = v.w1;
    }
    const int order[5] = {4, 2, 3, 5, 6};
    for (int k = 0; k < 5; ++k) {
        const int i = order[k];
        if (words[i] != header_word(a, i, call.code)) {
            *theirs = words[i];
            return (u32)i;
        }
    }
    return 0;
}

// The slow check of a wait for a peer's data: the peer's notice (it gave up: name the rank it
// names), then the peer's header, compared with ours.
struct HeaderMatches {
    const TparArgs& a;
    const Call call;
    u32 peer;
    u32 phase;
    __device__ TPAR_COLD bool operator()() const {
        const u32 notice = notice_of(a, call, peer);
        // A notice naming this rank is the peer's view of this rank: the headers, below, name
        // what differs from here.
        if (notice != 0 && (notice & 0xff) != a.rank) {
            const u32 code = (notice >> 8) & 0xff, cause = notice & 0xff;
            if (code == TPAR_ERR_MISMATCH) {
                give_up(a, call, TPAR_ERR_MISMATCH, cause, TPAR_PHASE_HEADER, TPAR_FIELD_NOTICE, peer);
            } else {
                give_up(a, call, TPAR_ERR_TIMEOUT, cause, phase, 0, 0);
            }
            return false;
        }
        u32 theirs = 0, field = header_difference(a, call, peer, &theirs);
        if (field != 0) {
            give_up(a, call, TPAR_ERR_MISMATCH, peer, TPAR_PHASE_HEADER, field, theirs);
            return false;
        }
        // The peer may be passing on a third rank's view: that this rank's call differs from
        // the third rank's (3 processes on one H200, 2026-12-02, ring: rank 1 relayed rank 0's
        // mismatch with rank 2 to rank 2, whose call matched rank 1's, and rank 2 timed out).
        // Every peer pushed its header once its wait turned slow: name the first that differs.
        if (notice != 0 && ((notice >> 8) & 0xff) == TPAR_ERR_MISMATCH) {
            for (u32 other = 0; other < a.world_size; ++other) {
                if (other == a.rank || other == peer) continue;
                field = header_difference(a, call, other, &theirs);
                if (field != 0) {
                    give_up(a, call, TPAR_ERR_MISMATCH, other, TPAR_PHASE_HEADER, field, theirs);
                    return false;
                }
            }
        }
        return true;
    }
};

// ---- waiting for lines ----

// Spins until the LL line at `p` carries this call's tag and identity, and gives it. Once the
// wait is slow the peer's header is compared with ours on every deadline check, so a mismatched
// call (whose lines never satisfy the wait) is named as such instead of timing out.
__device__ TPAR_SLOW_PATH bool wait_unit(const TparArgs& a, const Call& call, const u64* p, u32 peer, u32 phase,
                                         Wide* out) {
    Wide v = ld_wide(p);
    Wait w = begin_wait(ll_polls(from_host(a, peer)));
    while (!wide_has(v, call.tag, call.id)) {
        if (!keep_waiting(a, call, w, peer, phase, HeaderMatches{a, call, peer, phase})) return false;
        v = ld_wide(p);
    }
    *out = v;
    return true;
}

// Waits until the narrow line at `p` (written by this rank's own blocks) carries the call's
// tag, and gives its payload word.
__device__ TPAR_SLOW_PATH bool wait_line(const TparArgs& a, const Call& call, const u64* p, u32 phase, u32* word) {
    u64 v = ld_sys(p);
    Wait w = begin_wait(ll_polls(false));
    while ((u32)(v >> 32) != call.tag) {
        if (!keep_waiting(a, call, w, a.rank, phase, NoSlowCheck())) return false;
        v = ld_sys(p);
    }
    *word = (u32)v;
    return true;
}

// ---- the input's units ----

// A call's units (8 bytes of payload: two words) walked grid-stride: thread `tid` takes units
// tid, tid + stride, ... The push kernels load the thread's first unit before the call counter,
// so the two loads' latencies overlap (after pdl_wait: the input may be the previous kernel's
// output); `load` hands that unit out again instead of reading it twice, and `store` writes a
// unit's sum, rounded to the dtype once, to the output.
template <int DT> struct InputUnits {
    u64 words, units, tid, stride;
    u32 first0, first1;
    __device__ __forceinline__ void load(const TparArgs& a, u64 u, u32* w0, u32* w1) const {
        *w0 = first0;
        *w1 = first1;
        if (u != tid) load_pair<DT>(a.input, u, a.count, words, w0, w1);
    }
    __device__ __forceinline__ void store(const TparArgs& a, u64 u, const float* acc) const {
        store_pair<DT>(a.output, u, a.count, words, Lanes<DT>::pack(acc), Lanes<DT>::pack(acc + Lanes<DT>::PER_WORD));
    }
};
// Before begin_call (every thread).
template <int DT> __device__ __forceinline__ InputUnits<DT> input_units(const TparArgs& a) {
    InputUnits<DT> in;
    in.words = words_for<DT>(a.count);
    in.units = (in.words + 1) / 2;
    in.tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    in.stride = (u64)gridDim.x * blockDim.x;
    pdl_wait();
    in.first0 = 0;
    in.first1 = 0;
    if (in.tid < in.units) load_pair<DT>(a.input, in.tid, a.count, in.words, &in.first0, &in.first1);
    return in;
}

// ---- pushing ----

// Unit `u` ({w0, w1}) to line `line` (counted from the inbox's start) of every rank in `mask`
// but this one, through the inboxes each pair exchanges on (send_inbox).
__device__ __forceinline__ void push_unit_to(const TparArgs& a, const Call& call, u32 mask, u64 line, u32 w0, u32 w1) {
    for (u32 p = 0; p < a.world_size; ++p) {
        if (p != a.rank && (mask >> p & 1u)) st_wide(send_inbox(a, p) + line, call.tag, call.id, w0, w1);
    }
}
// The same to one rank.
__device__ __forceinline__ void push_unit(const TparArgs& a, const Call& call, u32 to, u64 line, u32 w0, u32 w1) {
    st_wide(send_inbox(a, to) + line, call.tag, call.id, w0, w1);
}

// Every rank but this one.
__device__ __forceinline__ u32 all_ranks(const TparArgs& a) { return a.world_size >= 32 ? ~0u : (1u << a.world_size) - 1; }

// ---- f32 partials (the islands' exchange, the ring's reduce-scatter) ----

// Wide lines a unit's f32 partial takes: one for f32 data (two elements), two for 16-bit data
// (four elements). A partial region of `units` units takes 2 * PARTIAL_LINES * units lines.
template <int DT> struct Partial {
    static const int LINES = DT == TPAR_DTYPE_F32 ? 1 : 2;
};
// Unit u's partial (acc[0 .. 2 * PER_WORD]) to line `base + 2 * LINES * u` of rank `to`.
template <int DT>
__device__ __forceinline__ void push_partial(const TparArgs& a, const Call& call, u32 to, u64 base, u64 u,
                                             const float* acc) {
    u64* p = send_inbox(a, to) + base + 2 * Partial<DT>::LINES * u;
    st_wide(p, call.tag, call.id, __float_as_uint(acc[0]), __float_as_uint(acc[1]));
    if (Partial<DT>::LINES == 2) st_wide(p + 2, call.tag, call.id, __float_as_uint(acc[2]), __float_as_uint(acc[3]));
}
// Unit u's partial from `peer`, at line `base + 2 * LINES * u` of this rank's inbox for it.
template <int DT>
__device__ __forceinline__ bool wait_partial(const TparArgs& a, const Call& call, u32 peer, u64 base, u64 u, u32 phase,
                                             float* out) {
    const u64* p = recv_inbox(a, peer) + base + 2 * Partial<DT>::LINES * u;
    Wide v = ld_wide(p), v2 = {0u, 0u, 0u, 0u};
    if (Partial<DT>::LINES == 2) v2 = ld_wide(p + 2);
    if (!wide_has(v, call.tag, call.id) && !wait_unit(a, call, p, peer, phase, &v)) return false;
    if (Partial<DT>::LINES == 2 && !wide_has(v2, call.tag, call.id) && !wait_unit(a, call, p + 2, peer, phase, &v2)) {
        return false;
    }
    out[0] = __uint_as_float(v.w0);
    out[1] = __uint_as_float(v.w1);
    out[2] = __uint_as_float(v2.w0);
    out[3] = __uint_as_float(v2.w1);
    return true;
}

// ---- reduction in rank order ----

// Unit u of every rank of `mask` summed in rank order into acc (f32, 2 * PER_WORD elements):
// rank r's term from line `slot_payload(epoch, r) + 2u` of this rank's inbox, this rank's own
// from {own0, own1} (read from its input, never through its inbox). The peers are taken in
// groups of TPAR_RANK_GROUP, every line of a group loaded before any is checked, so their
// latencies overlap; the groups bound the registers. False once a wait has failed (the error
// word set); acc then holds what arrived. SITE_PER_GROUP: where the waits for lines that missed
// are (tuning.cuh, TPAR_WAIT_SITE_PER_GROUP).
template <int DT, bool SITE_PER_GROUP = (TPAR_WAIT_SITE_PER_GROUP != 0)>
__device__ __forceinline__ bool reduce_unit(const TparArgs& a, const Call& call, u32 mask, u64 u, u32 own0, u32 own1,
                                            u32 phase, float* acc) {
    const u32 first = __ffs(mask) - 1;  // the lowest rank of the set: its term starts the sum
    for (u32 g = 0; g < a.world_size; g += TPAR_RANK_GROUP) {
        Wide v[TPAR_RANK_GROUP];
#pragma unroll
        for (u32 k = 0; k < TPAR_RANK_GROUP; ++k) {
            const u32 r = g + k;
            if (r < a.world_size && r != a.rank && (mask >> r & 1u)) {
                v[k] = ld_wide(recv_inbox(a, r) + slot_payload(a, call.epoch, r) + 2 * u);
            }
        }
        if constexpr (SITE_PER_GROUP) {
            // The lines that have not arrived, waited for one at a time at a single wait site
            // (its loop and slow steps are inlined once per group, not once per peer).
            u32 missing = 0;
#pragma unroll
            for (u32 k = 0; k < TPAR_RANK_GROUP; ++k) {
                const u32 r = g + k;
                if (r < a.world_size && r != a.rank && (mask >> r & 1u) && !wide_has(v[k], call.tag, call.id)) {
                    missing |= 1u << k;
                }
            }
            while (missing != 0) {
                const u32 k = __ffs(missing) - 1, r = g + k;
                Wide got;
                const u64* p = recv_inbox(a, r) + slot_payload(a, call.epoch, r) + 2 * u;
                if (!wait_unit(a, call, p, r, phase, &got)) return false;
#pragma unroll
                for (u32 kk = 0; kk < TPAR_RANK_GROUP; ++kk) {
                    if (kk == k) v[kk] = got;
                }
                missing &= missing - 1;
            }
        }
#pragma unroll
        for (u32 k = 0; k < TPAR_RANK_GROUP; ++k) {
            const u32 r = g + k;
            if (r >= a.world_size) break;
            if (!(mask >> r & 1u)) continue;
            u32 w0 = own0, w1 = own1;
            if (r != a.rank) {
                if (!SITE_PER_GROUP && !wide_has(v[k], call.tag, call.id)) {
                    Wide got;  // the slow path
                    const u64* p = recv_inbox(a, r) + slot_payload(a, call.epoch, r) + 2 * u;
                    if (!wait_unit(a, call, p, r, phase, &got)) return false;
                    v[k] = got;
                }
                w0 = v[k].w0;
                w1 = v[k].w1;
            }
            float x[4];
            Lanes<DT>::unpack(w0, x);
            Lanes<DT>::unpack(w1, x + Lanes<DT>::PER_WORD);
            for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) acc[e] = r == first ? x[e] : acc[e] + x[e];
        }
    }
    return true;
}

// ---- gathering ----

// Unit u of the gather slot, reduced by `owner`: waits for it and gives its words.
__device__ __forceinline__ bool gather_unit(const TparArgs& a, const Call& call, u32 owner, u64 u, u32 phase, u32* w0,
                                            u32* w1) {
    const u64* p = recv_inbox(a, owner) + gather_slot(a, call.epoch) + 2 * u;
    Wide v = ld_wide(p);
    if (!wide_has(v, call.tag, call.id) && !wait_unit(a, call, p, owner, phase, &v)) return false;
    *w0 = v.w0;
    *w1 = v.w1;
    return true;
}

// ---- the pull algorithms' flags ----

// After every thread of the block has written its part of what `phase` publishes: the block's
// flag of `phase` in this epoch's buffer, the call hash first, the epoch last with release (the
// fence makes the block's plain stores visible to peers' reads first). Every thread must call it.
__device__ __forceinline__ void publish_flag(const TparArgs& a, const Call& call, u32 phase) {
    __syncthreads();
    if (threadIdx.x == 0) {
        u64* flag = pull_flag(a.inboxes[a.rank], a, call.epoch, phase, blockIdx.x);
        __threadfence_system();
        st_sys(flag + 1, a.call_hash);
        st_release_sys(flag, call.epoch);
    }
}

// This block's share [first, last) of `items` (words or units) in the pull algorithms: contiguous,
// the same split on every rank.
struct BlockRange {
    u64 first, last;
};
__device__ __forceinline__ BlockRange block_range(u64 items) {
    const u64 per_block = (items + gridDim.x - 1) / gridDim.x;
    const u64 first = (u64)blockIdx.x * per_block;
    return BlockRange{first, min(items, first + per_block)};
}
// Every thread: the block's words of the input copied into this rank's published input, then
// the block's flag of phase 0 over them (publish_flag). Returns the block's words.
template <int DT> __device__ __forceinline__ BlockRange publish_input(const TparArgs& a, const Call& call) {
    const BlockRange b = block_range(words_for<DT>(a.count));
    u32* mine = pull_data(a.inboxes[a.rank], a, call.epoch);
    for (u64 i = b.first + threadIdx.x; i < b.last; i += blockDim.x) mine[i] = load_word<DT>(a.input, i, a.count);
    publish_flag(a, call, 0);
    return b;
}

// Waits until `peer`'s flag of `phase` for `block` carries this epoch (acquire: its data is
// then visible), then checks that the peer called with the same arguments (the hash beside the
// epoch); a different hash is named from the peer's header as a mismatch.
__device__ TPAR_SLOW_PATH bool wait_flag(const TparArgs& a, const Call& call, u32 peer, u32 phase, u32 block,
                                         u32 wait_phase) {
    const u64* flag = pull_flag(a.inboxes[peer], a, call.epoch, phase, block);
    Wait w = begin_wait(pull_flag_polls());
    while (ld_acquire_sys(flag) != call.epoch) {
        if (!keep_waiting(a, call, w, peer, wait_phase, HeaderMatches{a, call, peer, wait_phase})) return false;
    }
    if ((u32)ld_sys(flag + 1) == a.call_hash) return true;
    // Another call: its header names what differs. The peer pushes it once it finds this
    // rank's call different in turn, which needs this rank's header too.
    push_header(a, call);
    Wait h = begin_wait(pull_flag_polls());
    for (;;) {
        u32 theirs = 0, field = header_difference(a, call, peer, &theirs);
        if (field != 0) {
            give_up(a, call, TPAR_ERR_MISMATCH, peer, TPAR_PHASE_HEADER, field, theirs);
            return false;
        }
        if (!keep_waiting(a, call, h, peer, wait_phase, NoSlowCheck())) return false;
    }
}
