// layout.cuh: the LL line format, the call's identity, and where each line lives, defined once
// for every kernel. It mirrors the Rust protocol module (crates/tpar/src/protocol: line.rs,
// header.rs, layout.rs, schedule.rs); a Rust test reads the #defines below and checks that
// both sides agree, so change them together.
//
// LL line, 16 bytes: {word0, tag, word1, id} written with one 16-byte store, where tag is the
// epoch's tag and id = tag ^ call_hash, the hash of the call's count, dtype, op and algorithm
// (computed by the host: backend/cuda/kernels.rs, call_hash). Each 8-byte half is written
// atomically. A reader takes a line only when both halves carry this call's values: the first
// half proves the line belongs to this epoch (tags of epochs fewer than 2^32-1 apart differ, so
// a stale line left in a rotating buffer never matches), the second that the peer called with
// the same arguments. A peer that called with other arguments never satisfies a wait, which
// then finds, on its slow path, the peer's call header (pushed beside the data, never waited
// for) and names the difference. Nothing is ever cleared.
//
// Inbox of one rank, in 8-byte lines (the same layout in device memory and in pinned host
// memory; a 16-byte LL line takes two):
//   [TPAR_SEGMENT_HEADER_LINES]
//   TPAR_BUFFERS x { world_size x [TPAR_HEADER_LINES + payload_lines] (stage-one slots, by
//                    sender), [payload_lines] (gather slot) }
// followed, in device memory, by the pull algorithms' region:
//   TPAR_BUFFERS x [payload_lines x 4 bytes] (published input, plain data), then
//   TPAR_BUFFERS x TPAR_PULL_PHASES x TPAR_MAX_BLOCKS flags of 128 bytes ({epoch, call hash}).
// A slot's payload holds one chunk as 16-byte lines: unit u (8 bytes of data) at lines 2u, 2u+1.
#pragma once

#include "abi.cuh"
#include "memorder.cuh"

#define TPAR_HEADER_LINES 8
#define TPAR_BUFFERS 3
#define TPAR_SEGMENT_HEADER_LINES 16
#define TPAR_HEADER_MAGIC 0x74706172u
#define TPAR_FLAG_STRIDE_U64 16
// Flags per buffer and block of the pull algorithms: one per step that publishes data (input,
// island partial, island finals).
#define TPAR_PULL_PHASES 3

// ---- epochs, tags and the call's identity ----

// Tags cycle through 1..=0xffffffff, never 0 (zeroed memory is never data).
__device__ __forceinline__ u32 tag_for_epoch(u64 epoch) {
    return (u32)((epoch - 1) % 0xffffffffull) + 1;
}
// A narrow (8-byte) LL line: only for lines a rank writes and reads itself (the fused kernels'
// exchange of segment sums in the device state).
__device__ __forceinline__ u64 pack_line(u32 tag, u32 word) {
    return ((u64)tag << 32) | (u64)word;
}

struct Wide {
    u32 w0, t0, w1, t1;
};
__device__ __forceinline__ void st_wide(u64* p, u32 tag, u32 id, u32 w0, u32 w1) {
    st_volatile_v4(p, w0, tag, w1, id);
}
__device__ __forceinline__ Wide ld_wide(const u64* p) {
    Wide v;
    ld_volatile_v4(p, &v.w0, &v.t0, &v.w1, &v.t1);
    return v;
}
__device__ __forceinline__ bool wide_has(const Wide& v, u32 tag, u32 id) { return v.t0 == tag && v.t1 == id; }

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
// The first payload line of stage-one slot `from` (unit u at + 2u).
__device__ __forceinline__ u64 slot_payload(const TparArgs& a, u64 epoch, u32 from) {
    return stage_one_slot(a, epoch, from) + TPAR_HEADER_LINES;
}
__device__ __forceinline__ u64 gather_slot(const TparArgs& a, u64 epoch) {
    return buffer_start(a, epoch) + (u64)a.world_size * slot_lines(a);
}
__device__ __forceinline__ u64 ll_region_lines(const TparArgs& a) {
    return TPAR_SEGMENT_HEADER_LINES + TPAR_BUFFERS * buffer_lines(a);
}

// ---- the pull algorithms' regions ----

