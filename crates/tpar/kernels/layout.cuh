// layout.cuh: the LL line format and where each line lives, defined once for every kernel. It
// mirrors the Rust protocol module (crates/tpar/src/protocol: line.rs, header.rs, layout.rs);
// a Rust test reads the #defines below and checks that both sides agree, so change them
// together.
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

#include "abi.cuh"
#include "memorder.cuh"

#define TPAR_HEADER_LINES 8
#define TPAR_BUFFERS 3
#define TPAR_SEGMENT_HEADER_LINES 16
#define TPAR_HEADER_MAGIC 0x74706172u
#define TPAR_FLAG_STRIDE_U64 16

// ---- epochs and tags ----

// Tags cycle through 1..=0xffffffff, never 0 (zeroed memory is never data).
__device__ __forceinline__ u32 tag_for_epoch(u64 epoch) {
    return (u32)((epoch - 1) % 0xffffffffull) + 1;
}
__device__ __forceinline__ u64 pack_line(u32 tag, u32 word) {
    return ((u64)tag << 32) | (u64)word;
}

// ---- slots ----

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

// The pull algorithm's region after the LL region: the plain data of `epoch`'s buffer, and
// block `block`'s flag (one per 128 bytes, so flags of different blocks share no line).
__device__ __forceinline__ u32* pull_data(u64* inbox, const TparArgs& a, u64 epoch) {
    return (u32*)(inbox + ll_region_lines(a)) + (epoch % TPAR_BUFFERS) * a.payload_lines;
}
__device__ __forceinline__ u64* pull_flag(u64* inbox, const TparArgs& a, u32 block) {
    u64* flags = (u64*)((u32*)(inbox + ll_region_lines(a)) + TPAR_BUFFERS * a.payload_lines);
    return flags + (u64)block * TPAR_FLAG_STRIDE_U64;
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

// ---- wide lines: 16 bytes, two payload words each beside its own copy of the tag ----
// {word0, tag, word1, tag}, written with one 16-byte store. Each 8-byte half is written
// atomically, so a reader that sees the tag in both halves has both words; it never takes a
// stale word. Half the store and load instructions of 8-byte lines for the same bytes. Needs
// 16-byte aligned slots: the host uses it when payload_lines is even.

struct Wide {
    u32 w0, t0, w1, t1;
};
__device__ __forceinline__ void st_wide(u64* p, u32 tag, u32 w0, u32 w1) { st_volatile_v4(p, w0, tag, w1, tag); }
__device__ __forceinline__ Wide ld_wide(const u64* p) {
    Wide v;
    ld_volatile_v4(p, &v.w0, &v.t0, &v.w1, &v.t1);
    return v;
}
__device__ __forceinline__ bool wide_has(const Wide& v, u32 tag) { return v.t0 == tag && v.t1 == tag; }
