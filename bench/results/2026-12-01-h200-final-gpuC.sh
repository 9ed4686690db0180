# Call C: after the footprint (2 MiB pages), rendezvous-record and test fixes: the engine-comm
# checks again, and the selftests that create CUDA communicators across processes.
source .stage/final/common.sh
timeout 300 bash scripts/gpu-check.sh engine-comm > $L/engine-comm-mode.log 2>&1; echo "engine-comm mode rc=$?" >> $L/engine-comm-mode.log
cp /tmp/gpu-out/engine-comm/*.log /tmp/gpu-out/engine-comm/*.json $L/ 2>/dev/null
step selftest-4-processes 150 $T selftest --backend cuda -n 4 --processes --timeout 10
step selftest-8 120 $T selftest --backend cuda -n 8 --timeout 10
echo "== engine-comm"; tail -22 $L/engine-comm-mode.log | cut -c1-170
printf '%s\n' "${summary[@]}"
(cd $OUT && tar czf resultsC.tar.gz logs && rm -rf logs)
