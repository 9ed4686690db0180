#!/usr/bin/env bash
# Session 22, the short form of plan1.sh: the cluster binary only, against itself with
# TPAR_FUSED_CLUSTERS=0 (the exchange through memory, as on main). Runs stop being started
# after PLAN_SECONDS.
source scripts/gpu-compare.sh
C=.gpu/tpar-clu
r() { if [ $SECONDS -lt ${PLAN_SECONDS:-90} ]; then run "$@"; else echo "$1 skipped: out of time" >> "$SUMMARY"; fi; }
r f2c-0 120 $C bench --fused -n 2 --tokens 1,8 --json $R/f2-clu-0.json
r f2m-1 40 env TPAR_FUSED_CLUSTERS=0 $C bench --fused -n 2 --tokens 1,2,8 --json $R/f2-mem-1.json
r f2c-1 40 $C bench --fused -n 2 --tokens 1,2,8 --json $R/f2-clu-1.json
r f8c-1 40 $C bench --fused -n 8 --tokens 1 --json $R/f8-clu-1.json
r f8m-1 40 env TPAR_FUSED_CLUSTERS=0 $C bench --fused -n 8 --tokens 1 --json $R/f8-mem-1.json
r st2-clu 60 $C selftest --backend cuda -n 2 --algos one-shot --dtypes bf16
finish
