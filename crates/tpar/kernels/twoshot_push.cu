// Two-shot push with the LL protocol: reduce-scatter (each rank pushes to every owner the
// units it owns; the owner reduces them in rank order) then all-gather (each owner pushes its
// reduced units into every rank's gather slot). Each rank moves 2 (n-1)/n of the message
// instead of (n-1) times it, for mid-size messages. A rank's own share never travels: it
// reads its own term from its input.
//
// Primitives: push_unit (to the unit's owner), reduce_unit (the owner, every rank in rank
// order), push_unit_to (the owner's result to everyone), gather_unit (every rank).
#include "tpar_ll.cuh"

template <int DT>
__device__ void twoshot_push(const TparArgs& a) {
    const Call call = begin_call(a, DT);
    const u64 words = words_for<DT>(a.count);
    const u64 units = (words + 1) / 2;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u32 n = a.world_size;
    const u32 everyone = all_ranks(a);
    const u64 my_slot = slot_payload(a, call.epoch, a.rank);
    const u64 gather = gather_slot(a, call.epoch);
    const u64 mine_begin = share_start(units, n, a.rank);
    const u64 mine_end = share_start(units, n, a.rank + 1);

    for (u64 u = tid; u < units; u += stride) {
        const u32 owner = share_owner(units, n, u);
        if (owner == a.rank) continue;
        u32 w0, w1;
        load_pair<DT>(a.input, u, a.count, words, &w0, &w1);
        push_unit(a, call, owner, my_slot + 2 * u, w0, w1);
    }
    for (u64 u = mine_begin + tid; u < mine_end; u += stride) {
        // Our own units never left: the term comes from the input (the thread that writes
        // output unit u later waits for this thread's gather line, so in place stays safe).
        u32 own0, own1;
        load_pair<DT>(a.input, u, a.count, words, &own0, &own1);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (!reduce_unit<DT>(a, call, everyone, u, own0, own1, TPAR_PHASE_REDUCE_SCATTER, acc)) goto done;
        const u32 r0 = Lanes<DT>::pack(acc), r1 = Lanes<DT>::pack(acc + Lanes<DT>::PER_WORD);
        push_unit_to(a, call, everyone, gather + 2 * u, r0, r1);
        store_pair<DT>(a.output, u, a.count, words, r0, r1);
    }
    for (u64 u = tid; u < units; u += stride) {
        const u32 owner = share_owner(units, n, u);
        if (owner == a.rank) continue;
        u32 w0, w1;
        if (!gather_unit(a, call, owner, u, TPAR_PHASE_ALL_GATHER, &w0, &w1)) goto done;
        store_pair<DT>(a.output, u, a.count, words, w0, w1);
    }
done:
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_twoshot_push, twoshot_push, TparArgs)
