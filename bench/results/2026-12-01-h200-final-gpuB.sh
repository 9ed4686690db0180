# Call B: tpar.engines under the engines' calling sequence (issue 13), the Python CUDA tests,
# and bench/peers.py at world size 1 (issue 18's peers, one GPU).
source .stage/final/common.sh
timeout 400 bash scripts/gpu-check.sh engines > $L/engines-mode.log 2>&1; echo "engines mode rc=$?" >> $L/engines-mode.log
cp -r /tmp/gpu-out/engines $L/engines 2>/dev/null
step peers-1 90 python3 bench/peers.py -n 1 --sizes 4K,32K,256K,1M --replays 20 --json $L/peers-1.json
PYTHONPATH=/tmp/site step python-cuda 150 python3 -m pytest -x -q -rs tests/python/test_cuda_allreduce.py -k "not 8"
echo "== engines"; tail -60 $L/engines-mode.log | cut -c1-160
echo "== peers"; tail -20 $L/peers-1.log | cut -c1-160
echo "== python-cuda"; tail -8 $L/python-cuda.log | cut -c1-160
printf '%s\n' "${summary[@]}"
(cd $OUT && tar czf resultsB.tar.gz logs && rm -rf logs)
