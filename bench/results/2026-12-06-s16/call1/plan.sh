# Session 16, call 1: main's tree (cd689f2, the small-block fused one-shot in a module of its
# own; new) against bb607a2 (base), fused at 2/4/8 ranks alternating twice; host-staged fused once
# each; the new binary's fused selftests; 8-rank allreduce of issue 25/26's sizes, twice.
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
run hs-base 60 .gpu/tpar-base bench $F -n 2 --algos host-staged --json $R/hs-base.json
run hs-new 60 .gpu/tpar-new bench $F -n 2 --algos host-staged --json $R/hs-new.json
for i in 1 2; do
  run a8-new-$i 120 .gpu/tpar-new bench --backend cuda -n 8 --sizes 4K,16K,32K,42K,64K --algos one-shot,two-shot,staged,islands,auto,nccl --islands 4+4 --json $R/a8-new-$i.json
done
run st-2 120 .gpu/tpar-new selftest --backend cuda -n 2 --algos one-shot,host-staged,staged
run st-3 120 .gpu/tpar-new selftest --backend cuda -n 3 --algos one-shot,host-staged,staged
run st-5 150 .gpu/tpar-new selftest --backend cuda -n 5 --algos one-shot,host-staged
run st-8 150 .gpu/tpar-new selftest --backend cuda -n 8 --algos one-shot,host-staged,staged
run st-4p 120 .gpu/tpar-new selftest --backend cuda -n 4 --processes --replays 20 --algos one-shot,host-staged,staged
cat $R/versions.txt >> $SUMMARY
finish
