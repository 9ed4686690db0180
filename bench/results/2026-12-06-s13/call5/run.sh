#!/usr/bin/env bash
# Thirteenth session, call 5: the share split in 32-bit arithmetic (new4) against e959eba
# (new3): two-shot, ring, islands and the fused two-shot at 8 ranks as streams; selftests.
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
R=$OUT/r; mkdir -p $R
S=$R/summary.txt
B=.gpu/tpar-new3; N=.gpu/tpar-new4
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
run() { # name timeout cmd...
  local name=$1 t=$2; shift 2
  local start=$(date +%s)
  timeout $t "$@" > $R/$name.txt 2>&1; local rc=$?
  printf "%-28s rc=%-3s %4ss  %s\n" $name $rc $(( $(date +%s) - start )) "$(grep -ho '[0-9]* passed.*' $R/$name.txt | tail -1)" >> $S
}
run warm-base 120 $B bench --backend cuda -n 2 --islands 1+1 --sizes 4K --algos one-shot,islands,two-shot,ring --iters 5
run warm-new 120 $N bench --backend cuda -n 2 --islands 1+1 --sizes 4K --algos one-shot,islands,two-shot,ring --iters 5
for i in 1 2; do
  for b in base new; do
    bin=$B; [ $b = new ] && bin=$N
    run b8-$b-$i 90 $bin bench --backend cuda -n 8 --islands 4+4 --sizes 4K,16K,42K,64K,256K --algos one-shot,islands,two-shot --json $R/b8-$b-$i.json
    run r8-$b-$i 90 $bin bench --backend cuda -n 8 --sizes 256K,1M,4M --algos ring,two-shot --json $R/r8-$b-$i.json
    run b2-$b-$i 60 $bin bench --backend cuda -n 2 --sizes 4K,64K,256K,1M --algos two-shot --json $R/b2-$b-$i.json
    run f-$b-$i 60 $bin bench --backend cuda --fused --algos two-shot --json $R/f-$b-$i.json
  done
done
run st-all-8 200 $N selftest --backend cuda -n 8
left=$(( 570 - SECONDS ))
if [ $left -gt 30 ]; then run st-all-2 $left $N selftest --backend cuda -n 2; fi
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
    if cfg=='f':
        for r in d['rows']: rows[('fused2',r['world_size'],r['tokens'],r['variant'],v)].append(r['p50_us'])
    else:
        for r in d['results']: rows[(cfg,r['algo'],r['bytes'],v)].append(r.get('p50_us'))
for k in sorted(rows, key=str):
    print(*k, ' '.join('%.2f'%x for x in rows[k]))
PY
cat $OUT/summary.txt; cat $OUT/table.txt
