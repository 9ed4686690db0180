# Session 5, call 2 (one H200): the fused one-shot kernel taking a block's rows in batches
# (one chain of trees, exchange and 1/rms per batch) with its exchange in the device state,
# and host-staged's rows spread over blocks like one-shot's. tpar = the change, tpar-base =
# 4527420. Selftests of the change, then fused sweeps base / new / base.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TPAR_CACHE_DIR=/tmp/tpar-cache
S=.stage/s5b; T=$S/tpar; B="env TPAR_CACHE_DIR=/tmp/tpar-cache-base .stage/s5a/tpar"
R=$OUT/r; L=$R/logs; mkdir -p $L
summary=()
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
  timeout "$limit" "$@" >"$L/$name.log" 2>&1; local rc=$?
  summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(grep -E '^selftest:|passed|failed|FAIL|rror' "$L/$name.log" | tail -1 | cut -c1-100)")"); }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; cat $S/TREE; $T --version; } > $L/device.txt
step selftest-2 120 $T selftest -n 2
step selftest-8 150 $T selftest -n 8
step selftest-3p 90 $T selftest -n 3 --processes --counts 0,7,4099,65541 --replays 20
TOK=1,2,4,8,16,32,64
for who in base new base2; do
  if [ $who = new ]; then X=$T; else X=$B; fi
  step $who-os-2 60 $X bench --fused -n 2 --algos one-shot --tokens $TOK --json $R/$who-os-2.json
  step $who-os-8 60 $X bench --fused -n 8 --algos one-shot --tokens $TOK --json $R/$who-os-8.json
  step $who-hs-2 60 $X bench --fused -n 2 --algos host-staged --tokens $TOK --json $R/$who-hs-2.json
  step $who-hs-8 60 $X bench --fused -n 8 --algos host-staged --tokens 1,2,4,8,16 --json $R/$who-hs-8.json
done
grep -h "FAIL" $L/selftest-*.log | head -5 | cut -c1-200
for c in os-2 os-8 hs-2 hs-8; do for who in base new base2; do echo "== $who-$c"; grep -E '^[0-9]' $L/$who-$c.log | cut -c1-150; done; done
printf '%s\n' "${summary[@]}"
tar czf $OUT/all.tgz -C $OUT r && rm -rf $R
