# Call A: the merged main's CUDA paths (issues 15, 17): selftests (every algorithm, fused rows,
# threads and processes), the span API test binary, bench before (603f51f) and after back to
# back, the fused bench, bench step with norms, anatomy, doctor and tune.
source .stage/final/common.sh
sel="selftest --backend cuda --timeout 10"
step selftest-2 100 $T $sel -n 2
step selftest-8 150 $T $sel -n 8
step selftest-4-processes 150 $T $sel -n 4 --processes --counts 0,7,4099,65541 --replays 20
nvrtc=$(dirname "$(ls /usr/local/cuda-13.0/targets/x86_64-linux/lib/libnvrtc.so.1* | head -1)")
LD_LIBRARY_PATH=$nvrtc step spans 60 $S/cuda_spans --test-threads=1
for n in 2 8; do
  step bench-before-$n 60 $B bench --backend cuda -n $n --sizes 0,4K,32K,42K,256K,1M --json $L/bench-before-$n.json
  step bench-after-$n 60 $T bench --backend cuda -n $n --sizes 0,4K,32K,42K,256K,1M --json $L/bench-after-$n.json
  step bench-after-$n-b 60 $T bench --backend cuda -n $n --sizes 0,4K,32K,42K,256K,1M --json $L/bench-after-$n-b.json
  step bench-before-$n-b 60 $B bench --backend cuda -n $n --sizes 0,4K,32K,42K,256K,1M --json $L/bench-before-$n-b.json
done
step bench-fused 100 $T bench --fused --json $L/bench-fused.json
step step-llama-tp8 150 $T bench step --config $models/llama-3.1-70b.json -n 8 --tokens 4 --algos auto,one-shot --json $L/step-llama-tp8.json
step anatomy-2 40 $T bench --anatomy -n 2 --json $L/anatomy-2.json
step doctor 30 $T doctor
for f in bench-before-2 bench-after-2 bench-before-8 bench-after-8 bench-fused step-llama-tp8; do echo "== $f"; grep -vE '^\s*$|^\[' $L/$f.log | tail -12 | cut -c1-160; done
printf '%s\n' "${summary[@]}"
(cd $OUT && tar czf resultsA.tar.gz logs && rm -rf logs)
