# Session 5, call 1 (one H200): the checks of the commits that never ran on a GPU (ca0fa32,
# f4a6aee, 2987f8a, 4527420 at 4527420): selftests, span tests, Python CUDA tests, SGLang's
# CUDA fusion path; then token sweeps of the fused op per algorithm for the plan's choices
# (one-shot and two-shot at 2 and 8 ranks, host-staged at 2). bash .stage/s5a/run.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TPAR_CACHE_DIR=/tmp/tpar-cache
S=.stage/s5a; T=$S/tpar
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
step cuda-spans 60 $S/cuda_spans --test-threads 1
step fused-oneshot 40 $T bench --fused --json $R/bench-fused-oneshot.json
step sweep-os-2 40 $T bench --fused -n 2 --algos one-shot --tokens 1,2,4,8,16,32 --json $R/sweep-os-2.json
step sweep-ts-2 40 $T bench --fused -n 2 --algos two-shot --tokens 1,2,4,8,16,32 --json $R/sweep-ts-2.json
step sweep-os-8 40 $T bench --fused -n 8 --algos one-shot --tokens 1,2,4,8,16,32 --json $R/sweep-os-8.json
step sweep-ts-8 40 $T bench --fused -n 8 --algos two-shot --tokens 1,2,4,8,16,32 --json $R/sweep-ts-8.json
step sweep-hs-2 60 $T bench --fused -n 2 --algos host-staged --tokens 1,2,4,8,16,32 --json $R/sweep-hs-2.json
step pytest-cuda 200 env PYTHONPATH=/tmp/site python3 -m pytest -rs -q tests/python/test_cuda_fused.py tests/python/test_cuda_threads.py
python3 -m pip install -q --no-index --no-deps --target /tmp/sglang-site .ci/engines-gpu/deps/*.whl > /dev/null 2>&1
python3 -m zipfile -e .ci/engines-gpu/sglang-0.5.23-src.zip /tmp/sglang-src
step sglang-fusion 150 env OUT=$R PYTHONPATH=/tmp/site:/tmp/sglang-site:/tmp/sglang-src CUDA_VISIBLE_DEVICES=0 python3 scripts/gpu_sglang_fusion.py --sglang /tmp/sglang-src
echo "== fused rows per algorithm (selftest -n 2 / -n 8)"; for f in selftest-2 selftest-8; do for a in one-shot two-shot one-shot-pull host-staged; do printf '%s %-14s %s rows, %s fused\n' $f $a "$(grep -c "^fused $a " $L/$f.log)" "$(grep "^fused $a " $L/$f.log | grep -c '(fused)')"; done; done
grep -h "FAIL" $L/selftest-*.log | head -5 | cut -c1-200
for f in fused-oneshot sweep-os-2 sweep-ts-2 sweep-os-8 sweep-ts-8 sweep-hs-2; do echo "== $f"; grep -E '^[0-9]' $L/$f.log | cut -c1-150; done
echo "== sglang"; tail -6 $L/sglang-fusion.log | cut -c1-170
printf '%s\n' "${summary[@]}"
tar czf $OUT/all.tgz -C $OUT r && rm -rf $R
