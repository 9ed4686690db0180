#!/usr/bin/env bash
# Thirteenth session, call 2: where islands' time at 4 KiB goes (8 ranks as streams, 4+4, bf16):
# block shapes, one island (the islands kernel as one-shot), 1+1 (the exchange alone), one-shot
# at 4 ranks (the inside step alone); and a passed-over allreduce table (the communicator's
# warning). new = the working tree.
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
R=$OUT/r; mkdir -p $R
S=$R/summary.txt
N=.gpu/tpar-new
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
run() { # name timeout cmd...
  local name=$1 t=$2; shift 2
  local start=$(date +%s)
  timeout $t "$@" > $R/$name.txt 2>&1; local rc=$?
  printf "%-28s rc=%-3s %4ss  %s\n" $name $rc $(( $(date +%s) - start )) "$(grep -ho '[0-9]* passed.*' $R/$name.txt | tail -1)" >> $S
}
run warm 120 $N bench --backend cuda -n 2 --sizes 4K --algos one-shot,islands,two-shot --iters 5
for i in 1 2; do
  for t in 64 128 256 512; do
    TPAR_MIN_BLOCK_THREADS=$t run isl-t$t-$i 60 $N bench --backend cuda -n 8 --islands 4+4 --sizes 4K,8K,16K --algos islands,one-shot,two-shot --json $R/isl-t$t-$i.json
  done
  run isl-one-$i 60 $N bench --backend cuda -n 8 --islands 8 --sizes 4K,8K,16K --algos islands,one-shot --json $R/isl-one-$i.json
  run isl-2x4-$i 60 $N bench --backend cuda -n 8 --islands 2+2+2+2 --sizes 4K,8K,16K --algos islands --json $R/isl-2x4-$i.json
  run isl-n2-$i 60 $N bench --backend cuda -n 2 --islands 1+1 --sizes 4K,8K,16K --algos islands,one-shot,two-shot --json $R/isl-n2-$i.json
  run isl-n4-$i 60 $N bench --backend cuda -n 4 --islands 2+2 --sizes 4K,8K,16K --algos islands,one-shot,two-shot --json $R/isl-n4-$i.json
done
export TPAR_CACHE_DIR=$R/cache
run tune-2 120 $N tune -n 2 --sizes 4K,64K --iters 10
for T in $R/cache/tuning/*.json; do
python3 - "$T" <<'PY'
import json,sys
p=sys.argv[1]; d=json.load(open(p)); d['kernels']='tpar 0.0.0 0000000000000000'; json.dump(d,open(p,'w'))
PY
done
RUST_LOG=warn run stale-bench 60 $N bench --backend cuda -n 2 --sizes 4K --algos auto
run stale-doctor 60 $N doctor -n 2
grep -i 'tuning\|table' $R/stale-bench.txt | head -5 >> $S
grep -i 'ignored\|not read\|table' $R/stale-doctor.txt | head -5 >> $S
unset TPAR_CACHE_DIR
cp $S $OUT/summary.txt
cd $OUT && tar czf r.tgz r && rm -rf r
python3 - <<'PY' > $OUT/table.txt
import json,os,collections,tarfile
t=tarfile.open(os.environ['OUT']+'/r.tgz')
rows=collections.defaultdict(list)
for m in t.getmembers():
    n=os.path.basename(m.name)
    if not n.endswith('.json') or not n.startswith('isl-'): continue
    d=json.load(t.extractfile(m))
    cfg=n[:-5].rsplit('-',1)[0]
    for r in d['results']:
        l=r.get('launch') or {}
        rows[(cfg,r['algo'],r['bytes'],'%sx%s%s'%(l.get('grid'),l.get('block'),' pdl' if l.get('pdl') else ''))].append(r.get('p50_us'))
for k in sorted(rows, key=str):
    print(*k, ' '.join('%.2f'%v for v in rows[k]))
PY
cat $OUT/summary.txt; cat $OUT/table.txt
