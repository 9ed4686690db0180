# Session 5, call 7 (one H200): bench step Llama-3.1-70B TP 8 (8 ranks sharing the GPU, 4
# tokens) with main (cfb5062: fused PDL only with a row a block), tpar-g (the same with
# 4527420's PDL rule) and 4527420, alternated; and the same at 1 and 16 tokens.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/r; L=$R/logs; mkdir -p $L
M=".stage/s5f/tpar"; G=".stage/s5e/tpar-g"; B=".stage/s5a/tpar"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } > $L/device.txt
run() { local who=$1 bin=$2 tok=$3 n=$4; TPAR_CACHE_DIR=/tmp/tpar-cache-$who timeout 120 $bin bench step --config crates/tpar/fixtures/models/llama-3.1-70b.json -n $n --tokens $tok --algos auto --json $R/step-$who-n$n-t$tok.json > $L/step-$who-n$n-t$tok.log 2>&1; printf '%-5s n%s t%-3s ' $who $n $tok; grep -E "^auto" $L/step-$who-n$n-t$tok.log | awk '{printf "%s %s %s | ", $(NF-5), $(NF-4), $NF}'; echo; }
for rep in 1 2; do for who in main g base; do case $who in main) b=$M;; g) b=$G;; base) b=$B;; esac; run $who $b 4 8; done; done
for who in main g base; do case $who in main) b=$M;; g) b=$G;; base) b=$B;; esac; run $who $b 1 8; run $who $b 16 2; run $who $b 4 2; done
tar czf $OUT/all.tgz -C $OUT r && rm -rf $R
