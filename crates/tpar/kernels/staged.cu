// Staged push (protocol::schedule): one-shot's data in n-1 paced steps. In step s rank r pushes
// its input into its slot of rank r+s's inbox and waits until rank r-s's input has arrived in
// its own before its next push, so each rank has one outbound and one inbound stream at a time
// (PCIe fabrics whose posted writes collapse when one source writes to many root complexes at
// once). After the last step every slot is full and the rank reduces them in rank order, as
// one-shot does, with the same bits.
//
// Primitives: push_unit (to r+s), wait_unit (from r-s), add_term (every rank, in rank order).
// The pacing is per thread: a thread's next push waits for its own units of the previous step.
// The sum waits for nothing (every line it reads was waited for in its step), and up to
// TPAR_RANK_GROUP ranks a thread keeps the lines of its first unit as they arrive and sums them
// from registers: loading them again after the last step cost one more round trip to memory.
#include "tpar_ll.cuh"

template <int DT>
__device__ void staged_push(const TparArgs& a) {
    const InputUnits<DT> in = input_units<DT>(a);
    const Call call = begin_call(a, DT);
    const u32 n = a.world_size;
    const u64 my_slot = slot_payload(a, call.epoch, a.rank);
    const bool hold = n <= TPAR_RANK_GROUP;
    Wide held[TPAR_RANK_GROUP];  // the first unit's line from each rank (held[rank] unused)
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
            if (u == in.tid) {
#pragma unroll
                for (u32 k = 0; k < TPAR_RANK_GROUP; ++k) {
                    if (k == from) held[k] = v;  // unrolled: registers, not a local array
                }
            }
        }
    }
    // Every line has arrived (each step waited for it): the sum loads without waiting, in
    // groups whose loads overlap, from the held lines where it can.
    for (u64 u = in.tid; u < in.units && ok; u += in.stride) {
        u32 own0, own1;
        in.load(a, u, &own0, &own1);
        const bool from_held = hold && u == in.tid;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (u32 g = 0; g < n; g += TPAR_RANK_GROUP) {
            Wide v[TPAR_RANK_GROUP];
#pragma unroll
            for (u32 k = 0; k < TPAR_RANK_GROUP; ++k) {
                const u32 r = g + k;
                if (r >= n || r == a.rank) continue;
                v[k] = from_held ? held[k] : ld_wide(recv_inbox(a, r) + slot_payload(a, call.epoch, r) + 2 * u);
            }
#pragma unroll
            for (u32 k = 0; k < TPAR_RANK_GROUP; ++k) {
                const u32 r = g + k;
                if (r >= n) break;
                const bool own = r == a.rank;
                add_term<DT>(own ? own0 : v[k].w0, own ? own1 : v[k].w1, r == 0, acc);
            }
        }
        in.store(a, u, acc);
    }
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_staged_push, staged_push, TparArgs)
