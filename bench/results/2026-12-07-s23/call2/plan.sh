#!/usr/bin/env bash
# Session 23, call 2: main with the cluster forms landed (tpar-new, 9440581): the kernels'
# memory as loaded (doctor), the one-shot selftests (the fused rows are one-shot's) at 3 and 7
# ranks and 4 processes; two experiments: every warp folds the shared sums
# (-DTPAR_FUSED_FOLD_EVERY_WARP=1, FOLD) and the per-peer-site/small-block kernels at 8 ranks
# (TPAR_FUSED_PEER_SITE_RANKS=8, P8). Short: the device time left is short.
source scripts/gpu-compare.sh
N=.gpu/tpar-new
FOLD="env TPAR_KERNEL_DEFINES=-DTPAR_FUSED_FOLD_EVERY_WARP=1"
P8="env TPAR_FUSED_PEER_SITE_RANKS=8"
r() { if [ $SECONDS -lt ${PLAN_SECONDS:-200} ]; then run "$@"; else echo "$1 skipped: out of time" >> "$SUMMARY"; fi; }
r doc-new 100 $N doctor -n 2
r st3 60 $N selftest --backend cuda -n 3 --algos one-shot
r st7 60 $N selftest --backend cuda -n 7 --algos one-shot
r st4p 90 $N selftest --backend cuda -n 4 --processes --algos one-shot
r warm-fold 100 $FOLD $N bench --fused -n 2 --tokens 1
for i in 1 2; do
  r f2n-$i 30 $N bench --fused -n 2 --tokens 1,2,8 --json $R/f2-new-$i.json
  r f2f-$i 30 $FOLD $N bench --fused -n 2 --tokens 1,2,8 --json $R/f2-fold-$i.json
  r f8n-$i 30 $N bench --fused -n 8 --tokens 1,2 --json $R/f8-new-$i.json
  r f8f-$i 30 $FOLD $N bench --fused -n 8 --tokens 1,2 --json $R/f8-fold-$i.json
  r f8p-$i 30 $P8 $N bench --fused -n 8 --tokens 1,2 --json $R/f8-p8-$i.json
done
r st8-p8 60 $P8 $N selftest --backend cuda -n 8 --algos one-shot --dtypes bf16 --no-timeout-case
r st2-fold 60 $FOLD $N selftest --backend cuda -n 2 --algos one-shot --dtypes bf16 --no-timeout-case
finish
