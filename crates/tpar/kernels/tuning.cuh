// tuning.cuh: the kernels' compile-time knobs, each with the measurement that set its default.
// Every one can be overridden for an experiment (TPAR_KERNEL_DEFINES="-DNAME=VALUE ...", part
// of the kernel cache key); none changes the protocol, only how fast waits poll and how the
// slow paths are compiled.
#pragma once

// The longest pause between two polls of a line in host memory, in ns (0: spin without
// pausing). On one H200 pauses of up to 512 ns changed nothing for host-staged.
#ifndef TPAR_POLL_SLEEP_MAX_NS
#define TPAR_POLL_SLEEP_MAX_NS 512
#endif
// The same for polls of device memory (every other algorithm). Across GPUs, readers spinning
// without pause on lines that peers write over NVLink put one-shot into a state of 200-400 us
// per call (4 x H200, one process per GPU, 42 and 64 KiB: 214 and 418 us without pauses,
// 6.6 and 7.0 us with up to 256 ns, 6.8 and 7.2 us with up to 2048 ns, where two-shot slowed
// from 7.4 to 12 us); bench/README.md has the run.
#ifndef TPAR_DEVICE_POLL_SLEEP_MAX_NS
#define TPAR_DEVICE_POLL_SLEEP_MAX_NS 256
#endif
// Polls of device memory made without any pause before the pauses above begin: a line that
// arrives within about a microsecond (the common case once the ranks run in step) is seen at
// once instead of up to one pause late; a wait longer than that falls back to the pauses, which
// is what kept the multi-GPU state above away.
#ifndef TPAR_DEVICE_FREE_POLLS
#define TPAR_DEVICE_FREE_POLLS 64
#endif
// Polls of host memory made without pause (host-staged) before the pauses begin.
#ifndef TPAR_HOST_FREE_POLLS
#define TPAR_HOST_FREE_POLLS 0
#endif
// How the slow paths (waits, error reports, header checks) are compiled: inlined (1, the
// default) or as calls (0; each call takes the argument block by reference, which puts a copy
// of it on the stack). One H200, 2 ranks as streams, bf16, 2026-12-01 (bench/README.md,
// "Anatomy of one call"): as calls, 0 B took 2.45 us against 2.17 inlined, but 4 KiB 2.72
// against 2.86, 32 KiB 2.77 against 3.20 and 256 KiB 3.98 against 4.09. The 8-rank figures
// were measured inlined only; which to default to per world size is open.
#ifndef TPAR_SLOW_PATH_INLINE
#define TPAR_SLOW_PATH_INLINE 1
#endif
#if TPAR_SLOW_PATH_INLINE
#define TPAR_SLOW_PATH __forceinline__
#else
#define TPAR_SLOW_PATH __noinline__
#endif
// How the steps a wait takes only once it has missed for hundreds of polls are compiled
// (the deadline check, the header push and comparison, giving up): inlined into every wait (1,
// the default) or out of line (0). They run at most once per 256 polls, but a call inside a
// wait loop makes the compiler keep the loop's live values on the stack around it: one H200,
// 2026-12-02 (bench/README.md, "Eighth session"), out of line took two-shot at 2 ranks and 4 KiB
// from 3.09 to 3.61 us and one-shot at 8 ranks from 3.91 to 6.38; islands.cu sets 0 (it ran out
// of registers with them inlined: 13.5 -> 9.1 us at 8 ranks 4+4, 4 KiB; see islands.cu for how
// the two compare since the host resolves each pair's inboxes). A kernel file
// may set this or the knob below before it includes tpar_ll.cuh; -D (TPAR_KERNEL_DEFINES)
// overrides both.
#ifndef TPAR_COLD_INLINE
#define TPAR_COLD_INLINE 1
#endif
#if TPAR_COLD_INLINE
#define TPAR_COLD __forceinline__
#else
#define TPAR_COLD __noinline__
#endif
// Whether reduce_unit waits for the lines that missed at one wait site per group of peers (1)
// or at one site per peer (0: TPAR_RANK_GROUP inlined copies of the wait). Same run: one site
// per group took the fused one-shot at 2 ranks x 1 token from 5.99 to 4.14 us and at 8 ranks x
// 8 tokens from 25.98 to 14.44 (the fused kernels set 1), but the plain one-shot at 2 ranks
// and 4 KiB from 2.16 to 2.48 and two-shot from 3.09 to 3.40 (0 stays the default).
// The fused kernels (fused_oneshot.cu, twoshot_fused.cu) define TPAR_FUSED_KERNEL 1 before
// the headers and so take 1. Since then the fused one-shot at 2 to 4 ranks measured faster
// with one site per peer (one H100, 2026-12-06: 2 ranks x 1 token 4.40 -> 3.99 us, 4 ranks
// 5.19 -> 4.72; 8 ranks mixed): it is also compiled that way (reduce_unit's SITE_PER_GROUP
// argument), and the host launches that kernel up to 4 ranks (fused.rs, FUSED_PEER_SITE_RANKS).
#ifndef TPAR_FUSED_KERNEL
#define TPAR_FUSED_KERNEL 0
#endif
#ifndef TPAR_WAIT_SITE_PER_GROUP
#define TPAR_WAIT_SITE_PER_GROUP TPAR_FUSED_KERNEL
#endif
// Whether the header check polls its four words together also in device memory (it always
// does in host memory, where waiting for each word in turn costs a PCIe round trip apiece).
// Same run as above: 1 took 0 B to 1.89 us from 2.17, and changed 4 KiB to 256 KiB by at most
// 0.07 us either way (2 ranks; 8 ranks not measured with it).
#ifndef TPAR_HEADER_BATCH_POLL
#define TPAR_HEADER_BATCH_POLL 0
#endif
// Host-staged: how long a thread waits after its pushes before its first poll, in picoseconds
// per byte this rank pushed (0: poll at once). A poll of host memory is a PCIe read whose
// request travels the same direction as the rank's own pushes, so polls made before the peers'
// lines can have arrived only slow the pushes down; at 20 ps a byte (about 50 GB/s, a Gen5 x16
// link) the first poll comes about when the pushes are done. One H200, 2 ranks, 2026-12-02
// (bench/results/2026-12-02-h200-s6-primitives, call 2 without it, call 3 with it; both with
// the header off the critical path): 4 KiB 3.88 -> 3.69 us, 32 KiB 8.88 -> 7.50, 42 KiB about
// 10.4 -> 8.89, 256 KiB 41.5 -> 42.7.
#ifndef TPAR_HOST_POLL_DELAY_PS_PER_BYTE
#define TPAR_HOST_POLL_DELAY_PS_PER_BYTE 20
#endif
// Peers whose lines a thread loads at once before checking any (wide one-shot): 8 covers the
// common world sizes in one round trip within 64 registers.
#ifndef TPAR_RANK_GROUP
#define TPAR_RANK_GROUP 8
#endif
// The blocks per SM every kernel but the probes is compiled for: __launch_bounds__(TPAR_THREADS)
// alone (0) or with this as its second argument (1, the default). With the first alone, ptxas
// (NVRTC 13, sm_90) compiles some kernels for 64 registers, two blocks an SM, and spills:
// ring f32 220 bytes of spill stores, islands-pull 140-152, staged-pull 36-40; with 1 none
// spills (ring f32 100 registers, islands-pull 101-102, staged-pull 87-89; the anatomy's last
// rung, 64 registers and 516 bytes of spill stores, 97 and none), the separate norm kernel
// takes 11 more (86, 74 for f32) and the others stay within 2
// (bench/results/2026-12-02-vm-kernel-registers.txt, every kernel both ways;
// scripts/kernel_resources.py prints it). One H200, 8 ranks as streams, 2026-12-02
// (bench/results/2026-12-02-h200-s10-spread, call 1, both ways twice in one call): ring f32
// 90.1 -> 72.6 us at 1 MiB and 359.4 -> 293.2 at 4 MiB, islands-pull 19.4-20.9 -> 19.0-19.9 at
// 4-32 KiB, staged-pull 16.5-16.7 -> 16.3 at 42 KiB, the anatomy's last rung 3.19 -> 2.46;
// every other kernel within 0.1 us (2 and 8 ranks, 0 B to 256 KiB). The kernels that already
// took more than 64 registers keep one block an SM either way, so the co-resident grid the
// host computes does not change.
#ifndef TPAR_LAUNCH_MIN_BLOCKS
#define TPAR_LAUNCH_MIN_BLOCKS 1
#endif
#if TPAR_LAUNCH_MIN_BLOCKS
#define TPAR_LAUNCH_BOUNDS __launch_bounds__(TPAR_THREADS, TPAR_LAUNCH_MIN_BLOCKS)
#else
#define TPAR_LAUNCH_BOUNDS __launch_bounds__(TPAR_THREADS)
#endif
