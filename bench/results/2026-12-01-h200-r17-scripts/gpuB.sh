# Call B: the Python package on the GPU (wheel of the merged main): the fused op's CUDA tests and
# timing, the harness from Python, the allreduce's CUDA tests (the one call path), and the
# engine-grade communicator checks (issue 12) again after the refactor.
source .stage/final/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ci/wheels/tpar-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/site TPAR_TEST_LOGS=$L/ranks
CUDA_VISIBLE_DEVICES=0 step pytest-cuda-fused 170 python3 -m pytest -rs -q tests/python/test_cuda_fused.py -k "not [4]"
OUT=$L CUDA_VISIBLE_DEVICES=0 step fused-py-timing 60 python3 scripts/gpu_fused_py.py --world-size 2
CUDA_VISIBLE_DEVICES=0 step pytest-harness 60 python3 -m pytest -rs -q tests/python/test_harness.py
CUDA_VISIBLE_DEVICES=0 step pytest-cuda-allreduce 150 python3 -m pytest -rs -q tests/python/test_cuda_allreduce.py
unset PYTHONPATH
timeout 200 bash scripts/gpu-check.sh engine-comm > $L/engine-comm-mode.log 2>&1; echo "engine-comm mode rc=$?" >> $L/engine-comm-mode.log
cp /tmp/gpu-out/engine-comm/*.log /tmp/gpu-out/engine-comm/*.json $L/ 2>/dev/null
echo "== fused-py-timing"; grep -vE '^\s*$' $L/fused-py-timing.log | tail -14 | cut -c1-160
echo "== engine-comm"; tail -30 $L/engine-comm-mode.log | cut -c1-160
printf '%s\n' "${summary[@]}"
(cd $OUT && tar czf resultsB.tar.gz logs && rm -rf logs)
