# Experiment 3 (issue 15): whole rows for two ranks (no exchange of segment sums), checked.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
S=.stage/exp3
L=$OUT; mkdir -p $L/logs
b() { local name=$1; shift; local start=$SECONDS
  env TPAR_CACHE_DIR=/tmp/tc-$name "$@" $S/tpar bench --fused --json $L/$name.json > $L/logs/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-start))s" >> $L/logs/steps.txt; }
st() { local name=$1; shift; local start=$SECONDS
  env TPAR_CACHE_DIR=/tmp/tc-c1-main timeout 200 $S/tpar selftest "$@" > $L/logs/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-start))s $(tail -1 $L/logs/$name.log)" >> $L/logs/steps.txt; }
b c1-main
b c2-exchange TPAR_KERNEL_DEFINES=-DTPAR_FUSED_WHOLE_ROWS=0
b c3-main-lateh TPAR_KERNEL_DEFINES=-DTPAR_FUSED_EARLY_HEADER=0
b c4-main-again
st selftest-2 -n 2
st selftest-8 -n 8
st selftest-2p -n 2 --processes --counts 0,7,4099,65541 --replays 20
cat $L/logs/steps.txt
grep -i "fused" $L/logs/selftest-2.log | grep -v " pass" | head -20
python3 $S/sum.py $L
tar czf $L/logs.tgz -C $L logs
