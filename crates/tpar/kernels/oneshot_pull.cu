// One-shot pull with epoch flags, for platforms where reading a peer's memory beats writing
// to it. Each block copies its share of the input into this rank's own pull buffer (plain
// data, rotated by epoch), fences, and raises its flag to the epoch; then, for every rank in
// order, it waits for that rank's flag of the same block and reads the same share from it.
// The flag is written after the data by the data's owner into its own memory, and read before
// the data by the reader: the acquire/release pair orders them. The call header travels as LL
// lines as in the push algorithms (begin_call), so mismatches are caught.
#include "tpar_ll.cuh"

template <int DT>
__device__ void oneshot_pull(const TparArgs& a) {
    __shared__ int ok;
    if (threadIdx.x == 0) ok = 1;
    __syncthreads();
    const Call call = begin_call(a, DT);
    const u64 lines = words_for<DT>(a.count);
    // Block b owns lines [b * per_block, (b + 1) * per_block): the same split on every rank.
    const u64 per_block = (lines + gridDim.x - 1) / gridDim.x;
    const u64 first = (u64)blockIdx.x * per_block;
    const u64 last = min(lines, first + per_block);

    u32* mine = pull_data(a.inboxes[a.rank], a, call.epoch);
    for (u64 i = first + threadIdx.x; i < last; i += blockDim.x) mine[i] = load_word<DT>(a.input, i, a.count);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        st_release_sys(pull_flag(a.inboxes[a.rank], a, blockIdx.x), call.epoch);
    }

    if (!check_header(a, call.epoch, call.tag, DT, call.start)) ok = 0;
    __syncthreads();
    {
        const int header_ok = ok;
        __syncthreads();  // everyone has read `ok` before thread 0 reuses it below
        if (!header_ok) goto done;
    }
    {
        float acc[2 * 8];  // up to 8 words per thread held across ranks
        const u64 words_here = last > first ? last - first : 0;
        for (u64 base = 0; base < words_here; base += (u64)blockDim.x * 8) {
            for (u32 r = 0; r < a.world_size; ++r) {
                if (threadIdx.x == 0) {
                    ok = wait_flag(a, pull_flag(a.inboxes[r], a, blockIdx.x), call.epoch, r, TPAR_PHASE_PULL_FLAG, call.start);
                }
                __syncthreads();
                if (!ok) goto done;
                const u32* theirs = pull_data(a.inboxes[r], a, call.epoch);
                for (int k = 0; k < 8; ++k) {
                    u64 i = first + base + (u64)k * blockDim.x + threadIdx.x;
                    if (i >= last) break;
                    float v[2];
                    Lanes<DT>::unpack(ld_sys_u32(theirs + i), v);
                    for (int l = 0; l < Lanes<DT>::PER_WORD; ++l) acc[2 * k + l] = (r == 0) ? v[l] : acc[2 * k + l] + v[l];
                }
                __syncthreads();
            }
            for (int k = 0; k < 8; ++k) {
                u64 i = first + base + (u64)k * blockDim.x + threadIdx.x;
                if (i >= last) break;
                store_word<DT>(a.output, i, a.count, Lanes<DT>::pack(&acc[2 * k]));
            }
        }
    }
done:
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_oneshot_pull, oneshot_pull, TparArgs)
