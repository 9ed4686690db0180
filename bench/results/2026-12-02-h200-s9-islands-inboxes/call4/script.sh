#!/bin/bash
# Ninth session, call 4: HEAD islands.cu with lines' inboxes resolved per pair by the host (send_inbox/recv_inbox),
# islands.cu as at efc3865; cold-step variants; against efc3865 (old).
set -u
B=$PWD/target/release/tpar; O=$PWD/.gpu/tpar-old
R=$OUT/r; mkdir -p $R
export NCCL_NVLS_ENABLE=0
export TPAR_CACHE_DIR=/tmp/tpar-cache
run() { local name=$1; shift; local t0=$(date +%s%N); echo "== $name: $*" >> $R/log.txt; timeout 150 "$@" > $R/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( ($(date +%s%N) - t0) / 1000000 )) ms" | tee -a $R/log.txt; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
S=4K,32K,42K,64K
V1="-DTPAR_COLD_INLINE=1"; V2="-DTPAR_COLD_INLINE=1 -DTPAR_WAIT_SITE_PER_GROUP=1"
for rep in a b; do
  run i8old$rep $O bench --backend cuda -n 8 --islands 4+4 --sizes $S --algos one-shot,islands --json $R/i8-old-$rep.json
  run i8new$rep $B bench --backend cuda -n 8 --islands 4+4 --sizes $S --algos one-shot,islands --json $R/i8-new-$rep.json
  TPAR_KERNEL_DEFINES="$V1" run i8v1$rep $B bench --backend cuda -n 8 --islands 4+4 --sizes $S --algos one-shot,islands --json $R/i8-v1-$rep.json
done
for v in old new v1; do X=$B; D=""; [ $v = old ] && X=$O; [ $v = v1 ] && D="$V1"; [ $v = v2 ] && D="$V2"
  TPAR_KERNEL_DEFINES="$D" run one$v $X bench --backend cuda -n 8 --islands 8 --sizes 4K,32K --algos one-shot,islands --json $R/one-$v.json
  TPAR_KERNEL_DEFINES="$D" TPAR_ISLANDS_EXCHANGE=ranges run r8$v $X bench --backend cuda -n 8 --islands 4+4 --sizes 4K,64K,256K --algos islands --json $R/r8-$v.json
  TPAR_KERNEL_DEFINES="$D" run two$v $X bench --backend cuda -n 4 --islands 2+2 --sizes 4K,42K --algos one-shot,islands --json $R/two-$v.json
done
run st8 $B selftest --backend cuda -n 8 --algos islands,staged,one-shot --counts 0,7,4099,65541 --dtypes bf16,f32 --replays 3 --timeout 10
TPAR_ISLANDS_EXCHANGE=ranges run st8r $B selftest --backend cuda -n 8 --algos islands --counts 7,4099,65541,300001 --dtypes bf16,f16 --replays 3 --timeout 10
TPAR_ISLANDS_CROSS=host run st8h $B selftest --backend cuda -n 8 --algos islands --counts 7,4099,65541 --dtypes bf16,f32 --replays 3 --no-timeout-case
TPAR_ISLANDS_CROSS=host TPAR_ISLANDS_EXCHANGE=ranges run st8hr $B selftest --backend cuda -n 8 --algos islands --counts 7,4099,65541 --dtypes bf16 --replays 3 --no-timeout-case
TPAR_ISLANDS_CROSS=host run st4p $B selftest --backend cuda -n 4 --processes --algos islands,staged,one-shot --counts 7,4099,65541 --dtypes bf16 --replays 3 --timeout 10
run st3 $B selftest --backend cuda -n 3 --algos islands --counts 7,4099,65541 --dtypes bf16 --replays 3 --timeout 10
python3 .gpu/summ.py $R/*.json > $OUT/summary.txt
grep rc= $R/log.txt >> $OUT/summary.txt
for f in st8 st8r st8h st8hr st4p st3; do echo "$f: $(grep -E 'passed|failed' $R/$f.txt | tail -1)"; grep -E " fail" $R/$f.txt | head -3; done >> $OUT/summary.txt
cd $OUT && tar czf call12.tgz r && rm -rf r
cat $OUT/summary.txt
