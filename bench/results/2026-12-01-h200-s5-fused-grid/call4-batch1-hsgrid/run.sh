# Session 5, call 4 (one H200): (a) the batched body with its batch fixed at 1 at compile time
# (TPAR_X_BATCH1) against the unbatched body (TPAR_X_OLD) and the batched one, exchange in the
# state for all; (b) host-staged's fused grid: rows spread over blocks while the grid stays
# within TPAR_X_HS_GRID blocks (0: one block per row, 64: always spread).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TPAR_CACHE_DIR=/tmp/tpar-cache
S=.stage/s5d; T=$S/tpar
R=$OUT/r; L=$R/logs; mkdir -p $L
summary=()
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
  timeout "$limit" "$@" >"$L/$name.log" 2>&1; local rc=$?
  summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(grep -E '^selftest:|passed|failed|FAIL|rror' "$L/$name.log" | tail -1 | cut -c1-100)")"); }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; cat $S/TREE; } > $L/device.txt
declare -A V=( [old]="-DTPAR_X_OLD=1" [b1]="-DTPAR_X_BATCH1=1" [new]="-DTPAR_X_NEW=1" )
order="old b1 new old2 b1b"
for v in $order; do
  d=${V[${v%2}]:-${V[${v%b}]}}
  step $v-2 60 env TPAR_KERNEL_DEFINES="$d" $T bench --fused -n 2 --algos one-shot --tokens 1,8,16 --json $R/$v-2.json
  step $v-8 60 env TPAR_KERNEL_DEFINES="$d" $T bench --fused -n 8 --algos one-shot --tokens 1,8 --json $R/$v-8.json
done
step sel-b1 100 env TPAR_KERNEL_DEFINES="-DTPAR_X_BATCH1=1" $T selftest -n 2
for g in 0 4 8 16 64 8; do
  step hs-g$g 60 env TPAR_KERNEL_DEFINES="-DTPAR_X_OLD=1" TPAR_X_HS_GRID=$g $T bench --fused -n 2 --algos host-staged --tokens 1,2,4,8,16 --json $R/hs-g$g.json
done
step sel-hs8 100 env TPAR_KERNEL_DEFINES="-DTPAR_X_OLD=1" TPAR_X_HS_GRID=8 $T selftest -n 2 --algos host-staged
for v in $order; do echo "== $v"; grep -hE '^[0-9]' $L/$v-2.log $L/$v-8.log | awk '{printf "%sx%s ar %s fused %s | ", $1,$2,$6,$9}'; echo; done
for g in 0 4 8 16 64; do echo "== hs grid $g"; grep -hE '^[0-9]' $L/hs-g$g.log | awk '{printf "%sx%s ar %s a+n %s fused %s | ", $1,$2,$6,$8,$9}'; echo; done
printf '%s\n' "${summary[@]}"
tar czf $OUT/all.tgz -C $OUT r && rm -rf $R
