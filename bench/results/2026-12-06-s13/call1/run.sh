#!/usr/bin/env bash
# Thirteenth session, call 1: the kernels' shared prologues (input_units, publish_input,
# island_view, norm_row) and the fused rows' launch shape; base = ab93ade, new = the working
# tree. Also the host code of the twelfth session that had not run on a GPU (the unfused
# allreduce + norm's predecessor, PDL decided in the update, the passed-over table warning).
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
R=$OUT/r; mkdir -p $R
S=$R/summary.txt
B=.gpu/tpar-base; N=.gpu/tpar-new
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
run() { # name timeout cmd...
  local name=$1 t=$2; shift 2
  local start=$(date +%s)
  timeout $t "$@" > $R/$name.txt 2>&1; local rc=$?
  printf "%-28s rc=%-3s %4ss  %s\n" $name $rc $(( $(date +%s) - start )) "$(grep -ho '[0-9]* passed.*' $R/$name.txt | tail -1)" >> $S
}
# Compile both binaries' kernels first (cache), so no timed run pays NVRTC.
run warm-base 120 $B bench --backend cuda -n 2 --sizes 4K --algos one-shot,staged,islands,two-shot,one-shot-pull,staged-pull,islands-pull,ring --iters 5
run warm-new 120 $N bench --backend cuda -n 2 --sizes 4K --algos one-shot,staged,islands,two-shot,one-shot-pull,staged-pull,islands-pull,ring --iters 5
for i in 1 2; do
  for b in base new; do
    bin=$B; [ $b = new ] && bin=$N
    run bench-$b-8isl-$i 90 $bin bench --backend cuda -n 8 --islands 4+4 --sizes 4K,8K,16K,32K,42K,64K --algos one-shot,staged,islands,two-shot --json $R/bench-$b-8isl-$i.json
    run bench-$b-2-$i 60 $bin bench --backend cuda -n 2 --sizes 0,4K,32K,42K,256K --algos one-shot,one-shot-pull,staged-pull,islands-pull --json $R/bench-$b-2-$i.json
    run fused-$b-$i 120 $bin bench --backend cuda --fused --json $R/fused-$b-$i.json
  done
done
run bench-new-ring 90 $N bench --backend cuda -n 8 --sizes 1M,4M --algos ring,two-shot --json $R/bench-new-ring.json
# A passed-over tune table: written by this build, its kernels id then changed by hand.
export TPAR_CACHE_DIR=$R/cache
run tune-2 120 $N tune -n 2 --sizes 4K,64K --iters 10
T=$(grep -rl '"kernels"' $R/cache | grep -v kernels/ | head -1); echo "table: $T" >> $S
python3 - "$T" <<'PY'
import json,sys
p=sys.argv[1]; d=json.load(open(p)); d['kernels']='tpar 0.0.0 0000000000000000'; json.dump(d,open(p,'w'))
PY
run stale-bench 60 $N bench --backend cuda -n 2 --sizes 4K --algos auto
run stale-doctor 60 $N doctor
grep -i 'tuning\|table' $R/stale-bench.txt | head -5 >> $S
grep -i 'ignored\|passed over\|table' $R/stale-doctor.txt | head -5 >> $S
unset TPAR_CACHE_DIR
left=$(( 570 - SECONDS ))
if [ $left -gt 60 ]; then run st-all-8 $left $N selftest --backend cuda -n 8; else echo "st-all-8 skipped: ${SECONDS}s used" >> $S; fi
left=$(( 585 - SECONDS ))
if [ $left -gt 25 ]; then run st-all-2 $left $N selftest --backend cuda -n 2; else echo "st-all-2 skipped" >> $S; fi
cp $S $OUT/summary.txt; tail -8 $R/fused-new-1.txt > $OUT/fused.txt 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
python3 - <<'PY' > $OUT/table.txt
import json,os,collections,tarfile
t=tarfile.open(os.environ['OUT']+'/r.tgz')
rows=collections.defaultdict(list)
for m in t.getmembers():
    n=os.path.basename(m.name)
    if not n.endswith('.json') or not (n.startswith('bench-') or n.startswith('fused-')): continue
    d=json.load(t.extractfile(m))
    parts=n[:-5].split('-')
    if parts[0]=='fused':
        for r in d['rows']:
            rows[('fused',r['world_size'],r['tokens'],r['variant'],parts[1])].append(r['p50_us'])
    else:
        for r in d['results']:
            rows[(parts[2],r['algo'],r['bytes'],parts[1])].append(r.get('p50_us'))
for k in sorted(rows, key=str):
    print(*k, ' '.join('%.2f'%v if v is not None else '-' for v in rows[k]))
PY
cat $OUT/summary.txt; cat $OUT/table.txt
