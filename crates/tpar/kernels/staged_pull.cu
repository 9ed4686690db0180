// Staged pull (protocol::schedule): the staged schedule read instead of written, for fabrics
// where posted writes collapse and reads hold. Each block publishes its share of the input
// (plain data behind a flag, as one-shot pull does); then in step s every thread reads its
// word of rank r-s's share, after the block has seen that rank's flag, and keeps it in shared
// memory until every rank's word is there; then it sums them in rank order. A thread's read of
// step s+1 is issued after its word of step s has arrived (the store to shared memory waits for
// it), so each rank reads one peer at a time.
#include "tpar_ll.cuh"

template <int DT>
__device__ void staged_pull(const TparArgs& a) {
    __shared__ u32 terms[TPAR_MAX_RANKS][TPAR_THREADS];
    __shared__ int flags_ok;
    const Call call = begin_call(a, DT);
    const u32 n = a.world_size;
    const BlockRange share = publish_input<DT>(a, call);  // this block's words of the input, published
    const u64 first = share.first, last = share.last;
    const u32* mine = pull_data(a.inboxes[a.rank], a, call.epoch);
    bool ok = true;
    for (u64 base = first; base < last && ok; base += blockDim.x) {
        const u64 i = base + threadIdx.x;
        for (u32 s = 1; s < n; ++s) {
            const u32 from = (a.rank + n - s) % n;
            if (base == first) {
                // The first pass waits for each peer's flag in its step (one thread; the
                // barrier hands the acquired data on to the block).
                if (threadIdx.x == 0) flags_ok = wait_flag(a, call, from, 0, blockIdx.x, TPAR_PHASE_STAGED);
                __syncthreads();
                ok = flags_ok;
                __syncthreads();
                if (!ok) break;
            }
            if (i < last) terms[from][threadIdx.x] = ld_sys_u32(pull_data(a.inboxes[from], a, call.epoch) + i);
        }
        if (!ok || i >= last) continue;
        terms[a.rank][threadIdx.x] = mine[i];
        float acc[2] = {0.f, 0.f};
        for (u32 r = 0; r < n; ++r) {
            float v[2];
            Lanes<DT>::unpack(terms[r][threadIdx.x], v);
            for (int l = 0; l < Lanes<DT>::PER_WORD; ++l) acc[l] = (r == 0) ? v[l] : acc[l] + v[l];
        }
        store_word<DT>(a.output, i, a.count, Lanes<DT>::pack(acc));
    }
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_staged_pull, staged_pull, TparArgs)
