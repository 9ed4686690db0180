# Session 15, call 3: the fused one-shot with blocks of 128/256 exchanging warp sums and whole
# blocks exchanging segment sums (new: this tree) against main bb607a2 (base), alternating
# twice; host-staged's fused call once each; the new binary's selftests.
source scripts/gpu-compare.sh
F="--backend cuda --fused --tokens 1,2,4,8,16,64"
.gpu/tpar-base --version > $R/versions.txt; .gpu/tpar-new --version >> $R/versions.txt
run warm-base 90 .gpu/tpar-base bench $F -n 2 --iters 5
run warm-new 90 .gpu/tpar-new bench $F -n 2 --iters 5
run st-2 120 .gpu/tpar-new selftest --backend cuda -n 2 --algos one-shot,host-staged,staged
for i in 1 2; do
  for n in 2 4 8; do
    run f$n-base-$i 60 .gpu/tpar-base bench $F -n $n --json $R/f$n-base-$i.json
    run f$n-new-$i 60 .gpu/tpar-new bench $F -n $n --json $R/f$n-new-$i.json
  done
done
run hs-base 60 .gpu/tpar-base bench $F -n 2 --algos host-staged --json $R/hs-base.json
run hs-new 60 .gpu/tpar-new bench $F -n 2 --algos host-staged --json $R/hs-new.json
run st-3 120 .gpu/tpar-new selftest --backend cuda -n 3 --algos one-shot,host-staged,staged
run st-6 150 .gpu/tpar-new selftest --backend cuda -n 6 --algos one-shot,host-staged
run st-8 150 .gpu/tpar-new selftest --backend cuda -n 8 --algos one-shot,host-staged,staged
run st-4p 120 .gpu/tpar-new selftest --backend cuda -n 4 --processes --replays 20 --algos one-shot,host-staged,staged
cat $R/versions.txt >> $SUMMARY
finish
