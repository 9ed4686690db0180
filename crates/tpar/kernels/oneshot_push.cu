// One-shot push with the LL protocol: every rank stores its input, tagged, into its slot of
// every peer's inbox (posted writes), then polls only its own inbox until every slot carries
// this call's lines, and reduces in rank order, taking its own term straight from its input
// (the same thread read it for the push, so in-place calls stay safe). With the inboxes in
// pinned host memory mapped into every GPU this is also the host-staged algorithm.
//
// A call is two primitives per unit: push_unit_to (every peer) and reduce_unit (every rank, in
// rank order). The data is its own signal and carries the call's identity (layout.cuh): no
// header is waited for (bench/README.md, "anatomy of one call", has what each piece costs).
#include "tpar_ll.cuh"

template <int DT>
__device__ void oneshot_push(const TparArgs& a) {
    const InputUnits<DT> in = input_units<DT>(a);  // the first unit's load overlaps the call counter's
    const Call call = begin_call(a, DT);
    const u32 everyone = all_ranks(a);
    const u64 my_slot = slot_payload(a, call.epoch, a.rank);
    for (u64 u = in.tid; u < in.units; u += in.stride) {
        u32 w0, w1;
        in.load(a, u, &w0, &w1);
        push_unit_to(a, call, everyone, my_slot + 2 * u, w0, w1);
    }
    if (TPAR_HOST_POLL_DELAY_PS_PER_BYTE > 0 && a.algo == TPAR_ALGO_HOST_STAGED) {
        const u64 pushed = (u64)(a.world_size - 1) * in.units * 16;  // LL bytes this rank wrote
        __nanosleep((u32)min(pushed * TPAR_HOST_POLL_DELAY_PS_PER_BYTE / 1000, (u64)100000));
    }
    for (u64 u = in.tid; u < in.units; u += in.stride) {
        u32 own0, own1;
        in.load(a, u, &own0, &own1);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (!reduce_unit<DT>(a, call, everyone, u, own0, own1, TPAR_PHASE_ONE_SHOT, acc)) break;
        in.store(a, u, acc);
    }
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_oneshot_push, oneshot_push, TparArgs)
