# Call D: the Python fused op's CUDA tests on the merged tree (0e28fc3's wheel), 2 ranks
# sharing GPU 0 (call B, on an earlier merge, faulted in its first case).
source .stage/final/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ci/wheels/tpar-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/site TPAR_TEST_LOGS=$L/ranks PYTHONFAULTHANDLER=1
CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 200 python3 -u -m pytest -rs -v -s tests/python/test_cuda_fused.py -k "not [4]" > $L/pytest-cuda-fused.log 2>&1; echo "rc=$?" >> $L/pytest-cuda-fused.log
grep -E "PASS|FAIL|passed|failed|Error|rc=" $L/pytest-cuda-fused.log | tail -15 | cut -c1-230
for f in $L/ranks/*; do echo "-- $f"; grep -vE "RuntimeWarning|with tpar.Comm" $f | tail -6 | cut -c1-230; done 2>/dev/null | tail -60
(cd $OUT && tar czf resultsD.tar.gz logs && rm -rf logs)
