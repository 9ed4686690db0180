// One-shot pull with epoch flags, for platforms where reading a peer's memory beats writing
// to it. Each block copies its share of the input into this rank's own pull buffer (plain
// data, rotated by epoch) and raises its flag (publish_flag: the epoch and the call hash);
// then it waits for every rank's flag of the same block (a thread per rank, at once:
// wait_flag, which also checks the peer called with the same arguments) and reads the same
// share from each, summing in rank order (pull_reduce).
#include "tpar_ll.cuh"

// Words a thread reduces at once, and ranks whose words it loads at once: every load of a
// group is issued before any is used, so a thread's round trips are one per group of ranks
// instead of one per rank (a remote read each, on separate GPUs).
#define TPAR_PULL_WORDS 4
#define TPAR_PULL_RANKS 8

// This block's lines [first, last) of every rank's published input, summed in rank order
// into the output.
template <int DT>
__device__ __forceinline__ void pull_reduce(const TparArgs& a, const Call& call, u64 first, u64 last) {
    const u32* mine = pull_data(a.inboxes[a.rank], a, call.epoch);
    for (u64 base = first + threadIdx.x; base < last; base += (u64)blockDim.x * TPAR_PULL_WORDS) {
        float acc[TPAR_PULL_WORDS][2];
        for (u32 g = 0; g < a.world_size; g += TPAR_PULL_RANKS) {
            u32 got[TPAR_PULL_WORDS][TPAR_PULL_RANKS];
#pragma unroll
            for (u32 k = 0; k < TPAR_PULL_WORDS; ++k) {
                const u64 i = base + (u64)k * blockDim.x;
#pragma unroll
                for (u32 m = 0; m < TPAR_PULL_RANKS; ++m) {
                    const u32 r = g + m;
                    got[k][m] = 0;
                    if (i < last && r < a.world_size) {
                        got[k][m] = r == a.rank ? mine[i] : ld_sys_u32(pull_data(a.inboxes[r], a, call.epoch) + i);
                    }
                }
            }
#pragma unroll
            for (u32 k = 0; k < TPAR_PULL_WORDS; ++k) {
#pragma unroll
                for (u32 m = 0; m < TPAR_PULL_RANKS; ++m) {
                    const u32 r = g + m;
                    if (r >= a.world_size) break;
                    float v[2];
                    Lanes<DT>::unpack(got[k][m], v);
                    for (int l = 0; l < Lanes<DT>::PER_WORD; ++l) acc[k][l] = (r == 0) ? v[l] : acc[k][l] + v[l];
                }
            }
        }
#pragma unroll
        for (u32 k = 0; k < TPAR_PULL_WORDS; ++k) {
            const u64 i = base + (u64)k * blockDim.x;
            if (i < last) store_word<DT>(a.output, i, a.count, Lanes<DT>::pack(acc[k]));
        }
    }
}

template <int DT>
__device__ void oneshot_pull(const TparArgs& a) {
    const Call call = begin_call(a, DT);
    const BlockRange share = publish_input<DT>(a, call);  // this block's words of the input, published
    const u64 first = share.first, last = share.last;
    // Thread r waits for rank r's flag of this block, all ranks at once; the barrier passes
    // what each acquired on to every thread of the block.
    bool ok = true;
    if (threadIdx.x < a.world_size && threadIdx.x != a.rank) {
        ok = wait_flag(a, call, threadIdx.x, 0, blockIdx.x, TPAR_PHASE_PULL_FLAG);
    }
    if (__syncthreads_and(ok)) pull_reduce<DT>(a, call, first, last);
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_oneshot_pull, oneshot_pull, TparArgs)
