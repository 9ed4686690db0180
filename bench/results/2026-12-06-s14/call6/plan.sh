# Session 14, call 6: the fused one-shot compiled with both wait sites, taking one site per peer
# up to 4 ranks (site: this tree) against HEAD b144b6e (base) and base with one site per peer
# everywhere (-DTPAR_WAIT_SITE_PER_GROUP=0), alternating twice; fused selftests.
source scripts/gpu-compare.sh
F="--backend cuda --fused --tokens 1,2,8,16"
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
run st-5 200 .gpu/tpar-site selftest --backend cuda -n 5 --algos one-shot,host-staged
run st-4p 200 .gpu/tpar-site selftest --backend cuda -n 4 --processes --replays 20 --algos one-shot,host-staged
finish
