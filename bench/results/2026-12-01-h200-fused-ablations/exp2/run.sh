# Experiment 2 (issue 15): fused one-shot ablations, one binary, kernels recompiled per define.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
S=.stage/exp2
L=$OUT; mkdir -p $L/logs
b() { local name=$1; shift; local start=$SECONDS
  env TPAR_CACHE_DIR=/tmp/tc-$name "$@" $S/tpar bench --fused --json $L/$name.json > $L/logs/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-start))s" >> $L/logs/steps.txt; }
b b1-exp
b b2-lateheader TPAR_KERNEL_DEFINES=-DTPAR_FUSED_EARLY_HEADER=0
b b3-notree TPAR_KERNEL_DEFINES=-DTPAR_FUSED_ABLATE=8
b b4-noresload TPAR_KERNEL_DEFINES=-DTPAR_FUSED_ABLATE=16
b b5-noendsync TPAR_KERNEL_DEFINES=-DTPAR_FUSED_ABLATE=32
b b6-notree-noy TPAR_KERNEL_DEFINES=-DTPAR_FUSED_ABLATE=10
b b7-bare TPAR_KERNEL_DEFINES=-DTPAR_FUSED_ABLATE=62
b b8-bare-lateh "TPAR_KERNEL_DEFINES=-DTPAR_FUSED_ABLATE=62 -DTPAR_FUSED_EARLY_HEADER=0"
cat $L/logs/steps.txt
python3 $S/sum.py $L
