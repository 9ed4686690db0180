# Session 14, call 5: the fused one-shot with one wait site per peer (tuning.cuh's
# TPAR_WAIT_SITE_PER_GROUP=0) and with its residual/weight preload as volatile loads
# (-DTPAR_EXP_EARLY_LOADS, this tree), each alone and together, twice, alternating; the fused
# two-shot with and without the per-peer site.
source scripts/gpu-compare.sh
B=.gpu/tpar-lad2
F="--backend cuda --fused --tokens 1,2,4,8,16"
run warm 90 $B bench $F -n 2 --iters 5
for i in 1 2; do
  run d-lad2-$i 60 $B bench $F --json $R/d-lad2-$i.json
  run s0-lad2-$i 60 env TPAR_KERNEL_DEFINES=-DTPAR_WAIT_SITE_PER_GROUP=0 $B bench $F --json $R/s0-lad2-$i.json
  run el-lad2-$i 60 env TPAR_KERNEL_DEFINES=-DTPAR_EXP_EARLY_LOADS $B bench $F --json $R/el-lad2-$i.json
  run s0el-lad2-$i 60 env TPAR_KERNEL_DEFINES="-DTPAR_WAIT_SITE_PER_GROUP=0 -DTPAR_EXP_EARLY_LOADS" $B bench $F --json $R/s0el-lad2-$i.json
done
run t2d-lad2 60 $B bench $F --algos two-shot --json $R/t2d-lad2.json
run t2s0-lad2 60 env TPAR_KERNEL_DEFINES=-DTPAR_WAIT_SITE_PER_GROUP=0 $B bench $F --algos two-shot --json $R/t2s0-lad2.json
finish
