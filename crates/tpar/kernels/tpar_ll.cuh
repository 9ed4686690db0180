// tpar_ll.cuh: what every tpar kernel shares. The LL line format, the inbox layout, the call
// header, dtype conversions, the deadline and the error word. It mirrors the Rust protocol
// module (crates/tpar/src/protocol); a Rust test reads the #defines below and checks that both
// sides agree, so change them together.
//
// LL line: one 8-byte store carrying 4 bytes of payload (low half) and the epoch's tag (high
// half). A reader that sees the current tag has the data; nothing is ever cleared.
//
// Inbox of one rank, in lines (the same layout in device memory and in pinned host memory):
//   [TPAR_SEGMENT_HEADER_LINES]
//   TPAR_BUFFERS x { world_size x [TPAR_HEADER_LINES + payload_lines] (stage one, by sender),
//                    [payload_lines] (gather slot, two-shot) }
// followed, for the pull algorithm, by
//   TPAR_BUFFERS x [payload_lines x 4 bytes] (plain data) and TPAR_MAX_BLOCKS flags of 128 bytes.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define TPAR_HEADER_LINES 8
#define TPAR_BUFFERS 3
#define TPAR_SEGMENT_HEADER_LINES 16
#define TPAR_HEADER_MAGIC 0x74706172u
#define TPAR_MAX_RANKS 16
#define TPAR_MAX_BLOCKS 64
#define TPAR_FLAG_STRIDE_U64 16

#define TPAR_DTYPE_F32 1
#define TPAR_DTYPE_F16 2
#define TPAR_DTYPE_BF16 3

#define TPAR_ALGO_ONE_SHOT 1
#define TPAR_ALGO_TWO_SHOT 2
#define TPAR_ALGO_ONE_SHOT_PULL 3
#define TPAR_ALGO_HOST_STAGED 4

// Error word (host-mapped u64): code | peer << 8 | phase << 16 | field << 24 | detail << 32,
// where for a mismatch `field` is the header word that differed and `detail` the peer's value
// of it. Zero means fine.
#define TPAR_ERR_TIMEOUT 1
#define TPAR_ERR_MISMATCH 2
#define TPAR_PHASE_HEADER 1
#define TPAR_PHASE_ONE_SHOT 2
#define TPAR_PHASE_REDUCE_SCATTER 3
#define TPAR_PHASE_ALL_GATHER 4
#define TPAR_PHASE_PULL_FLAG 5

