#!/usr/bin/env bash
# Session 25, call 1 (minimal, for a short device budget): b (the fused fold in every thread,
# the power-of-two mean, the small cluster form's LL lines in shared memory) against main
# a521592 (base), alternating, then b's selftests at 2 and 8 ranks.
source scripts/gpu-compare.sh
r() { if [ $SECONDS -lt ${PLAN_SECONDS:-400} ]; then run "$@"; else echo "$1 skipped: out of time" >> "$SUMMARY"; fi; }
r warm-b 100 .gpu/tpar-b bench --fused -n 2 --tokens 1
r warm-base 100 .gpu/tpar-base bench --fused -n 2 --tokens 1
for i in 1 2; do
  for b in base b; do
    r f2$b-$i 60 .gpu/tpar-$b bench --fused -n 2 --tokens 1,2,4,8 --json $R/f2-$b-$i.json
    r f8$b-$i 60 .gpu/tpar-$b bench --fused -n 8 --tokens 1,2,4,8 --json $R/f8-$b-$i.json
  done
done
r st2b 90 .gpu/tpar-b selftest --backend cuda -n 2 --algos one-shot
r st8b 90 .gpu/tpar-b selftest --backend cuda -n 8 --algos one-shot
r st3b 60 .gpu/tpar-b selftest --backend cuda -n 3 --algos one-shot
finish
