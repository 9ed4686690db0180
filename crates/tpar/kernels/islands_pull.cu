// Islands pull (protocol::schedule): the islands schedule with every exchange read instead of
// written. Block b of every rank handles units [b * per_block, (b + 1) * per_block), the same
// split everywhere, and publishes three things behind its flags (publish_flag, one per phase):
//   phase 0: its units of the input (plain data, pull_data);
//   phase 1: the island partial P_I of its units (f32, four floats a unit, pull_partial),
//            summed in rank order from the island members' published inputs;
//   phase 2: the result of its units within this rank's range (pull_finals): every island's
//            partial read from that island's sender for this rank (island_sender), summed in
//            island order, rounded once.
// Then the block reads the results of its other units from the island member whose range
// holds them. Each wait is for a flag that a peer's block with the same index raises in an
// earlier phase, so the phases cannot deadlock; each phase ends with a barrier, so a block's
// outputs are written after all its inputs were read (in place stays safe).
// Lines cross between islands through the inboxes the host resolved per pair (prims.cuh,
// send_inbox and recv_inbox).
#define TPAR_ISLANDS_KERNEL 1
#include "tpar_ll.cuh"

// Reads a unit's two words of `rank`'s published input.
__device__ __forceinline__ void pull_unit(const TparArgs& a, const Call& call, u32 rank, u64 u, u32* w0, u32* w1) {
    const u32* data = pull_data(a.inboxes[rank], a, call.epoch);
    *w0 = ld_sys_u32(data + 2 * u);
    *w1 = ld_sys_u32(data + 2 * u + 1);
}

template <int DT>
__device__ void islands_pull(const TparArgs& a) {
    __shared__ int all_ok;
    const IslandView at = island_view(a);  // from the arguments alone: before begin_call's pdl_wait
    const Call call = begin_call(a, DT);
    const u32 me = a.rank;
    const u64 words = words_for<DT>(a.count);
    const u64 units = (words + 1) / 2;
    const BlockRange block = block_range(units);
    const u64 first = block.first, last = block.last;
    const u64 range_begin = share_start(units, at.size, at.position);
    const u64 range_end = share_start(units, at.size, at.position + 1);
    u32* mine = pull_data(a.inboxes[me], a, call.epoch);
    float* partials = pull_partial(a.inboxes[me], a, call.epoch);
    u32* finals = pull_finals(a.inboxes[me], a, call.epoch);
    // Thread r waits for rank r's flag of `phase` for this block where `wanted(r)`, all at once;
    // true on every thread when every wait succeeded.
    auto wait_flags = [&](u32 phase, u32 wait_phase, auto wanted) {
        bool ok = true;
        if (threadIdx.x < a.world_size && threadIdx.x != me && wanted((u32)threadIdx.x)) {
            ok = wait_flag(a, call, threadIdx.x, phase, blockIdx.x, wait_phase);
        }
        return __syncthreads_and(ok);
    };
    bool ok = true;

    // Phase 0: the input.
    for (u64 u = first + threadIdx.x; u < last; u += blockDim.x) {
        u32 w0, w1;
        load_pair<DT>(a.input, u, a.count, words, &w0, &w1);
        mine[2 * u] = w0;
        mine[2 * u + 1] = w1;
    }
    publish_flag(a, call, 0);
    ok = wait_flags(0, TPAR_PHASE_ISLANDS_INSIDE, [&](u32 r) { return (at.members >> r & 1u) != 0; });
    // Phase 1: the island partial.
    for (u64 u = first + threadIdx.x; u < last && ok; u += blockDim.x) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        bool started = false;
        for (u32 r = 0; r < a.world_size; ++r) {
            if (!(at.members >> r & 1u)) continue;
            u32 w0, w1;
            if (r == me) {
                w0 = mine[2 * u];
                w1 = mine[2 * u + 1];
            } else {
                pull_unit(a, call, r, u, &w0, &w1);
            }
            float x[4];
            Lanes<DT>::unpack(w0, x);
            Lanes<DT>::unpack(w1, x + Lanes<DT>::PER_WORD);
            for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) acc[e] = started ? acc[e] + x[e] : x[e];
            started = true;
        }
        for (int e = 0; e < 4; ++e) partials[4 * u + e] = acc[e];
    }
    // A block whose waits failed publishes nothing more (ok is the same on all its threads):
    // its peers then fail at their deadline instead of reading what it did not compute.
    if (ok) publish_flag(a, call, 1);
    // Phase 2: this rank's range, from every island's sender for this rank.
    if (ok) {
        if (threadIdx.x == 0) {
            all_ok = 1;
            for (u32 j = 0; j < at.islands; ++j) {
                if (j != at.island && !wait_flag(a, call, island_sender(a, j, me), 1, blockIdx.x, TPAR_PHASE_ISLANDS_ACROSS)) {
                    all_ok = 0;
                    break;
                }
            }
        }
        __syncthreads();
        ok = all_ok != 0;
    }
    for (u64 u = max(first, range_begin) + threadIdx.x; u < min(last, range_end) && ok; u += blockDim.x) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (u32 j = 0; j < at.islands; ++j) {
            const float* from = j == at.island ? partials : pull_partial(a.inboxes[island_sender(a, j, me)], a, call.epoch);
            for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) {
                const float t = j == at.island ? from[4 * u + e] : __uint_as_float(ld_sys_u32((const u32*)from + 4 * u + e));
                acc[e] = j == 0 ? t : acc[e] + t;
            }
        }
        const u32 r0 = Lanes<DT>::pack(acc), r1 = Lanes<DT>::pack(acc + Lanes<DT>::PER_WORD);
        finals[2 * u] = r0;
        finals[2 * u + 1] = r1;
        store_pair<DT>(a.output, u, a.count, words, r0, r1);
    }
    if (ok) publish_flag(a, call, 2);
    // The block's other units, from the members whose ranges hold them.
    if (ok) ok = wait_flags(2, TPAR_PHASE_ISLANDS_GATHER, [&](u32 r) { return (at.members >> r & 1u) != 0; });
    for (u64 u = first + threadIdx.x; u < last && ok; u += blockDim.x) {
        if (u >= range_begin && u < range_end) continue;
        const u32 owner = island_member(a, at.island, share_owner(units, at.size, u));
        const u32* from = pull_finals(a.inboxes[owner], a, call.epoch);
        store_pair<DT>(a.output, u, a.count, words, ld_sys_u32(from + 2 * u), ld_sys_u32(from + 2 * u + 1));
    }
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_islands_pull, islands_pull, TparArgs)
