#!/usr/bin/env bash
# Session 27, call 1: the small-block kernel on whole blocks. Binary sw (branch s26-small-whole,
# 69d45ba) with TPAR_FUSED_SMALL_KERNEL_WHOLE_BLOCKS=1 ("on") against it unset ("off", main's
# kernel choice), alternating, twice, at 2, 8 and 4 ranks x 1-8 tokens; then binary swd (branch
# s27-small-default, 5c225ff: the same with the small-block kernel the default) through the
# selftests at 2, 3, 7, 8 ranks and 4 processes; a device-memory row and a bad knob named.
source scripts/gpu-compare.sh
r() { if [ $SECONDS -lt ${PLAN_SECONDS:-480} ]; then run "$@"; else echo "$1 skipped: out of time" >> "$SUMMARY"; fi; }
ON="env TPAR_FUSED_SMALL_KERNEL_WHOLE_BLOCKS=1"
r warm-sw 100 .gpu/tpar-sw bench --fused -n 2 --tokens 1
r warm-swd 100 .gpu/tpar-swd bench --fused -n 2 --tokens 1
for n in 2 8 4; do
  r f$n-off-1 30 .gpu/tpar-sw bench --fused -n $n --tokens 1,2,4,8 --json $R/f$n-off-1.json
  r f$n-on-1 30 $ON .gpu/tpar-sw bench --fused -n $n --tokens 1,2,4,8 --json $R/f$n-on-1.json
done
r st2 60 .gpu/tpar-swd selftest --backend cuda -n 2 --algos one-shot
r st8 60 .gpu/tpar-swd selftest --backend cuda -n 8 --algos one-shot
r st3 60 .gpu/tpar-swd selftest --backend cuda -n 3 --algos one-shot
r st7 60 .gpu/tpar-swd selftest --backend cuda -n 7 --algos one-shot
r st4p 100 .gpu/tpar-swd selftest --backend cuda -n 4 --processes --algos one-shot
for n in 2 8 4; do
  r f$n-off-2 30 .gpu/tpar-sw bench --fused -n $n --tokens 1,2,4,8 --json $R/f$n-off-2.json
  r f$n-on-2 30 $ON .gpu/tpar-sw bench --fused -n $n --tokens 1,2,4,8 --json $R/f$n-on-2.json
done
r f2-noclusters 30 env TPAR_FUSED_CLUSTERS=0 .gpu/tpar-swd bench --fused -n 2 --tokens 1,8 --json $R/f2-noclusters-swd.json
r squeeze 30 env TPAR_PDL_SQUEEZE=2x .gpu/tpar-swd bench --fused -n 2 --tokens 1
grep -h "TPAR_PDL_SQUEEZE" $R/squeeze.txt | head -1 >> "$SUMMARY"
finish
