# Session 14, call 1: the final tree's untested selftests, islands/staged against one-shot at 8
# ranks, staged's per-step cost (slope over world sizes, poll and inlining knobs), fused bench.
source scripts/gpu-compare.sh
B=.gpu/tpar-head
S="--backend cuda --iters 100"
run b8-head-1 90 $B bench $S -n 8 --algos one-shot,staged,islands,islands-pull,staged-pull --islands 4+4 --sizes 4K,16K,32K,42K,64K --json $R/b8-head-1.json
for n in 2 3 4 6 8; do
  run sl$n-head 60 $B bench $S -n $n --algos one-shot,staged --sizes 4K,32K --json $R/sl$n-head.json
done
run nosleep-head 60 env TPAR_KERNEL_DEFINES="-DTPAR_DEVICE_POLL_SLEEP_MAX_NS=0" $B bench $S -n 8 --algos one-shot,staged --sizes 4K,32K --json $R/nosleep-head.json
run cold0-head 60 env TPAR_KERNEL_DEFINES="-DTPAR_COLD_INLINE=0" $B bench $S -n 8 --algos one-shot,staged --sizes 4K,32K --json $R/cold0-head.json
run slow0-head 60 env TPAR_KERNEL_DEFINES="-DTPAR_SLOW_PATH_INLINE=0" $B bench $S -n 8 --algos one-shot,staged --sizes 4K,32K --json $R/slow0-head.json
run mbt128-head 60 env TPAR_MIN_BLOCK_THREADS=128 $B bench $S -n 8 --algos one-shot,staged --sizes 4K,32K --json $R/mbt128-head.json
run mbt32-head 60 env TPAR_MIN_BLOCK_THREADS=32 $B bench $S -n 8 --algos one-shot,staged --sizes 4K,32K --json $R/mbt32-head.json
run b8-head-2 90 $B bench $S -n 8 --algos one-shot,staged,islands --islands 4+4 --sizes 4K,16K,32K,42K,64K --json $R/b8-head-2.json
run fu-head 90 $B bench --backend cuda --fused --json $R/fu-head.json
run st-4p 240 $B selftest --backend cuda -n 4 --processes --replays 20
run st-7 200 $B selftest --backend cuda -n 7
finish
