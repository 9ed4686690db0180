# Session 14, call 4: where the fused one-shot's 2 us over the allreduce go. Experiment
# defines of this tree (wrong results except the knobs of tuning.cuh): no residual/weight
# preload, no epilogue (the reduced sums stored to y, as the allreduce), no exchange between a
# row's blocks, no 1/rms arithmetic; and tuning.cuh's wait-site and inlining knobs.
source scripts/gpu-compare.sh
B=.gpu/tpar-lad
F="--backend cuda --fused --tokens 1,8"
run warm 90 $B bench $F -n 2 --iters 5
run d-lad-1 60 $B bench $F --json $R/d-lad-1.json
for v in NO_PRELOAD NO_EPILOGUE NO_EXCHANGE NO_INV; do
  c=$(echo $v | tr -d _ | tr A-Z a-z)
  run $c-lad 60 env TPAR_KERNEL_DEFINES=-DTPAR_EXP_$v $B bench $F --json $R/$c-lad.json
done
run noepinopre-lad 60 env TPAR_KERNEL_DEFINES="-DTPAR_EXP_NO_EPILOGUE -DTPAR_EXP_NO_PRELOAD" $B bench $F --json $R/noepinopre-lad.json
run noexnoinv-lad 60 env TPAR_KERNEL_DEFINES="-DTPAR_EXP_NO_EXCHANGE -DTPAR_EXP_NO_INV" $B bench $F --json $R/noexnoinv-lad.json
run site0-lad 60 env TPAR_KERNEL_DEFINES=-DTPAR_WAIT_SITE_PER_GROUP=0 $B bench $F --json $R/site0-lad.json
run cold0-lad 60 env TPAR_KERNEL_DEFINES=-DTPAR_COLD_INLINE=0 $B bench $F --json $R/cold0-lad.json
run slow0-lad 60 env TPAR_KERNEL_DEFINES=-DTPAR_SLOW_PATH_INLINE=0 $B bench $F --json $R/slow0-lad.json
run nopdl-lad 60 env TPAR_PDL=0 $B bench $F --json $R/nopdl-lad.json
run d-lad-2 60 $B bench $F --json $R/d-lad-2.json
finish
