#!/usr/bin/env bash
# Session 25, call 1: the fused fold in every thread without shuffles (c: small and whole blocks,
# and the power-of-two mean) and the small-block cluster form's sums as LL lines in shared
# memory (b: c + that; g1/g2: b folding one or two segments at a time), against main a521592
# (base), alternating; then b's selftests.
source scripts/gpu-compare.sh
r() { if [ $SECONDS -lt ${PLAN_SECONDS:-400} ]; then run "$@"; else echo "$1 skipped: out of time" >> "$SUMMARY"; fi; }

for b in b c base; do r warm-$b 100 .gpu/tpar-$b bench --fused -n 2 --tokens 1; done
for g in 1 2; do r warm-g$g 100 env TPAR_KERNEL_DEFINES=-DTPAR_NORM_FOLD_GROUP=$g .gpu/tpar-b bench --fused -n 2 --tokens 1; done
for i in 1 2; do
  for b in base c b; do
    r f2$b-$i 60 .gpu/tpar-$b bench --fused -n 2 --tokens 1,2,4,8 --json $R/f2-$b-$i.json
    r f4$b-$i 60 .gpu/tpar-$b bench --fused -n 4 --tokens 1,2 --json $R/f4-$b-$i.json
    r f8$b-$i 60 .gpu/tpar-$b bench --fused -n 8 --tokens 1,2,4,8 --json $R/f8-$b-$i.json
  done
  for g in 1 2; do
    r f2g$g-$i 60 env TPAR_KERNEL_DEFINES=-DTPAR_NORM_FOLD_GROUP=$g .gpu/tpar-b bench --fused -n 2 --tokens 1,2,4,8 --json $R/f2-g$g-$i.json
    r f8g$g-$i 60 env TPAR_KERNEL_DEFINES=-DTPAR_NORM_FOLD_GROUP=$g .gpu/tpar-b bench --fused -n 8 --tokens 1,2,4,8 --json $R/f8-g$g-$i.json
  done
done
r st2b 90 .gpu/tpar-b selftest --backend cuda -n 2 --algos one-shot
r st8b 90 .gpu/tpar-b selftest --backend cuda -n 8 --algos one-shot,host-staged
r st3b 90 .gpu/tpar-b selftest --backend cuda -n 3 --algos one-shot
r st7b 90 .gpu/tpar-b selftest --backend cuda -n 7 --algos one-shot
r st4pb 120 .gpu/tpar-b selftest --backend cuda -n 4 --processes --algos one-shot
finish
