// The init probe's kernels: bandwidth of peer writes (push: local source, peer destination) and
// peer reads (pull: peer source, local destination) through P2P, one link or all at once, and
// the one-way latency of a flag between two GPUs. Not used by any allreduce.
#include "tpar_ll.cuh"

struct __align__(16) TparVec16 { u64 lo, hi; };

// Up to TPAR_MAX_RANKS copies at once: block b copies part of copy (b % copies).
struct TparProbeArgs {
    u64 src[TPAR_MAX_RANKS];
    u64 dst[TPAR_MAX_RANKS];
    u64 vectors;       // 16-byte vectors per copy
    u64 flag_out;      // ping-pong: the peer's flag, written through P2P
    u64 flag_in;       // ping-pong: this GPU's flag, polled
    u64 rounds;
    u64 timeout_ns;
    u64 result;        // ping-pong: elapsed ns for `rounds` round trips, or ~0 on timeout
    u32 copies;
    u32 role;          // ping-pong: 0 starts each round, 1 answers
};

extern "C" __global__ void __launch_bounds__(TPAR_THREADS) tpar_probe_copy(TparProbeArgs a) {
    const u32 copy = blockIdx.x % a.copies;
    const u64 blocks = gridDim.x / a.copies;
    const TparVec16* src = (const TparVec16*)a.src[copy];
    TparVec16* dst = (TparVec16*)a.dst[copy];
    for (u64 i = (blockIdx.x / a.copies) * blockDim.x + threadIdx.x; i < a.vectors; i += blocks * blockDim.x) {
        dst[i] = src[i];
    }
}

extern "C" __global__ void __launch_bounds__(TPAR_THREADS) tpar_probe_pingpong(TparProbeArgs a) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    u64* out = (u64*)a.flag_out;
    const u64* in = (const u64*)a.flag_in;
    const u64 start = now_ns();
    for (u64 i = 1; i <= a.rounds; ++i) {
        if (a.role == 0) st_sys(out, i);
        while (ld_sys(in) < i) {
            if (now_ns() - start > a.timeout_ns) {
                *(volatile u64*)a.result = ~0ull;
                return;
            }
        }
        if (a.role == 1) st_sys(out, i);
    }
    *(volatile u64*)a.result = now_ns() - start;
}
