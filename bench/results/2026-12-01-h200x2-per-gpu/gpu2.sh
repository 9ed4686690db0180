# Call 2 (nvidia-h200-x2): the first figures with one GPU per rank (2 ranks), against NCCL in the
# same runs; the Python fused op (the norm fix) and the threads refusal; bench step per GPU.
source .stage/d2/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $S/tpar-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/site
nvidia-smi topo -m > $L/topo.txt 2>&1; nvidia-smi -L >> $L/device.txt
step doctor 60 $T doctor
$T doctor --json > $L/doctor.json 2>/dev/null
step selftest-2-processes 150 $T selftest --backend cuda -n 2 --processes --counts 0,7,4099,65541 --replays 20
step selftest-2-threads 100 $T selftest --backend cuda -n 2 --counts 0,7,4099,65541 --replays 20
step bench-2-processes 150 $T bench --backend cuda -n 2 --processes --algos one-shot,two-shot,one-shot-pull,host-staged,nccl,auto --sizes 1K,4K,16K,32K,42K,64K,256K,1M,4M,16M --iters 30 --json $L/bench-2-processes.json --plot $L/bench-2-processes.svg
step step-llama-tp2 120 $T bench step --config $models/llama-3.1-70b.json --tp 2 --tokens 4 --algos nccl,auto,one-shot --processes --json $L/step-llama-tp2.json
step pytest-fused-gpu-per-rank 150 python3 -m pytest -rs -v -s tests/python/test_cuda_fused.py tests/python/test_cuda_threads.py -k "2 or errors or threads"
OUT=$L step fused-py-timing 90 python3 scripts/gpu_fused_py.py --world-size 2
for f in bench-2-processes step-llama-tp2 fused-py-timing; do echo "== $f"; grep -vE '^\s*$|^\[' $L/$f.log | tail -24 | cut -c1-200; done
echo "== pytest"; grep -E "PASS|FAIL|SKIP|Error|passed|failed" $L/pytest-fused-gpu-per-rank.log | tail -12 | cut -c1-250
cat $L/topo.txt | head -8
printf '%s\n' "${summary[@]}"
(cd $OUT && tar czf results2.tar.gz logs && rm -rf logs)
