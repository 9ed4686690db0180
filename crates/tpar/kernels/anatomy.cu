// The anatomy of one allreduce call, for `tpar bench --anatomy`: a ladder of kernels built from
// the same primitives as the allreduce kernels (prims.cuh), each adding one step of the one-shot
// call to the one before, so that timing each in a graph chain shows what each step costs.
// The top of the ladder is the production one-shot kernel itself (oneshot_push.cu), which the
// harness times beside these. Not loaded by communicators.
//   0 empty (griddepcontrol only)
//   1 + read and publish the call counter (begin_epoch, end_epoch)
//   2 + push the call header to every peer (begin_call; nobody waits for it)
//   3 + one unit pushed to every peer and one reduced from every peer (push_unit_to,
//       reduce_unit): the round trip every call pays, with the data its own signal
// Each is timed with and without programmatic dependent launch: the kernels are the same.
#include "tpar_ll.cuh"

template <int RUNG>
__device__ void anatomy(const TparArgs& a) {
    if (RUNG == 0) {
        pdl_wait();
        pdl_launch_dependents();
        return;
    }
    if (RUNG == 1) {
        const EpochTicket ticket = begin_epoch(a);
        end_epoch(a, ticket);
        return;
    }
    const Call call = begin_call(a, TPAR_DTYPE_BF16);
    if (RUNG >= 3 && blockIdx.x == 0 && threadIdx.x == 0) {
        push_unit_to(a, call, all_ranks(a), slot_payload(a, call.epoch, a.rank), a.rank, a.rank);
        float acc[4];
        if (reduce_unit<TPAR_DTYPE_BF16>(a, call, all_ranks(a), 0, a.rank, a.rank, TPAR_PHASE_ONE_SHOT, acc)) {
            *(volatile u32*)a.output = Lanes<TPAR_DTYPE_BF16>::pack(acc);
        }
    }
    end_call(a, call);
}

extern "C" __global__ void TPAR_LAUNCH_BOUNDS tpar_anatomy_0(TPAR_PARAM TparArgs args) { anatomy<0>(args); }
extern "C" __global__ void TPAR_LAUNCH_BOUNDS tpar_anatomy_1(TPAR_PARAM TparArgs args) { anatomy<1>(args); }
extern "C" __global__ void TPAR_LAUNCH_BOUNDS tpar_anatomy_2(TPAR_PARAM TparArgs args) { anatomy<2>(args); }
extern "C" __global__ void TPAR_LAUNCH_BOUNDS tpar_anatomy_3(TPAR_PARAM TparArgs args) { anatomy<3>(args); }
