# Session 16, call 2: the separate norm of a few rows on the small-block fused kernel as a world
# of one (new: this tree) against main cd689f2 (base), fused bench at 2/4/8 ranks alternating
# twice; the new binary's selftests with the fused rows (pull's are the unfused path).
source scripts/gpu-compare.sh
F="--backend cuda --fused --tokens 1,2,4,8,16,64"
.gpu/tpar-base --version > $R/versions.txt; .gpu/tpar-new --version >> $R/versions.txt
run warm-base 90 .gpu/tpar-base bench $F -n 2 --iters 5
run warm-new 90 .gpu/tpar-new bench $F -n 2 --iters 5
for i in 1 2; do
  for n in 2 4 8; do
    run f$n-base-$i 60 .gpu/tpar-base bench $F -n $n --json $R/f$n-base-$i.json
    run f$n-new-$i 60 .gpu/tpar-new bench $F -n $n --json $R/f$n-new-$i.json
  done
done
run st-2 120 .gpu/tpar-new selftest --backend cuda -n 2 --algos one-shot,one-shot-pull
run st-3 120 .gpu/tpar-new selftest --backend cuda -n 3 --algos one-shot,one-shot-pull
run st-5 150 .gpu/tpar-new selftest --backend cuda -n 5 --algos one-shot
run st-8 150 .gpu/tpar-new selftest --backend cuda -n 8 --algos one-shot,staged
run st-4p 120 .gpu/tpar-new selftest --backend cuda -n 4 --processes --replays 20 --algos one-shot
cat $R/versions.txt >> $SUMMARY
finish
