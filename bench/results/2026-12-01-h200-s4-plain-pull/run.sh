# The plain pull with every flag awaited at once and batched loads, against d2bfaa4, one H200.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
S=.stage/pp; R=$OUT/r; L=$R/logs; mkdir -p $L
summary=()
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
  timeout "$limit" "$@" >"$L/$name.log" 2>&1; local rc=$?
  summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(grep -E '^selftest:|passed|failed|FAIL|rror' "$L/$name.log" | tail -1 | cut -c1-100)")"); }
for n in 2 8; do
  step before-$n 40 env TPAR_CACHE_DIR=/tmp/tc-b $S/tpar-before bench --backend cuda -n $n --algos one-shot-pull,one-shot,auto --sizes 4K,16K,64K,256K,1M --json $R/before-$n.json
  step after-$n 40 env TPAR_CACHE_DIR=/tmp/tc-a $S/tpar bench --backend cuda -n $n --algos one-shot-pull,one-shot,auto --sizes 4K,16K,64K,256K,1M --json $R/after-$n.json
done
step selftest-2 120 env TPAR_CACHE_DIR=/tmp/tc-a $S/tpar selftest -n 2
step selftest-8 150 env TPAR_CACHE_DIR=/tmp/tc-a $S/tpar selftest -n 8
step selftest-3p 90 env TPAR_CACHE_DIR=/tmp/tc-a $S/tpar selftest -n 3 --processes --counts 0,7,4099,65541 --replays 20
python3 - $R <<'PY'
import json, sys
d = sys.argv[1]
for n in (2, 8):
    b = {(r['algo'], r['bytes']): r for r in json.load(open(f"{d}/before-{n}.json"))['results']}
    for r in json.load(open(f"{d}/after-{n}.json"))['results']:
        o = b[(r['algo'], r['bytes'])]
        print(f"n={n} {r['algo']:<14} {r['bytes']:>8} before {o['p50_us']:8.2f} after {r['p50_us']:8.2f} ok {r['correct']}")
PY
grep -h FAIL $L/selftest-*.log | head -5 | cut -c1-200
printf '%s\n' "${summary[@]}"
tar czf $OUT/all.tgz -C $OUT r && rm -rf $R
