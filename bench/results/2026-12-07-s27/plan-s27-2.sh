#!/usr/bin/env bash
# Session 27, call 2: binary swd (branch s27-small-default, 5c225ff: the small-block kernel on
# whole blocks by default) at 16-512 tokens, its default ("small") against
# TPAR_FUSED_SMALL_KERNEL_WHOLE_BLOCKS=0 ("whole", main's kernel choice), and at 1-8 tokens its
# cluster forms against TPAR_FUSED_CLUSTERS=0 ("dm"), alternating, twice, at 2, 4 and 8 ranks.
source scripts/gpu-compare.sh
r() { if [ $SECONDS -lt ${PLAN_SECONDS:-300} ]; then run "$@"; else echo "$1 skipped: out of time" >> "$SUMMARY"; fi; }
WHOLE="env TPAR_FUSED_SMALL_KERNEL_WHOLE_BLOCKS=0"
DM="env TPAR_FUSED_CLUSTERS=0"
r warm 100 .gpu/tpar-swd bench --fused -n 2 --tokens 1
for i in 1 2; do
  for n in 2 4 8; do
    r L$n-small-$i 60 .gpu/tpar-swd bench --fused -n $n --tokens 16,32,64,128,256,512 --json $R/L$n-small-$i.json
    r L$n-whole-$i 60 $WHOLE .gpu/tpar-swd bench --fused -n $n --tokens 16,32,64,128,256,512 --json $R/L$n-whole-$i.json
    r S$n-small-$i 30 .gpu/tpar-swd bench --fused -n $n --tokens 1,2,4,8 --json $R/S$n-small-$i.json
    r S$n-dm-$i 30 $DM .gpu/tpar-swd bench --fused -n $n --tokens 1,2,4,8 --json $R/S$n-dm-$i.json
  done
done
finish
