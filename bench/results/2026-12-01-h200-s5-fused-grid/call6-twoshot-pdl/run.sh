# Session 5, call 6 (one H200): the fused two-shot launch with PDL only where every block takes
# one unit (tpar-ts) against main (tpar, cfb5062), base / ts / base; then main's bench step for
# Llama-3.1-70B TP 8 with fused and separate norms, the default
# fused bench.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TPAR_CACHE_DIR=/tmp/tpar-cache
S=.stage/s5f; T=$S/tpar; TS="env TPAR_CACHE_DIR=/tmp/tpar-cache-ts $S/tpar-ts"
R=$OUT/r; L=$R/logs; mkdir -p $L
summary=()
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
  timeout "$limit" "$@" >"$L/$name.log" 2>&1; local rc=$?
  summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(grep -E '^selftest:|passed|failed|FAIL|rror' "$L/$name.log" | tail -1 | cut -c1-100)")"); }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; cat $S/TREE; $T --version; } > $L/device.txt
for who in main ts main2 ts2; do
  case $who in main*) X=$T;; *) X=$TS;; esac
  step $who-ts-2 60 $X bench --fused -n 2 --algos two-shot --tokens 8,16,32 --json $R/$who-ts-2.json
  step $who-ts-8 60 $X bench --fused -n 8 --algos two-shot --tokens 4,8,16,32 --json $R/$who-ts-8.json
done
step selftest-ts-8 150 $TS selftest -n 8 --algos two-shot
step fused-default 60 $T bench --fused --json $R/bench-fused-default.json
step step-llama-tp8 150 $T bench step --config crates/tpar/fixtures/models/llama-3.1-70b.json -n 8 --tokens 4 --algos auto,one-shot --json $R/step-llama-tp8.json
python3 -m pip install -q --no-index --no-deps --target /tmp/site .ci/wheels/tpar-*.whl > /dev/null 2>&1
for c in ts-2 ts-8; do for who in main ts main2 ts2; do printf '%-6s %-5s ' $who $c; grep -hE '^[0-9]' $L/$who-$c.log | awk '{printf "%sx%s ar %s a+n %s f %s | ", $1,$2,$6,$8,$9}'; echo; done; done
echo "== default"; grep -E '^[0-9]' $L/fused-default.log | cut -c1-150
echo "== step"; grep -vE '^\s*$' $L/step-llama-tp8.log | tail -8 | cut -c1-170
printf '%s\n' "${summary[@]}"
tar czf $OUT/all.tgz -C $OUT r && rm -rf $R
