// Ring (protocol::schedule): reduce-scatter then all-gather around the ring of ranks, n-1
// steps each, in LL lines; each rank talks to its two neighbours only, for larger messages on
// PCIe fabrics where one-shot's and two-shot's fan-out collapses. Chunk c is share(units, n, c).
//   Reduce-scatter, step s = 0..n-2: rank r sends its f32 partial of chunk (r - s - 1) to r+1
//   (at s = 0 its own input of that chunk; after, the partial received from r-1 in step s-1
//   plus its own input), into stage-one slot s of r+1's inbox. So chunk c is summed in the
//   order x_{c+1}, x_{c+2}, ..., x_c and finished at rank c, which rounds it once.
//   All-gather, send step t = 0..n-2: rank r sends the rounded chunk (r - t) to r+1 (its own
//   at t = 0, after that the one received from r-1), into stage-one slot gather_slot_of(t) of
//   r+1's inbox, at gather_line(t, j) for unit j, as lines of the gather identity (below).
// A thread handles the same units of every chunk (unit j of each), so each wait is for the
// line the neighbour's same thread pushed one step earlier, and in-place calls stay safe (the
// input is read in the reduce-scatter, before the all-gather writes the output).
//
// Every step's chunk has a slot of its own, so a launch carries n chunks of a slot's f32
// partials (launch_units): n times what it carried when the all-gather went through the one
// gather slot. Each launch costs 2(n-1) hops whatever it carries, so fewer launches is what
// makes the ring faster at large sizes (one H200, 8 ranks as streams, f32: 1 MiB was four
// launches, 71 us, against two-shot's 45; bench/README.md, "Twelfth session").
// Why the all-gather may reuse the reduce-scatter's slots: rank r's send step t >= 1 writes
// unit j of chunk c = r - t into slot t-1 of r+1. Rank r+1 = c + t + 1 took that chunk in its
// reduce-scatter step t: it read unit j's partial from slot t-1, added its input and pushed
// the sum on; the chunk went on to c, which finished it, and came back around as send steps
// 0, 1, ..., t-1 to r. Every push in that chain carries what its rank read before it, so r+1
// read slot t-1's line of unit j before r can write it again, provided the line sits where
// unit j's partial sat (for 16-bit data a partial takes two lines: a unit at line j would
// overwrite the partial of unit j/2, which another thread may not have read yet). Send step 0
// takes slot n-1, which the reduce-scatter leaves free, a line a unit as the one gather slot
// had: at 2 ranks that is the whole all-gather (at the partial positions it was 1% slower
// there: one H200, bf16, 512 KiB to 4 MiB). A line of the gather identity
// (id ^ TPAR_RING_GATHER_ID) is never taken for a partial of the same slot, nor a partial for it.
// Why LL lines and not plain data behind a flag (half the bytes): each block then waits for
// its whole step, meets at a barrier and releases at system scope, about 3.5 us a step at 8
// ranks, where LL's lines pipeline per thread (one H100, 2026-12-08, branch s30-ring-bulk: 64
// KiB 12.1 -> 49.7 us, 1 MiB 77.0 -> 70.9, 2 ranks 1 MiB 19.1 -> 27.8; bench/README.md,
// "Thirtieth session").
#include "tpar_ll.cuh"

#define TPAR_RING_GATHER_ID 0x9e3779b9u

// The stage-one slot that all-gather send step t writes into, and unit j's line there (see above).
__device__ __forceinline__ u32 gather_slot_of(u32 t, u32 n) { return t == 0 ? n - 1 : t - 1; }
template <int DT> __device__ __forceinline__ u64 gather_line(u32 t, u64 j) {
    return (t == 0 ? 2 : 2 * Partial<DT>::LINES) * j;
}

template <int DT>
__device__ void ring(const TparArgs& a) {
    const Call call = begin_call(a, DT);
    const u32 n = a.world_size, me = a.rank;
    const u32 next = (me + 1) % n, prev = (me + n - 1) % n;
    const u64 words = words_for<DT>(a.count);
    const u64 units = (words + 1) / 2;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    Call gathered = call;  // the all-gather's lines carry their own identity
    gathered.id = call.id ^ TPAR_RING_GATHER_ID;
    bool ok = true;
    // Reduce-scatter.
    for (u32 s = 0; s < n && ok; ++s) {
        // Step s sends chunk c; the last pass (s = n-1) finishes this rank's own chunk.
        const u32 c = s < n - 1 ? ring_reduce_chunk(me, n, s) : me;
        const u64 c_start = share_start(units, n, c), c_units = share_start(units, n, c + 1) - c_start;
        for (u64 j = tid; j < c_units && ok; j += stride) {
            u32 w0, w1;
            load_pair<DT>(a.input, c_start + j, a.count, words, &w0, &w1);
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
            float x[4] = {0.f, 0.f, 0.f, 0.f};
            Lanes<DT>::unpack(w0, x);
            Lanes<DT>::unpack(w1, x + Lanes<DT>::PER_WORD);
            if (s == 0) {
                for (int e = 0; e < 4; ++e) acc[e] = x[e];
            } else {
                ok = wait_partial<DT>(a, call, prev, slot_payload(a, call.epoch, s - 1), j, TPAR_PHASE_RING_REDUCE, acc);
                if (!ok) break;
                for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) acc[e] = acc[e] + x[e];
            }
            if (s < n - 1) {
                push_partial<DT>(a, call, next, slot_payload(a, call.epoch, s), j, acc);
            } else {
                const u32 r0 = Lanes<DT>::pack(acc), r1 = Lanes<DT>::pack(acc + Lanes<DT>::PER_WORD);
                store_pair<DT>(a.output, c_start + j, a.count, words, r0, r1);
                push_unit(a, gathered, next, slot_payload(a, call.epoch, gather_slot_of(0, n)) + gather_line<DT>(0, j), r0,
                          r1);
            }
        }
    }
    // All-gather: step s = 1..n-1 receives chunk (r - s) from r-1 (its send step s-1) and, but
    // for the last, passes it on as send step s (send step 0, this rank's own chunk, is the
    // reduce-scatter's last pass).
    for (u32 s = 1; s < n && ok; ++s) {
        const u32 c = ring_gather_chunk(me, n, s);
        const u64 c_start = share_start(units, n, c), c_units = share_start(units, n, c + 1) - c_start;
        const u64* in = recv_inbox(a, prev) + slot_payload(a, call.epoch, gather_slot_of(s - 1, n));
        const u64 out = slot_payload(a, call.epoch, gather_slot_of(s, n));
        for (u64 j = tid; j < c_units; j += stride) {
            const u64* p = in + gather_line<DT>(s - 1, j);
            Wide v = ld_wide(p);
            if (!wide_has(v, gathered.tag, gathered.id) &&
                !(ok = wait_unit(a, gathered, p, prev, TPAR_PHASE_RING_GATHER, &v))) {
                break;
            }
            store_pair<DT>(a.output, c_start + j, a.count, words, v.w0, v.w1);
            if (s < n - 1) push_unit(a, gathered, next, out + gather_line<DT>(s, j), v.w0, v.w1);
        }
    }
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_ring, ring, TparArgs)
