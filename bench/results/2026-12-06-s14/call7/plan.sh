# Session 14, call 7 (call 6 again with a real second binary: gpu-compare.sh had built one
# binary under both names): the fused one-shot compiled with both wait sites, one per peer up to
# 4 ranks (site: this tree) against HEAD b144b6e (base), and base with one site per peer
# everywhere (-DTPAR_WAIT_SITE_PER_GROUP=0); fused selftests of the site binary.
source scripts/gpu-compare.sh
F="--backend cuda --fused --tokens 1,2,8,16"
.gpu/tpar-base --version > $R/versions.txt; .gpu/tpar-site --version >> $R/versions.txt
run warm-base 90 .gpu/tpar-base bench $F -n 2 --iters 5
run warm-site 90 .gpu/tpar-site bench $F -n 2 --iters 5
for i in 1 2; do
  for n in 2 4 8; do
    run f$n-base-$i 60 .gpu/tpar-base bench $F -n $n --json $R/f$n-base-$i.json
    run f$n-site-$i 60 .gpu/tpar-site bench $F -n $n --json $R/f$n-site-$i.json
  done
done
for n in 2 4 8; do
  run f${n}s0-base 60 env TPAR_KERNEL_DEFINES=-DTPAR_WAIT_SITE_PER_GROUP=0 .gpu/tpar-base bench $F -n $n --json $R/f${n}s0-base.json
done
run st-2 200 .gpu/tpar-site selftest --backend cuda -n 2 --algos one-shot,host-staged
run st-4 200 .gpu/tpar-site selftest --backend cuda -n 4 --algos one-shot,host-staged
run st-8 200 .gpu/tpar-site selftest --backend cuda -n 8 --algos one-shot,host-staged
run st-4p 200 .gpu/tpar-site selftest --backend cuda -n 4 --processes --replays 20 --algos one-shot,host-staged
cat $R/versions.txt >> $SUMMARY
finish
