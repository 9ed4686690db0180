// Staged push (protocol::schedule): one-shot's data in n-1 paced steps. In step s rank r pushes
// its input into its slot of rank r+s's inbox and waits until rank r-s's input has arrived in
// its own before its next push, so each rank has one outbound and one inbound stream at a time
// (PCIe fabrics whose posted writes collapse when one source writes to many root complexes at
// once). After the last step every slot is full and the rank reduces them in rank order, as
// one-shot does, with the same bits.
//
// Primitives: push_unit (to r+s), wait_unit (from r-s), reduce_unit (every rank). The pacing
// is per thread: a thread's next push waits for its own units of the previous step.
//
// The cold steps of its waits are out of line (tuning.cuh, TPAR_COLD_INLINE), for the 8 ranks
// staged is for (ranks as streams, bf16; bench/results/2026-12-06-s14 call 1 and -s15 calls 1
// and 2, twice each way in s15): one H100, 4 / 32 KiB 9.18-9.22 / 12.26-12.29 -> 8.83-8.87 /
// 11.58-11.59 us in three runs; one H200, 4 / 16 / 32 / 64 KiB 8.88 / 10.32 / 11.68 / 15.03 ->
// 8.53 / 9.93 / 11.20 / 15.25. It costs 2 and 4 ranks on the H200 0.1 us at 4-16 KiB (2 ranks
// 2.39 -> 2.51 at 4 KiB, 4 ranks 4.29 -> 4.45; 4 ranks 32 / 64 KiB 5.13 / 5.97 -> 5.05 / 5.72).
#define TPAR_COLD_INLINE 0
#include "tpar_ll.cuh"

template <int DT>
__device__ void staged_push(const TparArgs& a) {
    const InputUnits<DT> in = input_units<DT>(a);
    const Call call = begin_call(a, DT);
    const u32 n = a.world_size;
    const u64 my_slot = slot_payload(a, call.epoch, a.rank);
    bool ok = true;
    for (u32 s = 1; s < n && ok; ++s) {
        const u32 to = (a.rank + s) % n, from = (a.rank + n - s) % n;
        for (u64 u = in.tid; u < in.units; u += in.stride) {
            u32 w0, w1;
            in.load(a, u, &w0, &w1);
            push_unit(a, call, to, my_slot + 2 * u, w0, w1);
        }
        const u64* slot = recv_inbox(a, from) + slot_payload(a, call.epoch, from);
        for (u64 u = in.tid; u < in.units && ok; u += in.stride) {
            Wide v = ld_wide(slot + 2 * u);
            if (!wide_has(v, call.tag, call.id)) ok = wait_unit(a, call, slot + 2 * u, from, TPAR_PHASE_STAGED, &v);
        }
    }
    for (u64 u = in.tid; u < in.units && ok; u += in.stride) {
        u32 own0, own1;
        in.load(a, u, &own0, &own1);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (!reduce_unit<DT>(a, call, all_ranks(a), u, own0, own1, TPAR_PHASE_STAGED, acc)) break;
        in.store(a, u, acc);
    }
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_staged_push, staged_push, TparArgs)
