// abi.cuh: what the host and the kernels must agree on, and nothing else: the argument block
// every allreduce kernel takes by value, the codes it carries (dtype, algorithm), the limits
// its arrays are sized by, and the error word a kernel reports failures in. Rust mirrors each
// of these in crates/tpar/src/backend/cuda/kernels.rs (and the dtype/algorithm codes in
// dtype.rs/algorithm.rs); its tests read the #defines and the struct below, so a change on
// one side alone fails them.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define TPAR_MAX_RANKS 16
#define TPAR_MAX_BLOCKS 64
// Threads per block of every kernel: its launch bound, and what the host launches with.
#define TPAR_THREADS 512
// Lines after the two words of a rank's device state where the blocks of a fused launch
// exchange their rows' segment sums (fused.cuh): a launch's rows x segments stay within it.
#define TPAR_STATE_EXCHANGE_LINES 8192

#define TPAR_DTYPE_F32 1
#define TPAR_DTYPE_F16 2
#define TPAR_DTYPE_BF16 3

#define TPAR_ALGO_ONE_SHOT 1
#define TPAR_ALGO_TWO_SHOT 2
#define TPAR_ALGO_ONE_SHOT_PULL 3
#define TPAR_ALGO_HOST_STAGED 4
#define TPAR_ALGO_STAGED 5
#define TPAR_ALGO_STAGED_PULL 6
#define TPAR_ALGO_ISLANDS 7
#define TPAR_ALGO_ISLANDS_PULL 8
#define TPAR_ALGO_RING 9

// Error word (host-mapped u64): code | peer << 8 | phase << 16 | field << 24 | detail << 32,
// where for a mismatch `field` is the header word that differed and `detail` the peer's value
// of it. Zero means fine.
#define TPAR_ERR_PEER_SHIFT 8
#define TPAR_ERR_PHASE_SHIFT 16
#define TPAR_ERR_FIELD_SHIFT 24
#define TPAR_ERR_DETAIL_SHIFT 32
#define TPAR_ERR_TIMEOUT 1
#define TPAR_ERR_MISMATCH 2
// The field of a mismatch another rank found and passed on in its notice (prims.cuh, give_up):
// the detail is the rank that found it.
#define TPAR_FIELD_NOTICE 7
#define TPAR_PHASE_HEADER 1
#define TPAR_PHASE_ONE_SHOT 2
#define TPAR_PHASE_REDUCE_SCATTER 3
#define TPAR_PHASE_ALL_GATHER 4
#define TPAR_PHASE_PULL_FLAG 5
#define TPAR_PHASE_STAGED 6
#define TPAR_PHASE_ISLANDS_INSIDE 7
#define TPAR_PHASE_ISLANDS_ACROSS 8
#define TPAR_PHASE_ISLANDS_GATHER 9
#define TPAR_PHASE_RING_REDUCE 10
#define TPAR_PHASE_RING_GATHER 11

// TparArgs::flags. Islands: every rank sends its island's partial of every unit to its
// partner in each other island, and every rank sums all units itself (no gather step); the
// host sets it for small calls (islands.cu has both forms, communicator.rs decides).
#define TPAR_FLAG_ISLANDS_ALL_UNITS 1
// Set in header word 4 by calls with TPAR_FLAG_ISLANDS_ALL_UNITS: the two forms of the
// islands exchange lay their partials out differently, so they must be named as a mismatch.
#define TPAR_HEADER_ISLANDS_ALL 0x20000

// Kernel arguments, passed by value. Field order and types match `KernelArgs` in
// crates/tpar/src/backend/cuda/kernels.rs.
struct TparArgs {
    const void* input;
    void* output;
    u64 count;          // elements in this chunk
    u64 total_count;    // elements in the whole call (for the header)
    u64 payload_lines;  // lines of one slot
    u64 timeout_ns;
    u64* state;         // this rank's device state: [0] epoch of the last chunk, [1] blocks done,
                        // then TPAR_STATE_EXCHANGE_LINES lines (fused.cuh, norm_exchange_lines)
    u64* error;         // this rank's error word, in host-mapped memory
    u64* inboxes[TPAR_MAX_RANKS];  // every rank's inbox as this rank writes its lines (prims.cuh, send_inbox)
    // The islands kernels: the inbox of this rank that each rank's lines arrive in (for ranks
    // of other islands its pinned host inbox where the islands have no peer access between
    // them, whose `inboxes` entries are then their host inboxes too; else its device inbox).
    u64* recv_inboxes[TPAR_MAX_RANKS];
    u32 rank;
    u32 world_size;
    u32 chunk;
    u32 algo;
    // The call's identity (layout.cuh: call_hash), never 0: every LL line carries it.
    u32 call_hash;
    u32 flags;          // TPAR_FLAG_* below
    // Islands (crate::islands; kernels.rs, IslandTables): the island of each rank, numbered by
    // their lowest rank; each rank's position among its island's members; the ranks island by
    // island (each island's in rank order); where each island's ranks start there; each
    // island's size; and how many islands. The host fills them so that every lookup the
    // islands kernels make per unit is one load (layout.cuh).
    unsigned char island_of[TPAR_MAX_RANKS];
    unsigned char island_position[TPAR_MAX_RANKS];
    unsigned char island_members[TPAR_MAX_RANKS];
    unsigned char island_first[TPAR_MAX_RANKS];
    unsigned char island_sizes[TPAR_MAX_RANKS];
    unsigned char islands;
};

// A kernel's argument block: by value, and __grid_constant__ so that the out-of-line steps
// (prims.cuh, TPAR_COLD) can take it by reference without a per-thread copy on the stack.
#define TPAR_PARAM const __grid_constant__

// The kernels of one algorithm body, one per dtype: NAME_f32, NAME_f16 and NAME_bf16, each
// running BODY<its dtype code> on its argument block (of type ARGS, by value). The host looks
// kernels up by these names (kernels.rs reads this macro to know them), so a .cu file writes
// its body once and instantiates it with one line.
// TPAR_LAUNCH_BOUNDS: tuning.cuh (included after this header, before any kernel is defined).
#define TPAR_KERNELS_PER_DTYPE(NAME, BODY, ARGS)                                                      \
    extern "C" __global__ void TPAR_LAUNCH_BOUNDS NAME##_f32(TPAR_PARAM ARGS args) {            \
        BODY<TPAR_DTYPE_F32>(args);                                                                  \
    }                                                                                                \
    extern "C" __global__ void TPAR_LAUNCH_BOUNDS NAME##_f16(TPAR_PARAM ARGS args) {            \
        BODY<TPAR_DTYPE_F16>(args);                                                                  \
    }                                                                                                \
    extern "C" __global__ void TPAR_LAUNCH_BOUNDS NAME##_bf16(TPAR_PARAM ARGS args) {            \
        BODY<TPAR_DTYPE_BF16>(args);                                                                 \
    }
