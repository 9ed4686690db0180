// Islands (protocol::schedule): hierarchical over islands of ranks (a PCIe switch, a root
// complex, a socket). Per unit, with I this rank's island:
//   1. inside: push the input to every member of I (push_unit_to), then sum I's members in
//      rank order into the island partial P_I (reduce_unit; f32, not rounded);
//   2. across, in one of two forms (the host chooses, TPAR_FLAG_ISLANDS_ALL_UNITS):
//      ranges: island J splits the units among its members (share by position); for each
//        member q of another island J whose range holds the unit and whose sender in I is
//        this rank (island_sender), push P_I of the unit to q as f32 (push_partial);
//      all units: push P_I of every unit to each member q of every other island J whose
//        sender in I is this rank: every rank receives every island's partial of every unit,
//        so there is no third step, at |J| times the traffic between islands (small calls);
//      through pinned host memory where islands have no peer access (send_inbox);
//   3. ranges: for the units of this rank's own range, wait for every other island's partial
//      (wait_partial), sum the islands in island order, round once, push the result to every
//      member of I (push_unit_to, gather slot) and store it; for the other units, wait for
//      the member of I whose range holds it (gather_unit) and store its result.
//      All units: each rank sums every unit itself, and pushes nothing.
// Steps 1 (the reduce) to 3 are one pass over the thread's units: for each unit, the reduce,
// the partial's push, then the unit's result (a wait for partials or for the gather). Both
// forms add the same f32 island partials in the same order: the same bits. With one island
// this is one-shot, in one-shot's order. A thread handles the same units in every loop, in the
// same order on every rank (so in-place calls stay safe: it reads a unit's input before it
// writes its output). No wait can close a circle: every rank pushes every unit's input (loop
// 1) before it waits for anything, and in the pass pushes a unit's partial before it waits
// for that unit's partials or gather, and a gather is pushed once its owner's partials of the
// unit have come, each pushed by a sender before that sender waits for anything of the unit.
// Partials from island J land in stage-one slot `sender` of the receiver, at the unit's index
// within the receiver's range (all units: at the unit's index; the host keeps a launch's
// partials within a slot).
// Lines cross between islands through the inboxes the host resolved per pair (prims.cuh,
// send_inbox and recv_inbox).
// Every lookup of the partition (an island's size, its member at a position, a rank's
// position) is one load from the host's tables in the arguments (abi.cuh), and this rank's
// view of it is taken before pdl_wait. Counting them over the ranks at each lookup, on the
// path between a unit's waits, cost 1.5 us a call: one H100, 8 ranks 4+4 as streams, bf16,
// 2026-12-06 (bench/results/2026-12-06-s13, call 3): 4 / 8 / 16 / 64 KiB 5.59 / 5.60 / 5.79 /
// 8.24 us counted, 4.11 / 4.22 / 4.65 / 7.55 with the tables, 3.95 / 4.00 / 4.40 / 7.52 with
// the view taken early as well (one-shot 3.61 / 3.99 / 4.26 / 8.75).
#define TPAR_ISLANDS_KERNEL 1
// The cold steps of its waits are inlined, as in every other kernel (tuning.cuh,
// TPAR_COLD_INLINE). They were out of line here while the islands were tested per line, which
// ran out of registers with them inlined (bench/README.md, "Eighth session"), and after that
// for the smallest calls (ninth session, one H200: inlined 4+4 at 4 KiB 6.42 -> 6.53 us, 64 KiB
// 7.99 -> 7.77). Since small launches spread over smaller blocks, inlined is faster at every
// size measured: one H100, 8 ranks 4+4 as streams, bf16, 2026-12-06 (bench/results/
// 2026-12-06-s12, call 3): 4 / 8 / 16 / 64 KiB 5.60-5.65 / 5.66 / 5.86 / 8.41-8.42 us
// out of line against 5.53 / 5.55-5.59 / 5.76-5.77 / 8.23-8.25 inlined; 4 ranks 2+2 at 4 / 16 /
// 64 KiB 4.23-4.24 / 4.23 / 5.13 against 4.17 / 4.15 / 5.08-5.09.
#include "tpar_ll.cuh"

