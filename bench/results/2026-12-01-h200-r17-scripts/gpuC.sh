# Call C: the merged tree after the slim and safe branches (every harness GPU path now on safe
# spans): selftests (threads 2 and 8, processes 2), the span test binary, fused bench, anatomy,
# bench step with norms; then the Python fused op, one rank, case by case (diagnosis of call B).
source .stage/final/common.sh
sel="selftest --backend cuda --timeout 10"
step selftest-2 60 $T $sel -n 2
step selftest-8 60 $T $sel -n 8
step selftest-2-processes 90 $T $sel -n 2 --processes --counts 0,7,4099,65541 --replays 20
nvrtc=/usr/local/cuda-13.0/targets/x86_64-linux/lib
LD_LIBRARY_PATH=$nvrtc step spans 60 $S/cuda_spans --test-threads=1
step bench-fused 60 $T bench --fused --json $L/bench-fused.json
step bench-after-2 40 $T bench --backend cuda -n 2 --sizes 0,4K,32K,42K,256K,1M --json $L/bench-after-2.json
step anatomy-2 40 $T bench --anatomy -n 2 --json $L/anatomy-2.json
step step-llama-tp8 60 $T bench step --config $models/llama-3.1-70b.json -n 8 --tokens 4 --algos auto,one-shot --json $L/step-llama-tp8.json
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ci/wheels/tpar-*.whl > $L/pip.log 2>&1
PYTHONPATH=/tmp/site CUDA_LAUNCH_BLOCKING=1 step tiny-fused 60 python3 -u $S/tiny_fused.py
san=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
[ -n "$san" ] && PYTHONPATH=/tmp/site step tiny-fused-sanitizer 90 $san --tool memcheck --print-limit 5 python3 -u $S/tiny_fused.py
echo "== tiny-fused"; tail -20 $L/tiny-fused.log | cut -c1-220
echo "== sanitizer"; grep -vE '^\s*$' $L/tiny-fused-sanitizer.log 2>/dev/null | head -40 | cut -c1-220
echo "== bench-fused"; tail -7 $L/bench-fused.log | cut -c1-160
echo "== step"; tail -8 $L/step-llama-tp8.log | cut -c1-200
printf '%s\n' "${summary[@]}"
(cd $OUT && tar czf resultsC.tar.gz logs && rm -rf logs)
