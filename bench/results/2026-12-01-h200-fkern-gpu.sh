#!/usr/bin/env bash
# fkern (issue 15 kernel speed): selftests with the fused rows at 2 and 8 ranks (threads, one
# GPU) and `tpar bench --fused` at 2 and 8 ranks. Run from a folder holding a stripped tpar
# built from branch `fkern` (as .stage/fkern). Logs and JSON go to $OUT. One call, under 5 minutes.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TPAR_CACHE_DIR=/tmp/tpar-cache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
tpar=${TPAR:-./tpar}
summary=()
step() { # name limit cmd...
  local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout $limit "$@" > $OUT/$name.log 2>&1; local rc=$?
  summary+=("$(printf '%-14s rc=%-3s %4ss %s' $name $rc $((SECONDS-t)) "$(grep -E '^selftest|passed|failed|rror' $OUT/$name.log | tail -1 | cut -c1-110)")")
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } > $OUT/device.txt
sel="selftest --backend cuda --counts 7,4099 --replays 20 --timeout 5"
step selftest-2 80 $tpar $sel -n 2
step bench-fused 90 $tpar bench --fused --iters 100 --chain 50 --json $OUT/bench-fused.json
step selftest-8 100 $tpar $sel -n 8
for f in selftest-2 selftest-8; do
  echo "== $f: fused rows $(grep -c '^fused' $OUT/$f.log), failing rows:"; grep -E 'FAIL|rror' $OUT/$f.log | head -12
done
echo "== bench-fused"; grep -v '^wrote' $OUT/bench-fused.log | tail -6
cat $OUT/device.txt
printf '%s\n' "${summary[@]}"
