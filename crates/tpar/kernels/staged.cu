// Staged push (protocol::schedule): one-shot's data in n-1 paced steps. In step s rank r pushes
// its input into its slot of rank r+s's inbox and waits until rank r-s's input has arrived in
// its own before its next push, so each rank has one outbound and one inbound stream at a time
// (PCIe fabrics whose posted writes collapse when one source writes to many root complexes at
// once). After the last step every slot is full and the rank reduces them in rank order, as
// one-shot does, with the same bits.
//
// Primitives: push_unit (to r+s), wait_unit (from r-s), reduce_unit (every rank). The pacing
// is per thread: a thread's next push waits for its own units of the previous step.
#include "tpar_ll.cuh"

template <int DT>
__device__ void staged_push(const TparArgs& a) {
    const u64 words = words_for<DT>(a.count);
    const u64 units = (words + 1) / 2;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    pdl_wait();
    u32 first0 = 0, first1 = 0;
    if (tid < units) load_pair<DT>(a.input, tid, a.count, words, &first0, &first1);
    const Call call = begin_call(a, DT);
    const u32 n = a.world_size;
    const u64 my_slot = slot_payload(a, call.epoch, a.rank);
    bool ok = true;
    for (u32 s = 1; s < n && ok; ++s) {
        const u32 to = (a.rank + s) % n, from = (a.rank + n - s) % n;
        for (u64 u = tid; u < units; u += stride) {
            u32 w0 = first0, w1 = first1;
            if (u != tid) load_pair<DT>(a.input, u, a.count, words, &w0, &w1);
            push_unit(a, call, to, my_slot + 2 * u, w0, w1);
        }
        const u64* slot = recv_inbox(a, from) + slot_payload(a, call.epoch, from);
        for (u64 u = tid; u < units && ok; u += stride) {
            Wide v = ld_wide(slot + 2 * u);
            if (!wide_has(v, call.tag, call.id)) ok = wait_unit(a, call, slot + 2 * u, from, TPAR_PHASE_STAGED, &v);
        }
    }
    for (u64 u = tid; u < units && ok; u += stride) {
        u32 own0 = first0, own1 = first1;
        if (u != tid) load_pair<DT>(a.input, u, a.count, words, &own0, &own1);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (!reduce_unit<DT>(a, call, all_ranks(a), u, own0, own1, TPAR_PHASE_STAGED, acc)) break;
        store_pair<DT>(a.output, u, a.count, words, Lanes<DT>::pack(acc), Lanes<DT>::pack(acc + Lanes<DT>::PER_WORD));
    }
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_staged_push, staged_push, TparArgs)
