# Session 14, call 2: staged summing held lines (new) against ee3e89a (head); the fused
# one-shot with fewer blocks a row (TPAR_FUSED_BLOCKS_PER_ROW); staged selftests.
source scripts/gpu-compare.sh
S="--backend cuda --iters 100"
run warm-new 60 .gpu/tpar-new bench $S -n 2 --algos staged --sizes 4K
for i in 1 2; do for b in head new; do
  run st8-$b-$i 60 .gpu/tpar-$b bench $S -n 8 --algos one-shot,staged --sizes 4K,16K,32K,42K,64K,256K --json $R/st8-$b-$i.json
  run st4-$b-$i 60 .gpu/tpar-$b bench $S -n 4 --algos one-shot,staged --sizes 4K,32K,256K --json $R/st4-$b-$i.json
  run st2-$b-$i 60 .gpu/tpar-$b bench $S -n 2 --algos one-shot,staged --sizes 4K,32K --json $R/st2-$b-$i.json
done; done
for bpr in 1 2; do
  run fu$bpr-new 90 env TPAR_FUSED_BLOCKS_PER_ROW=$bpr .gpu/tpar-new bench --backend cuda --fused --tokens 1,2,8 --json $R/fu$bpr-new.json
done
run fu4-new 90 .gpu/tpar-new bench --backend cuda --fused --tokens 1,2,8 --json $R/fu4-new.json
run selftest-8 200 .gpu/tpar-new selftest --backend cuda -n 8 --algos staged
run selftest-5 200 .gpu/tpar-new selftest --backend cuda -n 5 --algos staged
run selftest-10 200 .gpu/tpar-new selftest --backend cuda -n 10 --algos staged
finish
