// One-shot pull with epoch flags, for platforms where reading a peer's memory beats writing
// to it. Each block copies its share of the input into this rank's own pull buffer (plain
// data, rotated by epoch), fences, and raises its flag to the epoch; then, for every rank in
// order, it waits for that rank's flag of the same block and reads the same share from it.
// The flag is written after the data by the data's owner into its own memory, and read before
// the data by the reader: the acquire/release pair orders them.
#include "tpar_ll.cuh"

template <int DT>
__device__ void oneshot_pull(const TparArgs& a) {
    __shared__ int ok;
    if (threadIdx.x == 0) ok = 1;
    __syncthreads();
    const EpochTicket ticket = begin_epoch(a);
    const u64 epoch = ticket.epoch;
    const u32 tag = tag_for_epoch(epoch);
    const u64 start = now_ns();
    const u64 lines = words_for<DT>(a.count);
    // Block b owns lines [b * per_block, (b + 1) * per_block): the same split on every rank.
    const u64 per_block = (lines + gridDim.x - 1) / gridDim.x;
    const u64 first = (u64)blockIdx.x * per_block;
    const u64 last = min(lines, first + per_block);

    // The header travels as LL lines like in the push algorithms, so mismatches are caught.
    push_header(a, epoch, tag, DT);
    u32* mine = pull_data(a.inboxes[a.rank], a, epoch);
    for (u64 i = first + threadIdx.x; i < last; i += blockDim.x) mine[i] = load_word<DT>(a.input, i, a.count);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        st_release_sys(pull_flag(a.inboxes[a.rank], a, blockIdx.x), epoch);
    }

    if (!check_header(a, epoch, tag, DT, start)) ok = 0;
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
                    ok = 1;
                    const u64* flag = pull_flag(a.inboxes[r], a, blockIdx.x);
                    u32 spins = 0;
                    while ((i64)(ld_acquire_sys(flag) - epoch) < 0) {
                        if ((++spins & 1023u) == 0 && (now_ns() - start > a.timeout_ns || ld_sys(a.error) != 0)) {
                            report_error(a, TPAR_ERR_TIMEOUT, r, TPAR_PHASE_PULL_FLAG, 0, 0);
                            ok = 0;
                            break;
                        }
                    }
                }
                __syncthreads();
                if (!ok) goto done;
                const u32* theirs = pull_data(a.inboxes[r], a, epoch);
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
    end_epoch(a, ticket);
}

TPAR_KERNELS_PER_DTYPE(tpar_oneshot_pull, oneshot_pull, TparArgs)
