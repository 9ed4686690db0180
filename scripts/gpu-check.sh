#!/usr/bin/env bash
# The GPU checks of the CUDA backend, for the device machine (no cargo there: carry a built
# target/release/tpar). Writes logs and JSON under $OUT (or ./gpu-out) and prints a summary.
# Usage: scripts/gpu-check.sh [smoke|full|tools|auto]   (tools: doctor, tune, NCCL and plots;
# auto: the dispatched call; multi: one process per GPU against NCCL, on a multi-GPU machine)
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TPAR_CACHE_DIR=/tmp/tpar-cache
tpar=./target/release/tpar
mode=${1:-full}
summary=()
step() { # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(grep -E '^selftest:' "$out/$name.log" | tail -1)")")
}
sizes=0,4K,8K,16K,32K,42K,64K,128K,256K,1M,4M,8M
if [ "$mode" = tools ]; then
  # At most 8 files come back from the device machine: logs of the steps go to /tmp.
  logs=/tmp/gpu-logs; mkdir -p $logs
  out_final=$out; out=$logs
  step selftest-1 120 $tpar selftest --backend cuda -n 1 --counts 0,7,4099,70001 --replays 20
  step doctor 120 $tpar doctor
  cp $logs/doctor.log $out_final/doctor.txt
  $tpar doctor --json > $out_final/doctor.json 2>/dev/null
  step tune-8 300 $tpar tune --world-size 8 --json "$out_final/tune-8.json"
  step doctor-8-tuned 120 $tpar doctor -n 8
  cat $logs/tune-8.log $logs/doctor-8-tuned.log > $out_final/tune-8-and-doctor.txt
  step bench-nccl-1 200 $tpar bench --backend cuda -n 1 --sizes 4K,32K,256K,1M,4M,16M,64M --json "$out_final/bench-cuda-1-nccl.json" --plot "$out_final/bench-cuda-1.svg"
  step bench-plot-2 200 $tpar bench --backend cuda -n 2 --sizes 4K,16K,42K,128K,512K,2M,8M --json "$out_final/bench-cuda-2-plot.json" --plot "$out_final/bench-cuda-2.svg"
elif [ "$mode" = auto ]; then
  # The one call behind which the dispatcher picks tpar or NCCL (and TPAR_ALGO forces).
  step selftest-processes-4 200 $tpar selftest --backend cuda -n 4 --processes --counts 0,7,4099,65541 --replays 20
  step bench-auto-1 120 $tpar bench --backend cuda -n 1 --sizes 4K,256K,16M --json "$out/bench-auto-1.json"
  step bench-auto-8 120 $tpar bench --backend cuda -n 8 --sizes 4K,42K,256K,4M --algos auto,one-shot,two-shot --json "$out/bench-auto-8.json"
  TPAR_ALGO=host-staged step bench-forced-host-2 120 $tpar bench --backend cuda -n 2 --sizes 4K,42K --algos auto
  TPAR_ALGO=nccl step bench-forced-nccl-2 120 $tpar bench --backend cuda -n 2 --sizes 4K --algos auto
elif [ "$mode" = multi ]; then
  # One process per GPU: tpar's algorithms beside NCCL in the same run, then host-staged
  # against NCCL without P2P (its shared-memory path through host memory: the same wires).
  nvidia-smi topo -m > $out/topo.txt 2>&1
  n=$(nvidia-smi -L | wc -l)
  step selftest-multi 150 $tpar selftest --backend cuda -n $n --processes --counts 0,7,4099,65541 --replays 20
  step bench-multi 200 $tpar bench --backend cuda -n $n --processes --sizes 4K,32K,42K,256K,1M,16M --iters 50 --json "$out/bench-multi-processes.json" --plot "$out/bench-multi.svg"
  NCCL_P2P_DISABLE=1 step bench-multi-nop2p 150 $tpar bench --backend cuda -n $n --processes --algos host-staged,nccl --sizes 4K,42K,256K --iters 50 --json "$out/bench-multi-nop2p.json"
elif [ "$mode" = smoke ]; then
  step selftest-threads-2 120 $tpar selftest --backend cuda -n 2 --counts 0,1,7,1023,70001 --replays 20
  step bench-threads-2 120 $tpar bench --backend cuda -n 2 --sizes 4K,42K,1M --iters 20 --chain 20
else
  step selftest-threads-8 300 $tpar selftest --backend cuda -n 8 --counts 0,1,7,1023,65541,1048579,2097152
  step selftest-processes-4 300 $tpar selftest --backend cuda -n 4 --processes --counts 0,1,7,1023,65541 --replays 50
  step bench-threads-2 200 $tpar bench --backend cuda -n 2 --sizes $sizes --json "$out/bench-cuda-2.json"
  step bench-threads-8 200 $tpar bench --backend cuda -n 8 --sizes $sizes --json "$out/bench-cuda-8.json"
fi
for f in "$out"/bench-multi*.log "$out"/bench-threads-*.log "$out"/bench-auto-*.log "$out"/bench-forced-*.log "$out"/doctor*.log "$out"/tune-8.log "$out"/bench-nccl-1.log "$out"/bench-plot-2.log; do
  [ -f "$f" ] && { echo "== $f"; grep -vE '^\[' "$f" | tail -n 40; }
done
printf '%s\n' "${summary[@]}"
