# Diagnose the fused op from Python hanging on the GPU (call B: pytest-cuda-fused and
# gpu_fused_py.py both ran into their time limits with no output).
source .stage/final/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ci/wheels/tpar-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/site TPAR_TEST_LOGS=$L/ranks PYTHONFAULTHANDLER=1
CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 45 python3 -u scripts/gpu_fused_py.py --world-size 2 --tokens 1 > $L/fused-py.log 2>&1; echo "rc=$?" >> $L/fused-py.log
CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 70 python3 -u -m pytest -x -s -v tests/python/test_cuda_fused.py -k "not [4]" > $L/pytest-fused.log 2>&1; echo "rc=$?" >> $L/pytest-fused.log
echo "== fused-py"; head -c 6000 $L/fused-py.log
echo "== pytest-fused"; tail -c 5000 $L/pytest-fused.log
echo "== ranks"; for f in $L/ranks/*; do echo "-- $f"; tail -c 1500 $f; done 2>/dev/null | tail -c 5000
(cd $OUT && tar czf diag.tar.gz logs && rm -rf logs)