// Tuning, overridable at compile time (TPAR_KERNEL_DEFINES="-DNAME=VALUE ..."): the longest
// pause between two polls of a line in host memory, in ns (0: spin without pausing). On one
// H200 pauses of up to 512 ns changed nothing for host-staged.
#ifndef TPAR_POLL_SLEEP_MAX_NS
#define TPAR_POLL_SLEEP_MAX_NS 512
#endif
// The same for polls of device memory (every other algorithm). Across GPUs, readers spinning
// without pause on lines that peers write over NVLink put one-shot into a state of 200-400 us
// per call (4 x H200, one process per GPU, 42 and 64 KiB: 214 and 418 us without pauses,
// 6.6 and 7.0 us with up to 256 ns, 6.8 and 7.2 us with up to 2048 ns, where two-shot slowed
// from 7.4 to 12 us); bench/README.md has the run.
#ifndef TPAR_DEVICE_POLL_SLEEP_MAX_NS
#define TPAR_DEVICE_POLL_SLEEP_MAX_NS 256
#endif
// Polls of device memory made without any pause before the pauses above begin: a line that
// arrives within about a microsecond (the common case once the ranks run in step) is seen at
// once instead of up to one pause late; a wait longer than that falls back to the pauses, which
// is what kept the multi-GPU state above away.
// How the slow paths (waits, error reports, header checks) are compiled: inlined (1, the
// default) or as calls (0; each call takes the argument block by reference, which puts a copy
// of it on the stack). One H200, 2 ranks as streams, bf16, 2026-12-01 (bench/README.md,
// "Anatomy of one call"): as calls, 0 B took 2.45 us against 2.17 inlined, but 4 KiB 2.72
// against 2.86, 32 KiB 2.77 against 3.20 and 256 KiB 3.98 against 4.09. The 8-rank figures
// were measured inlined only; which to default to per world size is open.
#ifndef TPAR_SLOW_PATH_INLINE
#define TPAR_SLOW_PATH_INLINE 1
#endif
#if TPAR_SLOW_PATH_INLINE
#define TPAR_SLOW_PATH __forceinline__
#else
#define TPAR_SLOW_PATH __noinline__
#endif
// Whether the header check polls its four words together also in device memory (it always
// does in host memory, where waiting for each word in turn costs a PCIe round trip apiece).
// Same run as above: 1 took 0 B to 1.89 us from 2.17, and changed 4 KiB to 256 KiB by at most
// 0.07 us either way (2 ranks; 8 ranks not measured with it).
#ifndef TPAR_HEADER_BATCH_POLL
#define TPAR_HEADER_BATCH_POLL 0
#endif
// Polls of host memory made without pause (host-staged) before the pauses begin.
#ifndef TPAR_HOST_FREE_POLLS
#define TPAR_HOST_FREE_POLLS 0
#endif
// Peers whose lines a thread loads at once before checking any (wide one-shot): 8 covers the
// common world sizes in one round trip within 64 registers.
#ifndef TPAR_RANK_GROUP
#define TPAR_RANK_GROUP 8
#endif
#ifndef TPAR_DEVICE_FREE_POLLS
#define TPAR_DEVICE_FREE_POLLS 64
#endif

// Kernel arguments, passed by value. Field order and types match `KernelArgs` in
// crates/tpar/src/backend/cuda/kernels.rs.
struct TparArgs {
    const void* input;
    void* output;
    u64 count;          // elements in this chunk
    u64 total_count;    // elements in the whole call (for the header)
    u64 payload_lines;  // lines of one slot
    u64 timeout_ns;
    u64* state;         // this rank's device state: [0] epoch of the last chunk, [1] blocks done
    u64* error;         // this rank's error word, in host-mapped memory
    u64* inboxes[TPAR_MAX_RANKS];  // every rank's inbox as this rank addresses it
    u32 rank;
    u32 world_size;
    u32 chunk;
    u32 algo;
};

// ---- memory access at system scope (peers and the host see these) ----

