// memorder.cuh: every access whose memory order matters, spelled out in PTX so that the order
// is the one written here and not whatever the compiler infers: loads and stores at system
// scope (peers over NVLink/PCIe and the host see them), the 16-byte volatile accesses that wide
// LL lines are made of, the global clock the deadlines read, and the ordering against the
// previous kernel on the stream (programmatic dependent launch).
#pragma once

#include "abi.cuh"

__device__ __forceinline__ u64 ld_sys(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 ld_sys_u32(const u32* p) {
    u32 v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_sys(u64* p, u64 v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

// One 16-byte store or load. Only each aligned 8-byte half is single-copy atomic, which is
// all the wide LL line (layout.cuh) relies on.
__device__ __forceinline__ void st_volatile_v4(u64* p, u32 x, u32 y, u32 z, u32 w) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(x), "r"(y), "r"(z), "r"(w)
                 : "memory");
}
__device__ __forceinline__ void ld_volatile_v4(const u64* p, u32* x, u32* y, u32* z, u32* w) {
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(*x), "=r"(*y), "=r"(*z), "=r"(*w)
                 : "l"(p)
                 : "memory");
}

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Programmatic dependent launch (sm_90+). A kernel launched with programmatic stream
// serialization may start while the kernel before it on the stream still runs; it must not
// read anything that kernel wrote (the input, the state word) before `pdl_wait`, which returns
// once the previous grid has completed and its memory is visible. Launched without the
// attribute both are no-ops. `pdl_launch_dependents` lets the next kernel's launch begin now:
// its blocks then sit in `pdl_wait`, so the host halves the co-resident grid when it uses PDL.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Thread block clusters (sm_90+): the blocks of one cluster run at once on one GPC and may store
// into each other's shared memory (distributed shared memory). `cluster_store_f32` stores `v` at
// the address of `local` (a __shared__ variable of this block) in the cluster's block `rank`;
// `cluster_sync` is the cluster-wide barrier, with release/acquire order: every store any block
// of the cluster made before it is visible to every block after it. Only kernels the host
// launches with a cluster dimension may call them (fused.rs, the cluster exchange); below sm_90
// they do not exist, and the host never launches such a kernel there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define TPAR_HAS_CLUSTERS 1
__device__ __forceinline__ void cluster_store_f32(const float* local, u32 rank, float v) {
    const u32 own = (u32)__cvta_generic_to_shared(local);
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(own), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
}
__device__ __forceinline__ void cluster_arrive_release() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
    cluster_arrive_release();
    cluster_wait_acquire();
}
// An 8-byte line stored whole at the address of `local` in the cluster's block `rank`, for a
// reader polling it in its own shared memory (ld_shared_volatile).
__device__ __forceinline__ void cluster_store_u64(const u64* local, u32 rank, u64 v) {
    const u32 own = (u32)__cvta_generic_to_shared(local);
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(own), "r"(rank));
    asm volatile("st.relaxed.cluster.shared::cluster.u64 [%0], %1;" ::"r"(remote), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_shared_volatile(const u64* local) {
    u64 v;
    asm volatile("ld.volatile.shared.u64 %0, [%1];" : "=l"(v) : "r"((u32)__cvta_generic_to_shared(local)) : "memory");
    return v;
}
#else
#define TPAR_HAS_CLUSTERS 0
#endif
// The first step of a kernel's cluster form (`CLUSTER`): a trap where the GPU has no clusters,
// where the host never launches it.
template <bool CLUSTER>
__device__ __forceinline__ void trap_without_clusters() {
#if !TPAR_HAS_CLUSTERS
    if (CLUSTER) __trap();
#endif
}
// The barrier of the thread block cluster where `cluster` (a kernel launched as clusters),
// else the block's.
__device__ __forceinline__ void block_or_cluster_sync(bool cluster) {
#if TPAR_HAS_CLUSTERS
    if (cluster) {
        cluster_sync();
        return;
    }
#endif
    __syncthreads();
}
