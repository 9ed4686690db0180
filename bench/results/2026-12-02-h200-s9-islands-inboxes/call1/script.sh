#!/bin/bash
# Ninth session, call 1: islands' per-unit island lookups hoisted + 32-bit share math (new)
# against efc3865 (old, .gpu/tpar-old); one-island diagnostics; ring poll knobs; selftests.
set -u
B=$PWD/target/release/tpar; O=$PWD/.gpu/tpar-old
R=$OUT/r; mkdir -p $R
export NCCL_NVLS_ENABLE=0
export TPAR_CACHE_DIR=/tmp/tpar-cache
run() { local name=$1; shift; local t0=$(date +%s%N); echo "== $name: $*" >> $R/log.txt; timeout 150 "$@" > $R/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( ($(date +%s%N) - t0) / 1000000 )) ms" | tee -a $R/log.txt; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
S=4K,32K,42K,64K
for v in old new old new; do X=$B; [ $v = old ] && X=$O
  run i8$v$SECONDS $X bench --backend cuda -n 8 --islands 4+4 --sizes $S --algos one-shot,islands --json $R/i8-$v-$SECONDS.json
done
for v in old new; do X=$B; [ $v = old ] && X=$O
  TPAR_ISLANDS_EXCHANGE=ranges run r8$v $X bench --backend cuda -n 8 --islands 4+4 --sizes 4K,64K,256K --algos islands --json $R/r8-$v.json
  run ts8$v $X bench --backend cuda -n 8 --sizes 64K,256K,1M --algos two-shot --json $R/ts8-$v.json
  run ts2$v $X bench --backend cuda -n 2 --sizes 4K,256K --algos two-shot,one-shot --json $R/ts2-$v.json
done
run one $B bench --backend cuda -n 8 --islands 8 --sizes 4K,32K --algos one-shot,islands --json $R/one.json
TPAR_KERNEL_DEFINES="-DTPAR_EXP_ONESHOT_BODY=1" run oneexp $B bench --backend cuda -n 8 --islands 8 --sizes 4K,32K --algos one-shot,islands --json $R/one-exp.json
TPAR_KERNEL_DEFINES="-DTPAR_ISLANDS_KERNEL=0" run onek0 $B bench --backend cuda -n 8 --islands 8 --sizes 4K,32K --algos one-shot,islands --json $R/one-k0.json
TPAR_KERNEL_DEFINES="-DTPAR_ISLANDS_KERNEL=0" run i8k0 $B bench --backend cuda -n 8 --islands 4+4 --sizes $S --algos one-shot,islands --json $R/i8-k0.json
run ring $B bench --backend cuda -n 8 --sizes 1M,4M --algos ring,two-shot --json $R/ring.json
TPAR_KERNEL_DEFINES="-DTPAR_DEVICE_FREE_POLLS=0" run ringfp0 $B bench --backend cuda -n 8 --sizes 1M,4M --algos ring,two-shot --json $R/ring-fp0.json
TPAR_KERNEL_DEFINES="-DTPAR_DEVICE_POLL_SLEEP_MAX_NS=2048 -DTPAR_DEVICE_FREE_POLLS=8" run ringsl $B bench --backend cuda -n 8 --sizes 1M,4M --algos ring,two-shot --json $R/ring-sl.json
run st8 $B selftest --backend cuda -n 8 --algos islands,two-shot,ring,islands-pull --counts 0,7,4099,65541,300001 --dtypes bf16,f32 --replays 3 --timeout 10
TPAR_ISLANDS_EXCHANGE=ranges run st8r $B selftest --backend cuda -n 8 --algos islands --counts 7,4099,65541,300001 --dtypes bf16,f16 --replays 3 --timeout 10
run st3 $B selftest --backend cuda -n 3 --algos islands,two-shot,ring --counts 7,4099,65541 --dtypes bf16 --replays 3 --timeout 10
TPAR_ISLANDS_CROSS=host run st8h $B selftest --backend cuda -n 8 --algos islands --counts 7,4099 --dtypes bf16 --replays 3 --no-timeout-case
python3 .gpu/summ.py $R/*.json > $OUT/summary.txt
grep rc= $R/log.txt >> $OUT/summary.txt
for f in st8 st8r st3 st8h; do echo "$f: $(grep -E 'passed|failed' $R/$f.txt | tail -1)"; grep -E " fail" $R/$f.txt | head -3; done >> $OUT/summary.txt
cd $OUT && tar czf call9.tgz r && rm -rf r
cat $OUT/summary.txt