template <int DT>
__device__ void islands_push(const TparArgs& a) {
    const bool all_units = a.flags & TPAR_FLAG_ISLANDS_ALL_UNITS;
    const IslandView at = island_view(a);  // from the arguments alone: before pdl_wait, overlapped
    const InputUnits<DT> in = input_units<DT>(a);
    const Call call = begin_call(a, DT | (all_units ? TPAR_HEADER_ISLANDS_ALL : 0));
    const u32 me = a.rank;
    const u64 range_begin = all_units ? 0 : share_start(in.units, at.size, at.position);
    const u64 range_end = all_units ? in.units : share_start(in.units, at.size, at.position + 1);
    const u64 my_slot = slot_payload(a, call.epoch, me);

    // 1. Inside the island: the input to every member.
    for (u64 u = in.tid; u < in.units; u += in.stride) {
        u32 w0, w1;
        in.load(a, u, &w0, &w1);
        push_unit_to(a, call, at.members, my_slot + 2 * u, w0, w1);
    }
    // 1-3, one pass over the units: the island partial, to every member of another island
    // this rank sends it to, then the unit's result.
    bool ok = true;
    for (u64 u = in.tid; u < in.units && ok; u += in.stride) {
        u32 w0, w1;
        in.load(a, u, &w0, &w1);
        float partial[4] = {0.f, 0.f, 0.f, 0.f};
        ok = reduce_unit<DT>(a, call, at.members, u, w0, w1, TPAR_PHASE_ISLANDS_INSIDE, partial);
        if (!ok) break;
        if (at.islands == 1) {
            in.store(a, u, partial);
            continue;
        }
        for (u32 j = 0; j < at.islands; ++j) {
            if (j == at.island) continue;
            const u32 j_size = island_size(a, j);
            if (all_units) {
                // Every member of J whose sender in I is this rank: positions position,
                // position + size, ... of J.
                for (u32 k = at.position; k < j_size; k += at.size) push_partial<DT>(a, call, island_member(a, j, k), my_slot, u, partial);
                continue;
            }
            const u32 q_position = share_owner(in.units, j_size, u);
            if (q_position % at.size != at.position) continue;
            const u32 q = island_member(a, j, q_position);
            push_partial<DT>(a, call, q, my_slot, u - share_start(in.units, j_size, q_position), partial);
        }
        // 2-3 in the same pass: the units this rank sums (all units, or its range) from every
        // island's partial of the unit, in island order (each sender pushed it in this same
        // pass, right after its island's reduce); the others from the member of this island
        // whose range holds them, which sums them in its own pass.
        const bool sums = all_units || (u >= range_begin && u < range_end);
        if (!sums) {
            const u32 owner = island_member(a, at.island, share_owner(in.units, at.size, u));
            u32 g0, g1;
            if (!(ok = gather_unit(a, call, owner, u, TPAR_PHASE_ISLANDS_GATHER, &g0, &g1))) break;
            store_pair<DT>(a.output, u, a.count, in.words, g0, g1);
            continue;
        }
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (u32 j = 0; j < at.islands && ok; ++j) {
            float term[4] = {0.f, 0.f, 0.f, 0.f};
            if (j == at.island) {
                for (int e = 0; e < 4; ++e) term[e] = partial[e];
            } else {
                const u32 sender = island_sender(a, j, me);
                ok = wait_partial<DT>(a, call, sender, slot_payload(a, call.epoch, sender), u - range_begin,
                                      TPAR_PHASE_ISLANDS_ACROSS, term);
            }
            for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) acc[e] = j == 0 ? term[e] : acc[e] + term[e];
        }
        if (!ok) break;
        const u32 r0 = Lanes<DT>::pack(acc), r1 = Lanes<DT>::pack(acc + Lanes<DT>::PER_WORD);
        if (!all_units) push_unit_to(a, call, at.members, gather_slot(a, call.epoch) + 2 * u, r0, r1);
        store_pair<DT>(a.output, u, a.count, in.words, r0, r1);
    }
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_islands_push, islands_push, TparArgs)
