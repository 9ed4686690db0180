# Session 15, call 1: the fused one-shot exchanging warp sums with no barrier, its blocks as
# small as the grid allows (warp: this tree) against main bb607a2 (base), alternating twice;
# block-size knob; staged with TPAR_COLD_INLINE=0 against default twice; the warp selftests.
source scripts/gpu-compare.sh
F="--backend cuda --fused --tokens 1,2,4,8,16,64"
.gpu/tpar-base --version > $R/versions.txt; .gpu/tpar-warp --version >> $R/versions.txt
run warm-base 90 .gpu/tpar-base bench $F -n 2 --iters 5
run warm-warp 90 .gpu/tpar-warp bench $F -n 2 --iters 5
run st-2 120 .gpu/tpar-warp selftest --backend cuda -n 2 --algos one-shot,host-staged
for i in 1 2; do
  for n in 2 4 8; do
    run f$n-base-$i 60 .gpu/tpar-base bench $F -n $n --json $R/f$n-base-$i.json
    run f$n-warp-$i 60 .gpu/tpar-warp bench $F -n $n --json $R/f$n-warp-$i.json
  done
done
for t in 64 256 512; do
  run t$t-warp 60 env TPAR_FUSED_BLOCK_THREADS=$t .gpu/tpar-warp bench $F -n 2 --json $R/t$t-warp.json
done
run t64x8-warp 60 env TPAR_FUSED_BLOCK_THREADS=64 .gpu/tpar-warp bench $F -n 8 --json $R/t64x8-warp.json
run hs-base 60 .gpu/tpar-base bench $F -n 2 --algos host-staged --json $R/hs-base.json
run hs-warp 60 .gpu/tpar-warp bench $F -n 2 --algos host-staged --json $R/hs-warp.json
S="--backend cuda --iters 100 -n 8 --algos one-shot,staged --sizes 4K,32K"
for i in 1 2; do
  run sd-base-$i 90 .gpu/tpar-base bench $S --json $R/sd-base-$i.json
  run sc0-base-$i 90 env TPAR_KERNEL_DEFINES="-DTPAR_COLD_INLINE=0" .gpu/tpar-base bench $S --json $R/sc0-base-$i.json
done
run st-3 120 .gpu/tpar-warp selftest --backend cuda -n 3 --algos one-shot,host-staged
run st-8 150 .gpu/tpar-warp selftest --backend cuda -n 8 --algos one-shot,host-staged
run st-4p 120 .gpu/tpar-warp selftest --backend cuda -n 4 --processes --replays 20 --algos one-shot,host-staged
cat $R/versions.txt >> $SUMMARY
finish
