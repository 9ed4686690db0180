# Call 3: the dispatcher's crossover at 8 ranks sharing one GPU (sizes between 32 and 256 KiB),
# and the Python fused-op tests after the norm fix and the forced-algorithm fix, ranks sharing
# GPU 0 (processes, time-sliced) and one GPU per rank.
source .stage/d3/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $S/tpar-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/site
CUDA_VISIBLE_DEVICES=0 step crossover-8 90 $T bench --backend cuda -n 8 --algos one-shot,two-shot,auto --sizes 32K,40K,42K,48K,56K,64K,80K,96K,128K,160K,192K,256K --json $L/crossover-8.json
CUDA_VISIBLE_DEVICES=0 step crossover-4 60 $T bench --backend cuda -n 4 --algos one-shot,two-shot,auto --sizes 32K,64K,128K,256K,512K,1M --json $L/crossover-4.json
step pytest-fused-gpu-per-rank 120 python3 -m pytest -rs -v -s tests/python/test_cuda_fused.py -k "2 or errors"
CUDA_VISIBLE_DEVICES=0 step pytest-fused-shared 240 python3 -m pytest -rs -v -s tests/python/test_cuda_fused.py tests/python/test_cuda_threads.py
for f in crossover-8 crossover-4; do echo "== $f"; grep -vE '^\s*$|^\[' $L/$f.log | tail -40 | cut -c1-120; done
for f in pytest-fused-gpu-per-rank pytest-fused-shared; do echo "== $f"; grep -E "PASS|FAIL|SKIP|Error|passed|failed" $L/$f.log | tail -8 | cut -c1-250; done
printf '%s\n' "${summary[@]}"
(cd $OUT && tar czf results3.tar.gz logs && rm -rf logs)