__device__ __forceinline__ u64 ld_sys(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 ld_sys_u32(const u32* p) {
    u32 v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_sys(u64* p, u64 v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ---- epochs and tags ----

// Tags cycle through 1..=0xffffffff, never 0 (zeroed memory is never data).
__device__ __forceinline__ u32 tag_for_epoch(u64 epoch) {
    return (u32)((epoch - 1) % 0xffffffffull) + 1;
}
__device__ __forceinline__ u64 pack_line(u32 tag, u32 word) {
    return ((u64)tag << 32) | (u64)word;
}

// Programmatic dependent launch (sm_90+). A kernel launched with programmatic stream
// serialization may start while the kernel before it on the stream still runs; it must not
// read anything that kernel wrote (the input, the state word) before `pdl_wait`, which returns
// once the previous grid has completed and its memory is visible. Launched without the
// attribute both are no-ops. `pdl_launch_dependents` lets the next kernel's launch begin now:
// its blocks then sit in `pdl_wait`, so the host halves the co-resident grid when it uses PDL.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

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

// ---- layout ----

__device__ __forceinline__ u64 slot_lines(const TparArgs& a) { return TPAR_HEADER_LINES + a.payload_lines; }
__device__ __forceinline__ u64 buffer_lines(const TparArgs& a) {
    return (u64)a.world_size * slot_lines(a) + a.payload_lines;
}
__device__ __forceinline__ u64 buffer_start(const TparArgs& a, u64 epoch) {
    return TPAR_SEGMENT_HEADER_LINES + (epoch % TPAR_BUFFERS) * buffer_lines(a);
}
__device__ __forceinline__ u64 stage_one_slot(const TparArgs& a, u64 epoch, u32 from) {
    return buffer_start(a, epoch) + (u64)from * slot_lines(a);
}
__device__ __forceinline__ u64 gather_slot(const TparArgs& a, u64 epoch) {
    return buffer_start(a, epoch) + (u64)a.world_size * slot_lines(a);
}
__device__ __forceinline__ u64 ll_region_lines(const TparArgs& a) {
    return TPAR_SEGMENT_HEADER_LINES + TPAR_BUFFERS * buffer_lines(a);
}

// Two-shot ownership: contiguous line ranges in rank order, sizes differing by at most one.
__device__ __forceinline__ u64 owned_start(u64 lines, u32 n, u32 owner) {
    u64 base = lines / n, extra = lines % n;
    return owner * base + (owner < extra ? owner : extra);
}
__device__ __forceinline__ u32 owner_of_line(u64 lines, u32 n, u64 line) {
    u64 base = lines / n, extra = lines % n, boundary = extra * (base + 1);
    if (line < boundary) return (u32)(line / (base + 1));
    return (u32)(extra + (line - boundary) / base);
}

// ---- dtypes: a payload word holds 1 f32 or 2 f16/bf16 elements (little-endian) ----

__device__ __forceinline__ float f16_bits_to_f32(u32 bits) {
    float f;
    unsigned short h = (unsigned short)bits;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u32 f32_to_f16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_bits_to_f32(u32 bits) { return __uint_as_float(bits << 16); }
__device__ __forceinline__ u32 f32_to_bf16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

template <int DT> struct Lanes;
template <> struct Lanes<TPAR_DTYPE_F32> {
    static const int PER_WORD = 1;
    __device__ static void unpack(u32 w, float* v) { v[0] = __uint_as_float(w); }
    __device__ static u32 pack(const float* v) { return __float_as_uint(v[0]); }
};
template <> struct Lanes<TPAR_DTYPE_F16> {
    static const int PER_WORD = 2;
    __device__ static void unpack(u32 w, float* v) { v[0] = f16_bits_to_f32(w & 0xffff); v[1] = f16_bits_to_f32(w >> 16); }
    __device__ static u32 pack(const float* v) { return f32_to_f16_bits(v[0]) | (f32_to_f16_bits(v[1]) << 16); }
};
template <> struct Lanes<TPAR_DTYPE_BF16> {
    static const int PER_WORD = 2;
    __device__ static void unpack(u32 w, float* v) { v[0] = bf16_bits_to_f32(w & 0xffff); v[1] = bf16_bits_to_f32(w >> 16); }
    __device__ static u32 pack(const float* v) { return f32_to_bf16_bits(v[0]) | (f32_to_bf16_bits(v[1]) << 16); }
};

template <int DT> __device__ __forceinline__ u64 words_for(u64 count) {
    return (count + Lanes<DT>::PER_WORD - 1) / Lanes<DT>::PER_WORD;
}

// Payload word `i` of an element buffer of `count` elements, zero-padded past the end. 16-bit
// elements are read one at a time: tensors need not be 4-byte aligned.
template <int DT> __device__ __forceinline__ u32 load_word(const void* base, u64 i, u64 count) {
    if (DT == TPAR_DTYPE_F32) return ((const u32*)base)[i];
    const unsigned short* h = (const unsigned short*)base;
    u32 lo = h[2 * i];
    u32 hi = (2 * i + 1 < count) ? h[2 * i + 1] : 0u;
    return lo | (hi << 16);
}
template <int DT> __device__ __forceinline__ void store_word(void* base, u64 i, u64 count, u32 w) {
    if (DT == TPAR_DTYPE_F32) { ((u32*)base)[i] = w; return; }
    unsigned short* h = (unsigned short*)base;
    h[2 * i] = (unsigned short)(w & 0xffff);
    if (2 * i + 1 < count) h[2 * i + 1] = (unsigned short)(w >> 16);
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

// ---- the call header (first lines of each stage-one slot) ----

__device__ __forceinline__ u32 header_word(const TparArgs& a, int i, int dtype) {
    switch (i) {
        case 0: return TPAR_HEADER_MAGIC;
        case 1: return 0;  // call sequence: kept by the CPU backend only
        case 2: return (u32)a.total_count;
        case 3: return (u32)(a.total_count >> 32);
        case 4: return (u32)dtype | (a.algo << 8);
        case 5: return a.chunk;
        default: return 0;
    }
}

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

// ---- wide lines: 16 bytes, two payload words each beside its own copy of the tag ----
// {word0, tag, word1, tag}, written with one 16-byte store. Each 8-byte half is written
// atomically, so a reader that sees the tag in both halves has both words; it never takes a
// stale word. Half the store and load instructions of 8-byte lines for the same bytes. Needs
// 16-byte aligned slots: the host uses it when payload_lines is even.

struct Wide {
    u32 w0, t0, w1, t1;
};
__device__ __forceinline__ void st_wide(u64* p, u32 tag, u32 w0, u32 w1) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w0), "r"(tag), "r"(w1), "r"(tag)
                 : "memory");
}
__device__ __forceinline__ Wide ld_wide(const u64* p) {
    Wide v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.w0), "=r"(v.t0), "=r"(v.w1), "=r"(v.t1)
                 : "l"(p)
                 : "memory");
    return v;
}
__device__ __forceinline__ bool wide_has(const Wide& v, u32 tag) { return v.t0 == tag && v.t1 == tag; }

