// Ring (protocol::schedule): reduce-scatter then all-gather around the ring of ranks, n-1
// steps each, in LL lines; each rank talks to its two neighbours only, for larger messages on
// PCIe fabrics where one-shot's and two-shot's fan-out collapses. Chunk c is share(units, n, c).
//   Reduce-scatter, step s = 0..n-2: rank r sends its f32 partial of chunk (r - s - 1) to r+1
//   (at s = 0 its own input of that chunk; after, the partial received from r-1 in step s-1
//   plus its own input), into stage-one slot s of r+1's inbox. So chunk c is summed in the
//   order x_{c+1}, x_{c+2}, ..., x_c and finished at rank c, which rounds it once.
//   All-gather, step s = 0..n-2: rank r sends the rounded chunk (r - s) to r+1 (its own at
//   s = 0, after that the one received from r-1), into the gather slot at the chunk's units.
// A thread handles the same units of every chunk (unit j of each), so each wait is for the
// line the neighbour's same thread pushed one step earlier, and in-place calls stay safe (the
// input is read in the reduce-scatter, before the all-gather writes the output).
#include "tpar_ll.cuh"

template <int DT>
__device__ void ring(const TparArgs& a) {
    const Call call = begin_call(a, DT);
    const u32 n = a.world_size, me = a.rank;
    const u32 next = (me + 1) % n, prev = (me + n - 1) % n;
    const u64 words = words_for<DT>(a.count);
    const u64 units = (words + 1) / 2;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 gather = gather_slot(a, call.epoch);
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
                push_unit(a, call, next, gather + 2 * (c_start + j), r0, r1);
            }
        }
    }
    // All-gather: step s = 1..n-1 receives chunk (r - s) from r-1 and, but for the last,
    // passes it on (step 0's send, this rank's own chunk, is the reduce-scatter's last pass).
    for (u32 s = 1; s < n && ok; ++s) {
        const u32 c = ring_gather_chunk(me, n, s);
        const u64 c_start = share_start(units, n, c), c_units = share_start(units, n, c + 1) - c_start;
        for (u64 j = tid; j < c_units; j += stride) {
            u32 w0, w1;
            if (!(ok = gather_unit(a, call, prev, c_start + j, TPAR_PHASE_RING_GATHER, &w0, &w1))) break;
            store_pair<DT>(a.output, c_start + j, a.count, words, w0, w1);
            if (s < n - 1) push_unit(a, call, next, gather + 2 * (c_start + j), w0, w1);
        }
    }
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_ring, ring, TparArgs)
