#!/usr/bin/env bash
# Session 22, call 1: the fused one-shot's cluster exchange (tpar-clu: 371fde8 plus the
# whole-block cluster forms) against main ee8cedd (tpar-base), and the same binary with
# TPAR_FUSED_CLUSTERS=0 (mem). Runs stop being started after 380 s so that finish packs them.
source scripts/gpu-compare.sh
B=.gpu/tpar-base; C=.gpu/tpar-clu
r() { if [ $SECONDS -lt ${PLAN_SECONDS:-380} ]; then run "$@"; else echo "$1 skipped: out of time" >> "$SUMMARY"; fi; }
r warm-base 120 $B bench --fused -n 2 --tokens 1
r warm-clu 120 $C bench --fused -n 2 --tokens 1
for i in 1 2; do
  r f2b-$i 60 $B bench --fused -n 2 --tokens 1,2,4,8,16 --json $R/f2-base-$i.json
  r f2m-$i 60 env TPAR_FUSED_CLUSTERS=0 $C bench --fused -n 2 --tokens 1,2,4,8,16 --json $R/f2-mem-$i.json
  r f2c-$i 60 $C bench --fused -n 2 --tokens 1,2,4,8,16 --json $R/f2-clu-$i.json
done
r st2-clu 100 $C selftest --backend cuda -n 2 --algos one-shot
for i in 1 2; do
  r f8b-$i 60 $B bench --fused -n 8 --tokens 1,2 --json $R/f8-base-$i.json
  r f8m-$i 60 env TPAR_FUSED_CLUSTERS=0 $C bench --fused -n 8 --tokens 1,2 --json $R/f8-mem-$i.json
  r f8c-$i 60 $C bench --fused -n 8 --tokens 1,2 --json $R/f8-clu-$i.json
done
r st8-clu 100 $C selftest --backend cuda -n 8 --algos one-shot --dtypes bf16,f32
for i in 1 2; do
  r f4b-$i 60 $B bench --fused -n 4 --tokens 1,2 --json $R/f4-base-$i.json
  r f4c-$i 60 $C bench --fused -n 4 --tokens 1,2 --json $R/f4-clu-$i.json
  r t256b-$i 60 env TPAR_FUSED_BLOCK_THREADS=256 $B bench --fused -n 2 --tokens 1,2,4 --json $R/t256-base-$i.json
  r t256c-$i 60 env TPAR_FUSED_BLOCK_THREADS=256 $C bench --fused -n 2 --tokens 1,2,4 --json $R/t256-clu-$i.json
done
for i in 1 2; do
  r b8b-$i 90 $B bench --backend cuda -n 8 --sizes 4K,32K,42K --algos one-shot,two-shot,nccl --json $R/b8-base-$i.json
done
finish
