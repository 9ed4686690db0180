#!/usr/bin/env bash
# acuda (issue 17, the CUDA backend in files of one concern): the checks its changes need on one
# GPU. The span API's own test binary (cudarc buffers as spans: allreduce out of place and in
# place on every algorithm, the fused op against the CPU reference, operands refused by name),
# then the self-tests through both group constructors (threads: new_local_group; processes: the
# rendezvous and CUDA IPC path, with join's init self-test on spans), and a short bench to set
# beside the same bench of main. Run from the repository root with the binaries carried:
#   cargo build --release -p tpar-cli
#   cp "$(cargo test --release -p tpar --test cuda_spans --no-run 2>&1 \
#        | grep -o 'target/release/deps/cuda_spans-[0-9a-f]*' | head -1)" target/release/cuda_spans
# Logs and JSON go to $OUT; the table comes last. One call, under 5 minutes.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TPAR_CACHE_DIR=/tmp/tpar-cache
OUT=${OUT:-/tmp/gpu-acuda}
mkdir -p "$OUT"
tpar=${TPAR:-./target/release/tpar}
spans=${SPANS:-./target/release/cuda_spans}
# The test binary does not restart itself with NVRTC on the loader's path as tpar does.
nvrtc=$(timeout 20 find /usr/local /opt /usr/lib /root /home -name 'libnvrtc.so.1*' 2>/dev/null | head -1)
[ -n "$nvrtc" ] && export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
summary=()
step() { # name, timeout seconds, command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" \
    "$(grep -E '^selftest|test result|passed|failed|rror' "$OUT/$name.log" | tail -1 | cut -c1-100)")")
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } >"$OUT/device.txt"
sel="selftest --backend cuda --counts 0,7,4099,65541 --replays 20 --timeout 10"
step spans 60 "$spans" --test-threads=1 --nocapture
step selftest-threads-2 60 $tpar $sel -n 2
step selftest-threads-8 90 $tpar $sel -n 8
step selftest-processes-2 60 $tpar $sel -n 2 --processes
step bench-threads-2 60 $tpar bench --backend cuda -n 2 --sizes 4K,42K,256K,1M --iters 50 \
  --json "$OUT/bench-threads-2.json"
for f in spans selftest-threads-2 selftest-threads-8 selftest-processes-2; do
  echo "== $f: failing lines"
  grep -E 'FAIL|panicked|rror' "$OUT/$f.log" | head -8
done
echo "== bench-threads-2"
grep -vE '^\[|^wrote' "$OUT/bench-threads-2.log" | tail -8
cat "$OUT/device.txt"
printf '%s\n' "${summary[@]}"
