# Call A: the merged main's CUDA paths: selftests (fused rows included), fused bench,
# before/after bench, and the engine-grade communicator checks (issue 12).
source .stage/final/common.sh
step selftest-8 150 $T selftest --backend cuda -n 8 --timeout 10
step selftest-2 100 $T selftest --backend cuda -n 2 --timeout 10
step selftest-4-processes 150 $T selftest --backend cuda -n 4 --processes --timeout 10
step bench-fused 100 $T bench --fused --json $L/bench-fused.json
for n in 2 8; do
  step bench-before-$n 60 $B bench --backend cuda -n $n --sizes 0,4K,32K,42K,256K,1M --json $L/bench-before-$n.json
  step bench-after-$n 60 $T bench --backend cuda -n $n --sizes 0,4K,32K,42K,256K,1M --json $L/bench-after-$n.json
done
timeout 330 bash scripts/gpu-check.sh engine-comm > $L/engine-comm-mode.log 2>&1; echo "engine-comm mode rc=$?" >> $L/engine-comm-mode.log
cp /tmp/gpu-out/engine-comm/*.log /tmp/gpu-out/engine-comm/*.json $L/ 2>/dev/null
for f in bench-before-2 bench-after-2 bench-before-8 bench-after-8 bench-fused; do echo "== $f"; grep -vE '^\s*$' $L/$f.log | tail -14 | cut -c1-150; done
echo "== engine-comm"; tail -45 $L/engine-comm-mode.log | cut -c1-160
printf '%s\n' "${summary[@]}"
(cd $OUT && tar czf resultsA.tar.gz logs && rm -rf logs)
