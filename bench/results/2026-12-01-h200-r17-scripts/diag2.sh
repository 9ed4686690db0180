source .stage/final/common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ci/wheels/tpar-*.whl > $L/pip.log 2>&1
export PYTHONPATH=/tmp/site
run2() { # name, prefix...
  local name=$1; shift; local d=$(mktemp -d); local tok=$(head -c8 /dev/urandom | od -An -tx1 | tr -d ' \n')
  for r in 0 1; do CUDA_LAUNCH_BLOCKING=1 timeout 100 "$@" python3 -u $S/tiny2_fused.py $r $d/rdv $tok > $L/$name-$r.log 2>&1 & done; wait
  for r in 0 1; do echo "== $name rank $r"; grep -vE '^\s*$|RuntimeWarning|comm = tpar' $L/$name-$r.log | head -30 | cut -c1-230; done
}
run2 plain
san=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
run2 sanitizer $san --tool memcheck --print-limit 4
(cd $OUT && tar czf diag2.tar.gz logs && rm -rf logs)
