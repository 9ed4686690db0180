# Session 15, call 2: the fused one-shot with warp sums exchanged, warp 0 folding them (new:
# this tree; -DTPAR_FUSED_EVERY_WARP_FOLDS=1 every warp, as call 1's binary) against main
# bb607a2 (base); staged with its cold steps out of line (new) against base at 2/4/8 ranks.
source scripts/gpu-compare.sh
F="--backend cuda --fused --tokens 1,2,4,8,16,64"
EV="TPAR_KERNEL_DEFINES=-DTPAR_FUSED_EVERY_WARP_FOLDS=1"
.gpu/tpar-base --version > $R/versions.txt; .gpu/tpar-new --version >> $R/versions.txt
run warm-base 90 .gpu/tpar-base bench $F -n 2 --iters 5
run warm-new 90 .gpu/tpar-new bench $F -n 2 --iters 5
run warm-ev 90 env $EV .gpu/tpar-new bench $F -n 2 --iters 5
run st-2 120 .gpu/tpar-new selftest --backend cuda -n 2 --algos one-shot,host-staged,staged
for i in 1 2; do
  for n in 2 4 8; do
    run f$n-base-$i 60 .gpu/tpar-base bench $F -n $n --json $R/f$n-base-$i.json
    run f$n-new-$i 60 .gpu/tpar-new bench $F -n $n --json $R/f$n-new-$i.json
    run f$n-ev-$i 60 env $EV .gpu/tpar-new bench $F -n $n --json $R/f$n-ev-$i.json
  done
done
S="--backend cuda --iters 100 --algos one-shot,staged --sizes 4K,16K,32K,64K"
for i in 1 2; do
  for n in 2 4 8; do
    run s$n-base-$i 90 .gpu/tpar-base bench $S -n $n --json $R/s$n-base-$i.json
    run s$n-new-$i 90 .gpu/tpar-new bench $S -n $n --json $R/s$n-new-$i.json
  done
done
run st-3 120 .gpu/tpar-new selftest --backend cuda -n 3 --algos one-shot,host-staged,staged
run st-8 150 .gpu/tpar-new selftest --backend cuda -n 8 --algos one-shot,host-staged,staged
run st-4p 120 .gpu/tpar-new selftest --backend cuda -n 4 --processes --replays 20 --algos one-shot,host-staged,staged
cat $R/versions.txt >> $SUMMARY
finish
