# Experiment 1 (issue 15, fused one-shot latency): where the fused kernel's +1.3 us goes.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
S=.stage/exp1
L=$OUT; mkdir -p $L/logs
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } > $L/device.txt
b() { # name, env..., -- then runs bench --fused
  local name=$1; shift
  local start=$SECONDS
  env TPAR_CACHE_DIR=/tmp/tc-$name "$@" bench --fused --json $L/$name.json > $L/logs/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-start))s" >> $L/logs/steps.txt
}
b a0-base $S/tpar-base
b a1-exp $S/tpar
b a2-rb1 TPAR_FUSED_ROW_BLOCKS=1 $S/tpar
b a3-rb2 TPAR_FUSED_ROW_BLOCKS=2 $S/tpar
b a4-noexch TPAR_KERNEL_DEFINES=-DTPAR_FUSED_ABLATE=1 $S/tpar
b a5-noy TPAR_KERNEL_DEFINES=-DTPAR_FUSED_ABLATE=2 $S/tpar
b a6-nores TPAR_KERNEL_DEFINES=-DTPAR_FUSED_ABLATE=4 $S/tpar
b a7-exp-again $S/tpar
start=$SECONDS; TPAR_CACHE_DIR=/tmp/tc-a1-exp timeout 150 $S/tpar selftest -n 2 > $L/logs/selftest-2.log 2>&1; echo "selftest rc=$? $((SECONDS-start))s" >> $L/logs/steps.txt
cat $L/logs/steps.txt; tail -2 $L/logs/selftest-2.log
python3 $S/sum.py $L
