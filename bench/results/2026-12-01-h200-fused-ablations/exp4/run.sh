# Experiment 4 (issue 15): every warp computes 1/rms (no second barrier), against HEAD (1bc19d5) and e8fa91f.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
S=.stage/exp4
L=$OUT; mkdir -p $L/logs
b() { local name=$1 bin=$2; shift 2; local start=$SECONDS
  env TPAR_CACHE_DIR=/tmp/tc-$bin "$@" $S/$bin bench --fused --json $L/$name.json > $L/logs/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-start))s" >> $L/logs/steps.txt; }
st() { local name=$1; shift; local start=$SECONDS
  env TPAR_CACHE_DIR=/tmp/tc-tpar timeout 200 $S/tpar selftest "$@" > $L/logs/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-start))s $(tail -1 $L/logs/$name.log)" >> $L/logs/steps.txt; }
b d1-base tpar-base
b d2-head tpar-head
b d3-new tpar
b d4-head tpar-head
b d5-new tpar
b d6-base tpar-base
st selftest-2 -n 2
st selftest-8 -n 8
st selftest-3p -n 3 --processes --counts 0,7,4099,65541 --replays 20
cat $L/logs/steps.txt
grep -h "FAIL" $L/logs/selftest-*.log | head -10
python3 $S/sum.py $L
tar czf $L/logs.tgz -C $L logs
