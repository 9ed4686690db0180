#!/usr/bin/env bash
# Session 27, call 4 (plan-s27-3.sh shortened to the device time left; got no machine): branch
# s27-few-rows, binary s27 (`bash scripts/gpu-compare.sh --build s27 s27-few-rows`), its
# default ("new") against main's choice before it through the knobs
# ("old": TPAR_FUSED_SMALL_KERNEL_WHOLE_BLOCKS=0 TPAR_FUSED_CLUSTERS=1) once at 1-8 tokens, then
# its selftests at 2, 8 ranks, 4 processes, 3 and 7 ranks.
source scripts/gpu-compare.sh
r() { if [ $SECONDS -lt ${PLAN_SECONDS:-150} ]; then run "$@"; else echo "$1 skipped: out of time" >> "$SUMMARY"; fi; }
OLD="env TPAR_FUSED_SMALL_KERNEL_WHOLE_BLOCKS=0 TPAR_FUSED_CLUSTERS=1"
B=.gpu/tpar-s27
r warm 70 $B bench --fused -n 2 --tokens 1
for n in 2 4 8; do
  r S$n-old 20 $OLD $B bench --fused -n $n --tokens 1,2,4,8 --json $R/S$n-old.json
  r S$n-new 20 $B bench --fused -n $n --tokens 1,2,4,8 --json $R/S$n-new.json
done
r st2 30 $B selftest --backend cuda -n 2 --algos one-shot
r st8 40 $B selftest --backend cuda -n 8 --algos one-shot
r st4p 60 $B selftest --backend cuda -n 4 --processes --algos one-shot
r st3 25 $B selftest --backend cuda -n 3 --algos one-shot
r st7 35 $B selftest --backend cuda -n 7 --algos one-shot
# Each fused launch's shape, old against new: the rule must show c1 on whole blocks of up to 8
# rows, and clusters where main had them.
fused_launches 'S*.json'
finish
