#!/usr/bin/env bash
# Thirteenth session, call 3: the islands kernels with the island tables in their arguments
# (new2) against call 1's tree (new: the partition counted over the ranks at each lookup);
# new2 also with the island view taken before pdl_wait (-DTPAR_EXP_VIEW_EARLY=1). 8 ranks
# as streams 4+4 and one island, 4 ranks 2+2, 2 ranks 1+1; bf16. Selftests of the islands
# algorithms (new2).
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
R=$OUT/r; mkdir -p $R
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
run() { # name timeout cmd...
  local name=$1 t=$2; shift 2
  local start=$(date +%s)
  timeout $t "$@" > $R/$name.txt 2>&1; local rc=$?
  printf "%-28s rc=%-3s %4ss  %s\n" $name $rc $(( $(date +%s) - start )) "$(grep -ho '[0-9]* passed.*' $R/$name.txt | tail -1)" >> $S
}
variant() { # name -> sets BIN and TPAR_KERNEL_DEFINES
  case $1 in
    new) BIN=.gpu/tpar-new; export TPAR_KERNEL_DEFINES="";;
    tables) BIN=.gpu/tpar-new2; export TPAR_KERNEL_DEFINES="";;
    early) BIN=.gpu/tpar-new2; export TPAR_KERNEL_DEFINES="-DTPAR_EXP_VIEW_EARLY=1";;
  esac
}
for v in new tables early; do variant $v; run warm-$v 120 $BIN bench --backend cuda -n 2 --islands 1+1 --sizes 4K --algos islands,islands-pull,one-shot --iters 5; done
for i in 1 2; do
  for v in new tables early; do
    variant $v
    run b8-$v-$i 60 $BIN bench --backend cuda -n 8 --islands 4+4 --sizes 4K,8K,16K,64K --algos islands,one-shot --json $R/b8-$v-$i.json
    run b8one-$v-$i 60 $BIN bench --backend cuda -n 8 --islands 8 --sizes 4K,16K --algos islands --json $R/b8one-$v-$i.json
    run b4-$v-$i 60 $BIN bench --backend cuda -n 4 --islands 2+2 --sizes 4K,16K,64K --algos islands --json $R/b4-$v-$i.json
    run b2-$v-$i 60 $BIN bench --backend cuda -n 2 --islands 1+1 --sizes 4K,16K --algos islands --json $R/b2-$v-$i.json
  done
done
variant tables
run st-isl-8 150 .gpu/tpar-new2 selftest --backend cuda -n 8 --algos islands,islands-pull
run st-isl-3 100 .gpu/tpar-new2 selftest --backend cuda -n 3 --algos islands,islands-pull
cp $S $OUT/summary.txt
cd $OUT && tar czf r.tgz r && rm -rf r
python3 - <<'PY' > $OUT/table.txt
import json,os,collections,tarfile
t=tarfile.open(os.environ['OUT']+'/r.tgz')
rows=collections.defaultdict(list)
for m in t.getmembers():
    n=os.path.basename(m.name)
    if not n.endswith('.json'): continue
    d=json.load(t.extractfile(m))
    cfg,v,i=n[:-5].split('-')
    for r in d['results']:
        rows[(cfg,r['algo'],r['bytes'],v)].append(r.get('p50_us'))
for k in sorted(rows, key=str):
    print(*k, ' '.join('%.2f'%x for x in rows[k]))
PY
cat $OUT/summary.txt; cat $OUT/table.txt
