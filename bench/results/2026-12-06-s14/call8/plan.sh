# Session 14, call 8: the fused one-shot's kernel with one wait site per peer, launched up to 4
# ranks (sites: this tree, a kernel of its own) against HEAD b144b6e (base), alternating twice;
# host-staged's fused call (unchanged) once each; the sites binary's fused selftests.
source scripts/gpu-compare.sh
F="--backend cuda --fused --tokens 1,2,8,16"
.gpu/tpar-base --version > $R/versions.txt; .gpu/tpar-sites --version >> $R/versions.txt
run warm-base 90 .gpu/tpar-base bench $F -n 2 --iters 5
run warm-sites 90 .gpu/tpar-sites bench $F -n 2 --iters 5
for i in 1 2; do
  for n in 2 4 8; do
    run f$n-base-$i 60 .gpu/tpar-base bench $F -n $n --json $R/f$n-base-$i.json
    run f$n-sites-$i 60 .gpu/tpar-sites bench $F -n $n --json $R/f$n-sites-$i.json
  done
done
run hs-base 60 .gpu/tpar-base bench $F -n 2 --algos host-staged --json $R/hs-base.json
run hs-sites 60 .gpu/tpar-sites bench $F -n 2 --algos host-staged --json $R/hs-sites.json
run st-2 120 .gpu/tpar-sites selftest --backend cuda -n 2 --algos one-shot,host-staged
run st-3 120 .gpu/tpar-sites selftest --backend cuda -n 3 --algos one-shot,host-staged
run st-4 120 .gpu/tpar-sites selftest --backend cuda -n 4 --algos one-shot,host-staged
run st-4p 120 .gpu/tpar-sites selftest --backend cuda -n 4 --processes --replays 20 --algos one-shot,host-staged
cat $R/versions.txt >> $SUMMARY
finish