// Two payload words (elements 2*pair.. of the input) with as few loads as alignment allows.
template <int DT> __device__ __forceinline__ void load_pair(const void* base, u64 pair, u64 count, u64 words,
                                                            u32* w0, u32* w1) {
    const u64 i = 2 * pair;
    const u64 elems_per_pair = 2 * Lanes<DT>::PER_WORD;
    if ((((unsigned long long)base) & 7) == 0 && (pair + 1) * elems_per_pair <= count) {
        uint2 v = ((const uint2*)base)[pair];
        *w0 = v.x;
        *w1 = v.y;
        return;
    }
    *w0 = load_word<DT>(base, i, count);
    *w1 = i + 1 < words ? load_word<DT>(base, i + 1, count) : 0u;
}
template <int DT> __device__ __forceinline__ void store_pair(void* base, u64 pair, u64 count, u64 words, u32 w0,
                                                             u32 w1) {
    const u64 i = 2 * pair;
    const u64 elems_per_pair = 2 * Lanes<DT>::PER_WORD;
    if ((((unsigned long long)base) & 7) == 0 && (pair + 1) * elems_per_pair <= count) {
        ((uint2*)base)[pair] = make_uint2(w0, w1);
        return;
    }
    store_word<DT>(base, i, count, w0);
    if (i + 1 < words) store_word<DT>(base, i + 1, count, w1);
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
// Segments of the longest row (16384 f32 elements: 8192 quads).
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
// Warp 0, with lane k holding segment k's sum (k < segments): the segment sums added in
// order, then 1 / sqrt(ss / hidden + eps), correctly rounded; the same in every lane.
__device__ __forceinline__ float norm_inv(float segment_sum, u32 segments, u64 hidden, float eps) {
    float ss = __shfl_sync(0xffffffffu, segment_sum, 0);
    for (u32 k = 1; k < segments; ++k) ss = __fadd_rn(ss, __shfl_sync(0xffffffffu, segment_sum, k));
    return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)hidden), eps)));
}

// Segment sums that blocks sharing a row exchange: LL lines (the sum's bits beside the
// epoch's tag) in this rank's own stage-one slot of its own inbox, which nothing else writes
// (a rank never pushes to itself), one line per (row, segment) of the launch. Tags make a
// reset unnecessary, as for the data.
__device__ __forceinline__ u64* norm_exchange_lines(const TparArgs& a, u64 epoch) {
    return a.inboxes[a.rank] + stage_one_slot(a, epoch, a.rank) + TPAR_HEADER_LINES;
}
// ==== end of the fused block ====
