# Call 1: the Python fused-op GPU failure (variants), Python ranks as threads, and issue 17's
# bench before (603f51f) / after (cba4fcd) back to back.
source .stage/d1/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/d1/tpar-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/site PYTHONFAULTHANDLER=1
python3 $S/mkdiag.py
fx() { local name=$1; shift; local start=$SECONDS; env "$@" timeout -s ABRT 80 python3 -u $S/run_fused.py $W 2 > $L/$name.log 2>&1; echo "rc=$? ${SECONDS}-${start}s" >> $L/$name.log; summary+=("$(printf '%-22s %s' $name "$(grep -c 'gpu op done' $L/$name.log) ops done; $(grep -m1 -oE 'illegal memory access|FAIL[^:]*:[^;]{0,80}|ok eager' $L/$name.log)")"); }
W=tests/python/diag_worker.py
fx fused-diag X=1
fx fused-diag-blocking CUDA_LAUNCH_BLOCKING=1
fx fused-diag-nopdl TPAR_PDL=0
W=tests/python/cuda_fused_worker.py
fx fused-worker-nopdl TPAR_PDL=0
for n in 2 3; do step threads-create-$n 45 python3 -u $S/threads_create.py $n; done
for n in 2 8; do
  step bench-before-$n 60 $B bench --backend cuda -n $n --sizes 0,4K,32K,42K,256K,1M --json $L/bench-before-$n.json
  step bench-after-$n 60 $T bench --backend cuda -n $n --sizes 0,4K,32K,42K,256K,1M --json $L/bench-after-$n.json
  step bench-after-$n-b 60 $T bench --backend cuda -n $n --sizes 0,4K,32K,42K,256K,1M --json $L/bench-after-$n-b.json
  step bench-before-$n-b 60 $B bench --backend cuda -n $n --sizes 0,4K,32K,42K,256K,1M --json $L/bench-before-$n-b.json
done
for f in fused-diag fused-diag-blocking fused-diag-nopdl fused-worker-nopdl threads-create-2 threads-create-3; do echo "== $f"; tail -40 $L/$f.log | cut -c1-220; done
for f in bench-before-2 bench-after-2 bench-before-8 bench-after-8; do echo "== $f"; grep -vE '^\s*$|^\[' $L/$f.log | tail -9 | cut -c1-160; done
printf '%s\n' "${summary[@]}"
(cd $OUT && tar czf results1.tar.gz logs && rm -rf logs)
