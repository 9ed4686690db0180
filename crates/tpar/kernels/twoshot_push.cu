// Two-shot push with the LL protocol: reduce-scatter (each rank pushes to every owner the
// lines it owns; the owner reduces them in rank order) then all-gather (each owner pushes its
// reduced lines into every rank's gather slot). Each rank moves 2 (n-1)/n of the message
// instead of (n-1) times it, for mid-size messages. A rank's own share never travels: it
// reads its own term from its input.
#include "tpar_ll.cuh"

template <int DT>
__device__ void twoshot_push(const TparArgs& a) {
    const Call call = begin_call(a, DT);
    const u64 lines = words_for<DT>(a.count);
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u32 n = a.world_size;
    const u64* own = a.inboxes[a.rank];
    const u64 my_slot = stage_one_slot(a, call.epoch, a.rank) + TPAR_HEADER_LINES;
    const u64 gather = gather_slot(a, call.epoch);
    const u64 mine_begin = owned_start(lines, n, a.rank);
    const u64 mine_end = owned_start(lines, n, a.rank + 1);

    for (u64 i = tid; i < lines; i += stride) {
        u32 owner = owner_of_line(lines, n, i);
        if (owner != a.rank) st_sys(a.inboxes[owner] + my_slot + i, pack_line(call.tag, load_word<DT>(a.input, i, a.count)));
    }
    if (!check_header(a, call.epoch, call.tag, DT, call.start)) goto done;

    for (u64 i = mine_begin + tid; i < mine_end; i += stride) {
        float acc[2] = {0.f, 0.f};
        // Our own lines never left: the term comes from the input (the thread that writes
        // output line i later waits for this thread's gather line, so in place stays safe).
        if (!reduce_line<DT>(a, call.epoch, call.tag, i, TPAR_PHASE_REDUCE_SCATTER, call.start, load_word<DT>(a.input, i, a.count), acc)) goto done;
        u64 line = pack_line(call.tag, Lanes<DT>::pack(acc));
        for (u32 p = 0; p < n; ++p) st_sys(a.inboxes[p] + gather + i, line);
    }

    for (u64 i = tid; i < lines; i += stride) {
        u32 w;
        if (!wait_line(a, own + gather + i, call.tag, owner_of_line(lines, n, i), TPAR_PHASE_ALL_GATHER, call.start, &w)) goto done;
        store_word<DT>(a.output, i, a.count, w);
    }
done:
    end_call(a, call);
}

TPAR_KERNELS_PER_DTYPE(tpar_twoshot_push, twoshot_push, TparArgs)