// The published input of `epoch`'s buffer: plain data, one chunk.
__device__ __forceinline__ u32* pull_data(u64* inbox, const TparArgs& a, u64 epoch) {
    return (u32*)(inbox + ll_region_lines(a)) + (epoch % TPAR_BUFFERS) * a.payload_lines;
}
// The island partial (f32, up to twice a chunk) and the island finals (plain data) that
// islands-pull publishes: in the payload of stage-one slots 0 and 1 of the epoch's buffer,
// which no push algorithm uses during a pull call (peers push only their call headers, into
// the slots' header lines).
__device__ __forceinline__ float* pull_partial(u64* inbox, const TparArgs& a, u64 epoch) {
    return (float*)(inbox + slot_payload(a, epoch, 0));
}
__device__ __forceinline__ u32* pull_finals(u64* inbox, const TparArgs& a, u64 epoch) {
    return (u32*)(inbox + slot_payload(a, epoch, 1));
}
// Block `block`'s flag of `phase` in `epoch`'s buffer: {epoch (written last, with release),
// call hash}, one per 128 bytes so that flags of different blocks share no line.
__device__ __forceinline__ u64* pull_flag(u64* inbox, const TparArgs& a, u64 epoch, u32 phase, u32 block) {
    u64* flags = (u64*)((u32*)(inbox + ll_region_lines(a)) + TPAR_BUFFERS * a.payload_lines);
    const u64 index = ((epoch % TPAR_BUFFERS) * TPAR_PULL_PHASES + phase) * TPAR_MAX_BLOCKS + block;
    return flags + index * TPAR_FLAG_STRIDE_U64;
}

// ---- shares (protocol::schedule::share) ----

// The first unit of member i of m's share of `units`: contiguous, in order, sizes differing
// by at most one. A launch's units fit 32 bits (they fit its slots), so the split is computed
// in 32-bit arithmetic: a 64-bit division is a long software sequence on the GPU, and
// two-shot and the islands' ranges take one per unit.
__device__ __forceinline__ u64 share_start(u64 units, u32 m, u32 i) {
    const u32 n = (u32)units, base = n / m, extra = n % m;
    return (u64)i * base + (i < extra ? i : extra);
}
__device__ __forceinline__ u32 share_owner(u64 units, u32 m, u64 unit) {
    const u32 n = (u32)units, u = (u32)unit, base = n / m, extra = n % m, boundary = extra * (base + 1);
    if (u < boundary) return u / (base + 1);
    return extra + (u - boundary) / base;
}
// Two-shot's names for the same split over the ranks.
__device__ __forceinline__ u64 owned_start(u64 units, u32 n, u32 owner) { return share_start(units, n, owner); }
__device__ __forceinline__ u32 owner_of_line(u64 units, u32 n, u64 unit) { return share_owner(units, n, unit); }

// ---- islands (crate::islands, protocol::schedule) ----

__device__ __forceinline__ u32 island_of(const TparArgs& a, u32 rank) { return a.island_of[rank]; }
__device__ __forceinline__ u32 island_size(const TparArgs& a, u32 island) { return a.island_sizes[island]; }
__device__ __forceinline__ u32 island_count(const TparArgs& a) { return a.islands; }
// `rank`'s index among its island's members, in rank order.
__device__ __forceinline__ u32 island_position(const TparArgs& a, u32 rank) { return a.island_position[rank]; }
__device__ __forceinline__ u32 island_member(const TparArgs& a, u32 island, u32 position) {
    return a.island_members[a.island_first[island] + position];
}
// The rank of island `from` that sends island `from`'s partial over `to`'s range.
__device__ __forceinline__ u32 island_sender(const TparArgs& a, u32 from, u32 to) {
    return island_member(a, from, island_position(a, to) % island_size(a, from));
}
// The bit set of the members of `rank`'s island.
__device__ __forceinline__ u32 island_mask(const TparArgs& a, u32 rank) {
    u32 mask = 0;
    for (u32 r = 0; r < a.world_size; ++r) mask |= (a.island_of[r] == a.island_of[rank]) ? (1u << r) : 0u;
    return mask;
}

// This rank's place among the islands: its island, how many there are, its island's members
// (a bit set) and size, and its position there.
struct IslandView {
    u32 island, islands, members, size, position;
};
__device__ __forceinline__ IslandView island_view(const TparArgs& a) {
    const u32 island = island_of(a, a.rank);
    return IslandView{island, island_count(a), island_mask(a, a.rank), island_size(a, island), island_position(a, a.rank)};
}

// ---- the ring (protocol::schedule) ----

__device__ __forceinline__ u32 ring_reduce_chunk(u32 rank, u32 n, u32 step) { return (rank + 2 * n - step - 1) % n; }
__device__ __forceinline__ u32 ring_gather_chunk(u32 rank, u32 n, u32 step) { return (rank + n - step) % n; }

// ---- the call header (first lines of each stage-one slot) ----

// Word i of this rank's call header: magic, sequence (kept by the CPU backend only), count
// (low, high), dtype | algorithm << 8 | flags, chunk, the call hash, 0. Pushed as LL lines
// beside the data and never waited for: read only to name a mismatch.
__device__ __forceinline__ u32 header_word(const TparArgs& a, int i, int code) {
    switch (i) {
        case 0: return TPAR_HEADER_MAGIC;
        case 1: return 0;
        case 2: return (u32)a.total_count;
        case 3: return (u32)(a.total_count >> 32);
        case 4: return (u32)code | (a.algo << 8);
        case 5: return a.chunk;
        case 6: return a.call_hash;
        default: return 0;
    }
}
