# Session 5, call 3 (one H200): where the batched fused one-shot kernel's +0.3 us at 2 ranks x
# 1-8 tokens comes from. One binary whose fused_oneshot.cu is fused_oneshot.experiment.cu,
# variants by TPAR_KERNEL_DEFINES: TPAR_X_OLD=1 the unbatched body of 4527420, TPAR_X_EXCH the
# exchange lines (0: this rank's inbox slot as in 4527420; n: device state + n words).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TPAR_CACHE_DIR=/tmp/tpar-cache
S=.stage/s5c; T=$S/tpar; B="env TPAR_CACHE_DIR=/tmp/tpar-cache-base .stage/s5a/tpar"
R=$OUT/r; L=$R/logs; mkdir -p $L
summary=()
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
  timeout "$limit" "$@" >"$L/$name.log" 2>&1; local rc=$?
  summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(grep -E '^selftest:|passed|failed|FAIL|rror' "$L/$name.log" | tail -1 | cut -c1-100)")"); }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; cat $S/TREE; } > $L/device.txt
declare -A V=( [new2]="" [new16]="-DTPAR_X_EXCH=16" [old2]="-DTPAR_X_OLD=1" [old16]="-DTPAR_X_OLD=1 -DTPAR_X_EXCH=16" [old0]="-DTPAR_X_OLD=1 -DTPAR_X_EXCH=0" )
order="base new2 new16 old2 old16 old0 new2b base2"
for v in $order; do
  case $v in base|base2) X=$B;; new2b) X="env TPAR_KERNEL_DEFINES= $T";; *) X="env TPAR_KERNEL_DEFINES=${V[$v]} $T";; esac
  [ $v = new2 ] && X="$T"
  step $v-2 60 $X bench --fused -n 2 --algos one-shot --tokens 1,8,16,32 --json $R/$v-2.json
  step $v-8 60 $X bench --fused -n 8 --algos one-shot --tokens 1,4,8,16 --json $R/$v-8.json
done
step sel-old16 150 env TPAR_KERNEL_DEFINES="-DTPAR_X_OLD=1 -DTPAR_X_EXCH=16" $T selftest -n 2
for v in $order; do echo "== $v"; grep -hE '^[0-9]' $L/$v-2.log $L/$v-8.log | awk '{printf "%sx%s ar %s fused %s | ", $1,$2,$6,$9}'; echo; done
printf '%s\n' "${summary[@]}"
tar czf $OUT/all.tgz -C $OUT r && rm -rf $R
