# Session 5, call 8 (one H200): the final tree (fused PDL: a unit a block where the GPU gives a
# rank the full 64 co-resident blocks, two below): selftests, Python fused test, fused sweeps
# of one-shot, two-shot and host-staged, the default fused bench, bench step (Llama-3.1-70B,
# 8 ranks x 4 tokens and 2 ranks x 16 tokens).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TPAR_CACHE_DIR=/tmp/tpar-cache
S=.stage/s5h; T=$S/tpar
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
step os-2 60 $T bench --fused -n 2 --algos one-shot --tokens 1,8,16,32 --json $R/os-2.json
step os-8 60 $T bench --fused -n 8 --algos one-shot --tokens 1,4,8,16 --json $R/os-8.json
step ts-2 60 $T bench --fused -n 2 --algos two-shot --tokens 8,16,32 --json $R/ts-2.json
step ts-8 60 $T bench --fused -n 8 --algos two-shot --tokens 4,8,16,32 --json $R/ts-8.json
step hs-2 60 $T bench --fused -n 2 --algos host-staged --tokens 1,2,4,8,16 --json $R/hs-2.json
step fused-default 60 $T bench --fused --json $R/bench-fused-default.json
step step-n8-t4 120 $T bench step --config crates/tpar/fixtures/models/llama-3.1-70b.json -n 8 --tokens 4 --algos auto,one-shot --json $R/step-n8-t4.json
step step-n2-t16 120 $T bench step --config crates/tpar/fixtures/models/llama-3.1-70b.json -n 2 --tokens 16 --algos auto --json $R/step-n2-t16.json
step pytest-fused 150 env PYTHONPATH=/tmp/site python3 -m pytest -rs -q tests/python/test_cuda_fused.py
grep -h "FAIL" $L/selftest-*.log | head -5 | cut -c1-200
for c in os-2 os-8 ts-2 ts-8 hs-2; do printf '%-5s ' $c; grep -hE '^[0-9]' $L/$c.log | awk '{printf "%sx%s ar %s a+n %s f %s | ", $1,$2,$6,$8,$9}'; echo; done
echo "== default"; grep -E '^[0-9]' $L/fused-default.log | cut -c1-150
for s in step-n8-t4 step-n2-t16; do echo "== $s"; grep -E "^(auto|one-shot|none)" $L/$s.log | cut -c1-130; done
printf '%s\n' "${summary[@]}"
tar czf $OUT/all.tgz -C $OUT r && rm -rf $R
