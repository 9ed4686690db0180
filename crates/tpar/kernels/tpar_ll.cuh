// tpar_ll.cuh: the one header every tpar kernel includes. It pulls in the shared headers, one
// concern each, in dependency order:
//   abi.cuh       the argument block, codes, limits and error word the host mirrors
//   tuning.cuh    compile-time knobs of the waits (overridable with TPAR_KERNEL_DEFINES)
//   memorder.cuh  loads and stores with their memory order, the clock, PDL ordering
//   layout.cuh    the LL line, tags by epoch, the inbox layout and the call header's words
//   dtype.cuh     payload words <-> elements, in f32
//   prims.cuh     the steps every algorithm is a sequence of (epoch, push, wait, reduce, check)
//   fused.cuh     the fused allreduce + residual add + RMSNorm epilogue (fused_*.cu)
#pragma once

#include "abi.cuh"
#include "tuning.cuh"
#include "memorder.cuh"
#include "layout.cuh"
#include "dtype.cuh"
#include "prims.cuh"
#include "fused.cuh"
