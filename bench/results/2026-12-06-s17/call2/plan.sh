# Session 17, call 2: the first-use fix (.ci/gpu/COMMIT): the bench test of the GPU suite, and
# auto at 8 and 2 ranks as threads (fresh cache: b8 measures, b8c reads the cache) and at 2
# ranks as processes (the engine's path: each rank measures as it joins).
source scripts/gpu-compare.sh
T=.ci/gpu/tpar
cat .ci/gpu/COMMIT >> "$SUMMARY"
run b8 60 $T bench --backend cuda -n 8 --sizes 4K,16K,32K,42K,64K,256K --algos one-shot,two-shot,one-shot-pull,auto --json $R/b8-fix-1.json
run b8c 40 $T bench --backend cuda -n 8 --sizes 4K,16K,32K,42K,64K,256K --algos auto --json $R/b8-fix-2.json
run b2 40 $T bench --backend cuda -n 2 --sizes 4K,32K,256K --algos one-shot,two-shot,auto --json $R/b2-fix.json
run b2p 60 $T bench --backend cuda -n 2 --processes --sizes 4K,32K,256K --algos auto --json $R/b2p-fix.json
run doctor8 60 $T doctor -n 8
finish
