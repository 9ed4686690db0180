# Session 17, call 1: main (.ci/gpu/COMMIT) against issues 25 and 26's targets on one GPU, and
# the bench's auto with its first-use measurement (b8 measures and caches it, b8auto reads it).
# BUDGET (seconds, from the caller): a run whose limit would pass it is skipped, so that
# `finish` always packs what ran.
source scripts/gpu-compare.sh
T=.ci/gpu/tpar
BUDGET=${BUDGET:-560}
cat .ci/gpu/COMMIT >> "$SUMMARY"
go() { # NAME LIMIT CMD...: run, unless its limit would pass BUDGET
  if [ $((SECONDS + $2)) -le "$BUDGET" ]; then run "$@"; else echo "$1 skipped: budget" >> "$SUMMARY"; fi
}
go b8 110 $T bench --backend cuda -n 8 --islands 4+4 --sizes 4K,16K,32K,42K,64K --algos one-shot,two-shot,staged,islands,auto --json $R/b8-main-1.json
go b8auto 40 $T bench --backend cuda -n 8 --sizes 4K,16K,32K,42K,64K,256K --algos auto --json $R/b8-main-2.json
go b2 50 $T bench --backend cuda -n 2 --sizes 0,4K,32K,42K,256K --algos one-shot,host-staged,auto --json $R/b2-main.json
go fused2 50 $T bench --fused -n 2 --tokens 1,2,4,8 --json $R/fused2-main.json
go fused8 50 $T bench --fused -n 8 --tokens 1,2,8 --json $R/fused8-main.json
go ring8 50 $T bench --backend cuda -n 8 --sizes 1M,2M,4M --algos two-shot,ring --json $R/ring8-main.json
go b8again 110 $T bench --backend cuda -n 8 --islands 4+4 --sizes 4K,16K,32K,42K,64K --algos one-shot,two-shot,staged,islands --json $R/b8-main-3.json
finish
