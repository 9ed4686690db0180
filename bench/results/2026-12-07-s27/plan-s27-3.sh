#!/usr/bin/env bash
# Session 27, call 3 (got no machine; for the next session): branch s27-few-rows, binary s27
# (`bash scripts/gpu-compare.sh --build s27 s27-few-rows`): fused one-shot launches of up to 8
# rows on whole blocks take the small-block kernel (where they wait per peer) through device
# memory.
# "new" is its default; "old" is main's choice before it, through the knobs
# (TPAR_FUSED_SMALL_KERNEL_WHOLE_BLOCKS=0 TPAR_FUSED_CLUSTERS=1: fused_oneshot.cu, clusters
# wherever they fit); "dm" is device memory at every size (TPAR_FUSED_CLUSTERS=0), 16-128
# tokens. Alternating, twice; the selftests with the new default in between.
source scripts/gpu-compare.sh
r() { if [ $SECONDS -lt ${PLAN_SECONDS:-200} ]; then run "$@"; else echo "$1 skipped: out of time" >> "$SUMMARY"; fi; }
OLD="env TPAR_FUSED_SMALL_KERNEL_WHOLE_BLOCKS=0 TPAR_FUSED_CLUSTERS=1"
DM="env TPAR_FUSED_CLUSTERS=0"
B=.gpu/tpar-s27
r warm 100 $B bench --fused -n 2 --tokens 1
round() {
  for n in 2 4 8; do
    r S$n-old-$1 30 $OLD $B bench --fused -n $n --tokens 1,2,4,8 --json $R/S$n-old-$1.json
    r S$n-new-$1 30 $B bench --fused -n $n --tokens 1,2,4,8 --json $R/S$n-new-$1.json
  done
  for n in 2 4; do
    r L$n-new-$1 30 $B bench --fused -n $n --tokens 16,32,64,128 --json $R/L$n-new-$1.json
    r L$n-dm-$1 30 $DM $B bench --fused -n $n --tokens 16,32,64,128 --json $R/L$n-dm-$1.json
  done
}
round 1
r st2 60 $B selftest --backend cuda -n 2 --algos one-shot
r st8 60 $B selftest --backend cuda -n 8 --algos one-shot
r st4p 100 $B selftest --backend cuda -n 4 --processes --algos one-shot
r st3 60 $B selftest --backend cuda -n 3 --algos one-shot
r st7 60 $B selftest --backend cuda -n 7 --algos one-shot
round 2
# Each fused launch's shape, old against new: the rule must show c1 on whole blocks of up to 8
# rows, and clusters where main had them.
fused_launches 'S*.json'
finish
