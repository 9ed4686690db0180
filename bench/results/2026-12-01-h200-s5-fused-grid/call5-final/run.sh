# Session 5, call 5 (one H200): the change as it will be committed (tpar), against 4527420
# (.stage/s5a/tpar) and against the change with the old PDL rule (tpar-g): selftests, the
# fused sweeps of one-shot and host-staged, the default fused bench, the Python CUDA fused test.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TPAR_CACHE_DIR=/tmp/tpar-cache
S=.stage/s5e; T=$S/tpar; G="env TPAR_CACHE_DIR=/tmp/tpar-cache-g $S/tpar-g"; B="env TPAR_CACHE_DIR=/tmp/tpar-cache-base .stage/s5a/tpar"
R=$OUT/r; L=$R/logs; mkdir -p $L
summary=()
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
  timeout "$limit" "$@" >"$L/$name.log" 2>&1; local rc=$?
  summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(grep -E '^selftest:|passed|failed|FAIL|rror' "$L/$name.log" | tail -1 | cut -c1-100)")"); }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; cat $S/TREE; $T --version; } > $L/device.txt
python3 -m pip install -q --no-index --no-deps --target /tmp/site .ci/wheels/tpar-*.whl > /dev/null 2>&1
step selftest-2 120 $T selftest -n 2
step selftest-8 150 $T selftest -n 8
step selftest-3p 90 $T selftest -n 3 --processes --counts 0,7,4099,65541 --replays 20
for who in base new g new2 base2; do
  case $who in base|base2) X=$B;; g) X=$G;; *) X=$T;; esac
  step $who-os-2 60 $X bench --fused -n 2 --algos one-shot --tokens 1,8,16,32 --json $R/$who-os-2.json
  step $who-os-8 60 $X bench --fused -n 8 --algos one-shot --tokens 1,4,8,16 --json $R/$who-os-8.json
done
for who in base new base2 new2; do
  case $who in base|base2) X=$B;; *) X=$T;; esac
  step $who-hs-2 60 $X bench --fused -n 2 --algos host-staged --tokens 1,2,4,8,16 --json $R/$who-hs-2.json
done
step fused-default 60 $T bench --fused --json $R/bench-fused-default.json
step pytest-fused 150 env PYTHONPATH=/tmp/site python3 -m pytest -rs -q tests/python/test_cuda_fused.py
grep -h "FAIL" $L/selftest-*.log | head -5 | cut -c1-200
for c in os-2 os-8 hs-2; do for who in base new g new2 base2; do [ -f $L/$who-$c.log ] || continue; printf '%-6s %-5s ' $who $c; grep -hE '^[0-9]' $L/$who-$c.log | awk '{printf "%sx%s ar %s a+n %s f %s | ", $1,$2,$6,$8,$9}'; echo; done; done
echo "== default"; grep -E '^[0-9]' $L/fused-default.log | cut -c1-150
printf '%s\n' "${summary[@]}"
tar czf $OUT/all.tgz -C $OUT r && rm -rf $R
