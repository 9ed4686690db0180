// One-shot push with the LL protocol: every rank stores its input, tagged, into its slot of
// every peer's inbox (posted writes), then polls only its own inbox until every slot carries
// this epoch's tag, and reduces in rank order, taking its own term straight from its input
// (the same thread read it for the push, so in-place calls stay safe). With the inboxes in
// pinned host memory mapped into every GPU this is also the host-staged algorithm.
//
// Lines are 16 bytes wide (two words, each beside the tag) when the slots are 16-byte aligned
// (payload_lines even), else 8 bytes. The call header travels beside the data but is checked
// only after the reduction, or while a wait is slow: the data is its own signal (bench/README.md,
// "anatomy of one call", has what each piece costs).
#include "tpar_ll.cuh"

template <int DT>
__device__ __forceinline__ bool oneshot_wide(const TparArgs& a, u64 epoch, u32 tag, u64 start, u32 first0,
                                             u32 first1) {
    const u64 words = words_for<DT>(a.count);
    const u64 pairs = (words + 1) / 2;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 my_slot = stage_one_slot(a, epoch, a.rank) + TPAR_HEADER_LINES;
    for (u64 q = tid; q < pairs; q += stride) {
        u32 w0 = first0, w1 = first1;
        if (q != tid) load_pair<DT>(a.input, q, a.count, words, &w0, &w1);
        for (u32 p = 0; p < a.world_size; ++p) {
            if (p != a.rank) st_wide(a.inboxes[p] + my_slot + 2 * q, tag, w0, w1);
        }
    }
    const u64* inbox = a.inboxes[a.rank];
    // Block 0's thread `peer` checks that peer's call header against ours (off the critical
    // path: see header loads below); with no payload line of its own it checks it at once.
    const bool checks_header = blockIdx.x == 0 && threadIdx.x < a.world_size && threadIdx.x != a.rank;
    if (checks_header && tid >= pairs) return check_header(a, epoch, tag, DT, start);
    u64 header[4];
    for (u64 q = tid; q < pairs; q += stride) {
        u32 own0, own1;
        if (q == tid) {
            own0 = first0;  // loaded before the call counter: see oneshot_push
            own1 = first1;
        } else {
            load_pair<DT>(a.input, q, a.count, words, &own0, &own1);
        }
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        // Peers in groups of TPAR_RANK_GROUP: every line of a group is loaded before any is
        // checked, so their latencies overlap; the groups bound the registers.
        // The header words are loaded with the first line's data, and again with every poll
        // of it: when the data is seen, the header (pushed before it) has been read with it,
        // and the check after the store costs no round trip of its own.
        u64* const header_polls = (q == tid && checks_header) ? header : nullptr;
        for (u32 g = 0; g < a.world_size; g += TPAR_RANK_GROUP) {
            Wide v[TPAR_RANK_GROUP];
            if (g == 0 && header_polls) load_header_words(a, epoch, threadIdx.x, header);
            load_wide_group(a, inbox, epoch, g, TPAR_HEADER_LINES + 2 * q, v);
#pragma unroll
            for (u32 k = 0; k < TPAR_RANK_GROUP; ++k) {
                const u32 r = g + k;
                if (r >= a.world_size) break;
                u32 w0 = own0, w1 = own1;
                if (r != a.rank) {
                    if (!wide_has(v[k], tag)) {
                        Wide got;  // the slow path, out of line
                        if (!wait_wide(a, inbox + stage_one_slot(a, epoch, r) + TPAR_HEADER_LINES + 2 * q, tag, r,
                                       TPAR_PHASE_ONE_SHOT, start, epoch, DT, &got, header_polls)) {
                            return false;
                        }
                        v[k] = got;
                    }
                    w0 = v[k].w0;
                    w1 = v[k].w1;
                }
                float x[4];
                Lanes<DT>::unpack(w0, x);
                Lanes<DT>::unpack(w1, x + Lanes<DT>::PER_WORD);
                for (int e = 0; e < 2 * Lanes<DT>::PER_WORD; ++e) acc[e] = (r == 0) ? x[e] : acc[e] + x[e];
            }
        }
        store_pair<DT>(a.output, q, a.count, words, Lanes<DT>::pack(acc), Lanes<DT>::pack(acc + Lanes<DT>::PER_WORD));
    }
    if (checks_header) {
        for (int i = 2; i <= 5; ++i) {
            if ((u32)(header[i - 2] >> 32) != tag) return check_header(a, epoch, tag, DT, start);  // not yet
            if ((u32)header[i - 2] != header_word(a, i, DT)) {
                report_error(a, TPAR_ERR_MISMATCH, threadIdx.x, TPAR_PHASE_HEADER, i, (u32)header[i - 2]);
                return false;
            }
        }
    }
    return true;
}

template <int DT>
__device__ __forceinline__ bool oneshot_narrow(const TparArgs& a, u64 epoch, u32 tag, u64 start) {
    const u64 lines = words_for<DT>(a.count);
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 my_slot = stage_one_slot(a, epoch, a.rank) + TPAR_HEADER_LINES;
    for (u64 i = tid; i < lines; i += stride) {
        u64 line = pack_line(tag, load_word<DT>(a.input, i, a.count));
        for (u32 p = 0; p < a.world_size; ++p) {
            if (p != a.rank) st_sys(a.inboxes[p] + my_slot + i, line);
        }
    }
    if (!check_header(a, epoch, tag, DT, start)) return false;
    for (u64 i = tid; i < lines; i += stride) {
        float acc[2] = {0.f, 0.f};
        if (!reduce_line<DT>(a, epoch, tag, i, TPAR_PHASE_ONE_SHOT, start, load_word<DT>(a.input, i, a.count), acc)) return false;
        store_word<DT>(a.output, i, a.count, Lanes<DT>::pack(acc));
    }
    return true;
}

template <int DT>
__device__ void oneshot_push(const TparArgs& a) {
    // The thread's first input pair is loaded before the call counter, so the two loads'
    // latencies overlap (the input may be the previous kernel's output: after pdl_wait).
    pdl_wait();
    const bool wide = a.payload_lines % 2 == 0;
    u32 first0 = 0, first1 = 0;
    {
        const u64 words = words_for<DT>(a.count);
        const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
        if (wide && tid < (words + 1) / 2) load_pair<DT>(a.input, tid, a.count, words, &first0, &first1);
    }
    const Call call = begin_call(a, DT);
    if (wide) {
        oneshot_wide<DT>(a, call.epoch, call.tag, call.start, first0, first1);
    } else {
        oneshot_narrow<DT>(a, call.epoch, call.tag, call.start);
    }
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_oneshot_push, oneshot_push, TparArgs)
