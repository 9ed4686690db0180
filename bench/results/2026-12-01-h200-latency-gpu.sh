#!/usr/bin/env bash
# issue 14 (latency): selftests, before/after bench and the anatomy in one call.
# Run from .stage/latency with ../before/tpar present. Logs and JSON go to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TPAR_CACHE_DIR=/tmp/tpar-cache
after=./tpar; before=../before/tpar
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/logs
summary=()
step() { # name limit cmd...
  local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  summary+=("$(printf '%-26s rc=%-3s %4ss %s' $name $rc $((SECONDS-t)) "$(grep -E 'pass|fail|error' $OUT/logs/$name.log | tail -1 | cut -c1-100)")")
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } > $OUT/logs/device.txt
sizes=0,4K,32K,42K,256K,1M
for s in ${STEPS:-sel2 anat bench sel8 sel3 sel7 proc4}; do case $s in
  sel2) step selftest-2 120 $after selftest --backend cuda -n 2 ;;
  sel3) step selftest-3 120 $after selftest --backend cuda -n 3 ;;
  sel7) step selftest-7 150 $after selftest --backend cuda -n 7 ;;
  sel8) step selftest-8 150 $after selftest --backend cuda -n 8 ;;
  proc4) step selftest-4-processes 150 $after selftest --backend cuda -n 4 --processes ;;
  var) for v in "-DTPAR_HEADER_BATCH_POLL=1" "-DTPAR_SLOW_PATH_INLINE=0" "-DTPAR_HOST_FREE_POLLS=4"; do
      name=var$(echo $v | tr -cd 'A-Z0-9=' | tr '=' '_')
      TPAR_KERNEL_DEFINES="$v" step bench-$name 60 $after bench --backend cuda -n 2 --sizes $sizes --algos one-shot,host-staged --json $OUT/logs/bench-$name.json
    done
    TPAR_KERNEL_DEFINES="-DTPAR_HEADER_BATCH_POLL=1" step anatomy-var-batch 60 $after bench --anatomy -n 2 --json $OUT/logs/anatomy-var-batch.json ;;
  anat) step anatomy 150 $after bench --anatomy --json $OUT/logs/anatomy.json ;;
  nopdl) TPAR_PDL=0 step bench-after-nopdl-2 90 $after bench --backend cuda -n 2 --sizes $sizes --algos one-shot,host-staged --json $OUT/logs/bench-after-nopdl-2.json ;;
  after) for n in 2 8; do step bench-after-$n 120 $after bench --backend cuda -n $n --sizes $sizes --json $OUT/logs/bench-after-$n.json; done ;;
  bench) for n in 2 8; do
      step bench-before-$n 120 $before bench --backend cuda -n $n --sizes $sizes --json $OUT/logs/bench-before-$n.json
      step bench-after-$n 120 $after bench --backend cuda -n $n --sizes $sizes --json $OUT/logs/bench-after-$n.json
    done ;;
esac; done
for f in bench-before-2 bench-after-2 bench-before-8 bench-after-8 bench-after-nopdl-2 $(cd $OUT/logs && ls bench-var*.log 2>/dev/null | sed 's/.log$//'); do
  [ -f $OUT/logs/$f.log ] && { echo "== $f"; grep -E '^floors|one-shot +[0-9]|host-staged +[0-9]' $OUT/logs/$f.log | sed -E 's/ {20,}/ /' | head -40; }
done
[ -f $OUT/logs/anatomy-var-batch.log ] && { echo "== anatomy-var-batch"; grep -v wrote $OUT/logs/anatomy-var-batch.log | tail -16; }
[ -f $OUT/logs/anatomy.log ] && { echo "== anatomy"; grep -v wrote $OUT/logs/anatomy.log | tail -40; }
printf '%s\n' "${summary[@]}"
(cd $OUT && tar czf results.tar.gz logs && rm -rf logs)
