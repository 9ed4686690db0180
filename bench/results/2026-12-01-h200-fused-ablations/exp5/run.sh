# Experiment 5 (issue 15): the fused one-shot's knobs (tuning.cuh), one binary, against e8fa91f.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
S=.stage/exp5
L=$OUT; mkdir -p $L/logs
b() { local name=$1 bin=$2; shift 2; local start=$SECONDS
  env TPAR_CACHE_DIR=/tmp/tc-$name "$@" $S/$bin bench --fused --json $L/$name.json > $L/logs/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-start))s" >> $L/logs/steps.txt; }
b e0-base tpar-base
b e1-default tpar
b e2-noearly tpar TPAR_KERNEL_DEFINES=-DTPAR_FUSED_EARLY_HEADER_MIN_RANKS=99
b e3-lastbar tpar TPAR_KERNEL_DEFINES=-DTPAR_FUSED_LAST_BARRIER=1
b e4-noearly-lastbar tpar "TPAR_KERNEL_DEFINES=-DTPAR_FUSED_EARLY_HEADER_MIN_RANKS=99 -DTPAR_FUSED_LAST_BARRIER=1"
b e5-calls tpar TPAR_KERNEL_DEFINES=-DTPAR_SLOW_PATH_INLINE=0
b e6-calls-lastbar tpar "TPAR_KERNEL_DEFINES=-DTPAR_SLOW_PATH_INLINE=0 -DTPAR_FUSED_LAST_BARRIER=1"
b e7-calls-early2 tpar "TPAR_KERNEL_DEFINES=-DTPAR_SLOW_PATH_INLINE=0 -DTPAR_FUSED_EARLY_HEADER_MIN_RANKS=2"
b e8-base-calls tpar-base TPAR_KERNEL_DEFINES=-DTPAR_SLOW_PATH_INLINE=0
cat $L/logs/steps.txt
python3 $S/sum.py $L
