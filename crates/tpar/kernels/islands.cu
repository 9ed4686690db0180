// Islands (protocol::schedule): hierarchical over islands of ranks (a PCIe switch, a root
// complex, a socket). Per unit, with I this rank's island:
//   1. inside: push the input to every member of I (push_unit_to), then sum I's members in
//      rank order into the island partial P_I (reduce_unit; f32, not rounded);
//   2. across: island J splits the units among its members (share by position); for each
//      member q of another island J whose range holds the unit and whose sender in I is this
//      rank (island_sender), push P_I of the unit to q as f32 (push_partial), through
//      `cross_inboxes` (pinned host memory where islands have no peer access between them);
//   3. for the units of this rank's own range: wait for every other island's partial
//      (wait_partial), sum the islands in island order, round once, push the result to every
//      member of I (push_unit_to, gather slot) and store it; for the other units, wait for the
//      member of I whose range holds it (gather_unit) and store its result.
// With one island this is one-shot, in one-shot's order. A thread handles the same units in
// every loop (so in-place calls stay safe: it reads a unit's input before it writes its
// output), and every wait is for a line that a peer's thread of the same units pushes in an
// earlier loop, so the loops cannot deadlock. Partials from island J land in stage-one slot
// `sender` of the receiver, at the unit's index within the receiver's range (the host keeps a
// launch's ranges within a slot).
// Lines cross between islands through `cross_inboxes` (prims.cuh, inbox_of).
#define TPAR_ISLANDS_KERNEL 1
// The slow paths stay inlined here (tuning.cuh's default), though that makes this the slowest
// file to compile (NVRTC, sm_90, 2 cores: 38 s inlined, 2.4 s as calls; the files compile side
// by side, so a GPU's first use waits about as long as this one). As calls, islands 4+4 at 8
// ranks on one H200 took 11.2 / 16.2 / 18.6 / 25.5 us at 4 / 32 / 42 / 64 KiB (2026-12-02,
// 13d51f6 and bf2bfd0, bench/results/2026-12-02-h200-s7-gpu-suite), against 13.2 / 15.0 / 15.3 /
// 16.3 inlined in an earlier call (cccdc7f): waits that miss are common in this kernel.
#include "tpar_ll.cuh"

template <int DT>
__device__ void islands_push(const TparArgs& a) {
    const u64 words = words_for<DT>(a.count);
    const u64 units = (words + 1) / 2;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    pdl_wait();
    u32 first0 = 0, first1 = 0;
    if (tid < units) load_pair<DT>(a.input, tid, a.count, words, &first0, &first1);
    const Call call = begin_call(a, DT);
    const u32 me = a.rank;
    const u32 island = island_of(a, me);
    const u32 islands = island_count(a);
    const u32 members = island_mask(a, me);
    const u32 size = island_size(a, island);
    const u32 position = island_position(a, me);
    const u64 range_begin = share_start(units, size, position);
    const u64 range_end = share_start(units, size, position + 1);
    const u64 my_slot = slot_payload(a, call.epoch, me);
    auto own_unit = [&](u64 u, u32* w0, u32* w1) {
        *w0 = first0;
        *w1 = first1;
        if (u != tid) load_pair<DT>(a.input, u, a.count, words, w0, w1);
    };

    // 1. Inside the island: the input to every member.
    for (u64 u = tid; u < units; u += stride) {
        u32 w0, w1;
        own_unit(u, &w0, &w1);
        push_unit_to(a, call, members, my_slot + 2 * u, w0, w1);
    }
    // 1-2. The island partial, and to every member of another island this rank sends it to.
    bool ok = true;
    for (u64 u = tid; u < units && ok; u += stride) {
        u32 w0, w1;
        own_unit(u, &w0, &w1);
        float partial[4] = {0.f, 0.f, 0.f, 0.f};
        ok = reduce_unit<DT>(a, call, members, u, w0, w1, TPAR_PHASE_ISLANDS_INSIDE, partial);
        if (!ok) break;
        for (u32 j = 0; j < islands; ++j) {
            if (j == island) continue;
            const u32 j_size = island_size(a, j);
            const u32 q_position = share_owner(units, j_size, u);
            if (island_member(a, island, q_position % size) != me) continue;
            const u32 q = island_member(a, j, q_position);
            push_partial<DT>(a, call, q, my_slot, u - share_start(units, j_size, q_position), partial);
        }
    }
    // 3. This rank's range: every island's partial, summed in island order, to every member.
    for (u64 u = tid; u < units && ok; u += stride) {
        if (u < range_begin || u >= range_end) continue;
        u32 w0, w1;
        own_unit(u, &w0, &w1);
        float mine[4] = {0.f, 0.f, 0.f, 0.f}, acc[4] = {0.f, 0.f, 0.f, 0.f};
        ok = reduce_unit<DT>(a, call, members, u, w0, w1, TPAR_PHASE_ISLANDS_INSIDE, mine);
        for (u32 j = 0; j < islands && ok; ++j) {
            float term[4] = {0.f, 0.f, 0.f, 0.f};
            if (j == island) {
                for (int e = 0; e < 4; ++e) term[e] = mine[e];
            } else {
                const u32 sender = island_sender(a, j, me);
                const u64 base = slot_payload(a, call.epoch, sender);
                ok = wait_partial<DT>(a, call, sender, base, u - range_begin, TPAR_PHASE_ISLANDS_ACROSS, term);
            }
            for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) acc[e] = j == 0 ? term[e] : acc[e] + term[e];
        }
        if (!ok) break;
        const u32 r0 = Lanes<DT>::pack(acc), r1 = Lanes<DT>::pack(acc + Lanes<DT>::PER_WORD);
        push_unit_to(a, call, members, gather_slot(a, call.epoch) + 2 * u, r0, r1);
        store_pair<DT>(a.output, u, a.count, words, r0, r1);
    }
    // 3. The other units: from the member of this island whose range holds them.
    for (u64 u = tid; u < units && ok; u += stride) {
        if (u >= range_begin && u < range_end) continue;
        const u32 owner = island_member(a, island, share_owner(units, size, u));
        u32 w0, w1;
        if (!gather_unit(a, call, owner, u, TPAR_PHASE_ISLANDS_GATHER, &w0, &w1)) break;
        store_pair<DT>(a.output, u, a.count, words, w0, w1);
    }
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_islands_push, islands_push, TparArgs)
