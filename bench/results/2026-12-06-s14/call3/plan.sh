# Session 14, call 3: the fused one-shot's row sums through a thread block cluster (clu: this
# tree's default) against the exchange through device memory (TPAR_CLUSTERS=0, same binary)
# and against no exchange at all (wrong results, a lower bound: -DTPAR_EXPERIMENT_SKIP_EXCHANGE).
source scripts/gpu-compare.sh
B=.gpu/tpar-clu
F="--backend cuda --fused --tokens 1,2,4,8,16"
run warm 90 $B bench $F -n 2 --iters 5
for i in 1 2; do
  run fc-clu-$i 90 $B bench $F --json $R/fc-clu-$i.json
  run fm-clu-$i 90 env TPAR_CLUSTERS=0 $B bench $F --json $R/fm-clu-$i.json
done
run fskip-clu 90 env TPAR_CLUSTERS=0 TPAR_KERNEL_DEFINES=-DTPAR_EXPERIMENT_SKIP_EXCHANGE $B bench $F --json $R/fskip-clu.json
run st-8 200 $B selftest --backend cuda -n 8 --algos one-shot,host-staged,two-shot
run st-3 200 $B selftest --backend cuda -n 3 --algos one-shot,host-staged
run st-2 200 $B selftest --backend cuda -n 2 --algos one-shot,host-staged
finish
