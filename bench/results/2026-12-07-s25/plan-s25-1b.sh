#!/usr/bin/env bash
# Session 25, call 1 (compact): b = the fused fold in every thread without shuffles (small and
# whole blocks), the power-of-two mean, and the small-block cluster form's sums as LL lines in
# shared memory, folding four segments at a time; g1 = b folding one at a time (its kernels
# defined so through TPAR_KERNEL_DEFINES); against main a521592 (base), alternating. Then b's
# selftests.
source scripts/gpu-compare.sh
r() { if [ $SECONDS -lt ${PLAN_SECONDS:-400} ]; then run "$@"; else echo "$1 skipped: out of time" >> "$SUMMARY"; fi; }
G1="env TPAR_KERNEL_DEFINES=-DTPAR_NORM_FOLD_GROUP=1 .gpu/tpar-b"
r warm-b 100 .gpu/tpar-b bench --fused -n 2 --tokens 1
r warm-base 100 .gpu/tpar-base bench --fused -n 2 --tokens 1
r warm-g1 100 $G1 bench --fused -n 2 --tokens 1
for i in 1 2; do
  for b in base b g1; do
    x=.gpu/tpar-$b; [ $b = g1 ] && x=$G1
    r f2$b-$i 60 $x bench --fused -n 2 --tokens 1,2,4,8 --json $R/f2-$b-$i.json
    r f4$b-$i 60 $x bench --fused -n 4 --tokens 1,2 --json $R/f4-$b-$i.json
    r f8$b-$i 60 $x bench --fused -n 8 --tokens 1,2,4,8 --json $R/f8-$b-$i.json
  done
done
r st2b 90 .gpu/tpar-b selftest --backend cuda -n 2 --algos one-shot
r st8b 90 .gpu/tpar-b selftest --backend cuda -n 8 --algos one-shot,host-staged
r st3b 90 .gpu/tpar-b selftest --backend cuda -n 3 --algos one-shot
r st7b 90 .gpu/tpar-b selftest --backend cuda -n 7 --algos one-shot
r st4pb 120 .gpu/tpar-b selftest --backend cuda -n 4 --processes --algos one-shot
r st2g1 90 $G1 selftest --backend cuda -n 2 --algos one-shot
finish
