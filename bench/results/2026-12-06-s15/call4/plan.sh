# Session 15, call 4: call 3's fused one-shot with the whole blocks' segment sums side by side
# (new: this tree) against main bb607a2 (base), alternating twice; at 4 and 8 ranks the same
# binary with whole blocks only (w512: TPAR_FUSED_BLOCK_THREADS=512).
source scripts/gpu-compare.sh
F="--backend cuda --fused --tokens 1,2,4,8,16,64"
.gpu/tpar-base --version > $R/versions.txt; .gpu/tpar-new --version >> $R/versions.txt
run warm-base 90 .gpu/tpar-base bench $F -n 2 --iters 5
run warm-new 90 .gpu/tpar-new bench $F -n 2 --iters 5
for i in 1 2; do
  for n in 2 4 8; do
    run f$n-base-$i 60 .gpu/tpar-base bench $F -n $n --json $R/f$n-base-$i.json
    run f$n-new-$i 60 .gpu/tpar-new bench $F -n $n --json $R/f$n-new-$i.json
    [ $n = 2 ] || run f$n-w512-$i 60 env TPAR_FUSED_BLOCK_THREADS=512 .gpu/tpar-new bench $F -n $n --json $R/f$n-w512-$i.json
  done
done
run hs-base 60 .gpu/tpar-base bench $F -n 2 --algos host-staged --json $R/hs-base.json
run hs-new 60 .gpu/tpar-new bench $F -n 2 --algos host-staged --json $R/hs-new.json
run st-2 120 .gpu/tpar-new selftest --backend cuda -n 2 --algos one-shot,host-staged
run st-8 150 .gpu/tpar-new selftest --backend cuda -n 8 --algos one-shot,host-staged
cat $R/versions.txt >> $SUMMARY
finish
