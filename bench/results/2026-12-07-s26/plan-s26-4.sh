#!/usr/bin/env bash
# For the next GPU call (not run in session 26: its device time ran out): branch s26-small-whole
# (main 0ab295b + the knob); build it as `bash scripts/gpu-compare.sh --build sw s26-small-whole`. It times the small-block kernel
# on whole blocks (TPAR_FUSED_SMALL_KERNEL_WHOLE_BLOCKS=1, "on") against the whole-block kernel
# ("off"), one binary, alternating; then the selftests with it on; a bad knob value named.
source scripts/gpu-compare.sh
r() { if [ $SECONDS -lt ${PLAN_SECONDS:-400} ]; then run "$@"; else echo "$1 skipped: out of time" >> "$SUMMARY"; fi; }
ON="env TPAR_FUSED_SMALL_KERNEL_WHOLE_BLOCKS=1"
r warm 100 .gpu/tpar-sw bench --fused -n 2 --tokens 1
for n in 2 8 4; do
  r f$n-off-1 30 .gpu/tpar-sw bench --fused -n $n --tokens 1,2,4,8 --json $R/f$n-off-1.json
  r f$n-on-1 30 $ON .gpu/tpar-sw bench --fused -n $n --tokens 1,2,4,8 --json $R/f$n-on-1.json
done
r st2on 40 $ON TPAR_PDL_SQUEEZE=2x .gpu/tpar-sw selftest --backend cuda -n 2 --algos one-shot
r st8on 60 $ON .gpu/tpar-sw selftest --backend cuda -n 8 --algos one-shot
for n in 2 8 4; do
  r f$n-off-2 30 .gpu/tpar-sw bench --fused -n $n --tokens 1,2,4,8 --json $R/f$n-off-2.json
  r f$n-on-2 30 $ON .gpu/tpar-sw bench --fused -n $n --tokens 1,2,4,8 --json $R/f$n-on-2.json
done
r f2-noclusters 30 env TPAR_FUSED_CLUSTERS=0 .gpu/tpar-sw bench --fused -n 2 --tokens 1,8 --json $R/f2-noclusters.json
grep -h "TPAR_PDL_SQUEEZE" $R/st2on.txt | head -1 >> "$SUMMARY"
finish
